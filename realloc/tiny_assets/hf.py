"""Tiny HuggingFace assets made locally (nothing is downloaded): a BPE tokenizer and random checkpoints.

    tok = train_tokenizer("experiments/data/tiny_corpus.txt", "/tmp/tok", vocab_size=500)
    make_tiny_checkpoint("/tmp/actor", arch="qwen2", kv_heads=1, tie=True, tokenizer_dir=tok)
    make_tiny_checkpoint("/tmp/reward", head="seqcls", tokenizer_dir=tok)

From the shell (``--help`` on each command lists the options)::

    python -m realloc.tiny_assets.hf data --out experiments/data
    python -m realloc.tiny_assets.hf tokenizer --corpus experiments/data/tiny_corpus.txt --out /tmp/tok
    python -m realloc.tiny_assets.hf checkpoint --out /tmp/actor --arch qwen2 --tokenizer /tmp/tok

The tokenizer is a byte-level BPE (the ``tokenizers`` library, Qwen2's pre-tokenization) with ``<|pad|>``, ``<|bos|>``,
``<|eos|>``, ``<|im_start|>`` and ``<|im_end|>`` as ids 0-4, BOS added in front of encoded text,
and a ChatML-like chat template in ``tokenizer_config.json``. Like a chat model's directory it holds
a ``generation_config.json`` whose ``eos_token_id`` is ``[<|eos|>, <|im_end|>]``: a reply ends a
turn with ``<|im_end|>``.

Checkpoints are random and deterministic for a seed; ``arch`` is llama, qwen2, qwen3 (head_dim hidden / heads,
not Qwen3Config's 128), mistral (no sliding window, as v0.2+), phi3 (fused qkv_proj / gate_up_proj) or gemma
(head_dim hidden / heads). Norm weights (Qwen3's q/k head norms too) and
linear biases (Qwen2's q/k/v projections) are drawn at random too, not left at HF's 1 and 0, so that a loader
which drops or mixes them up fails a comparison against transformers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Literal, Sequence

import torch

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")  # ids 0..4
PAD_ID, BOS_ID, EOS_ID, IM_END_ID = 0, 1, 2, 4
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(corpus: str | Path, out_dir: str | Path, vocab_size: int = 500) -> Path:
    """Train a byte-level BPE on a text file; save it as an HF tokenizer directory that AutoTokenizer loads."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    corpus, out_dir = Path(corpus), Path(out_dir)
    if not corpus.is_file():
        raise ValueError(f"train_tokenizer: corpus {str(corpus)!r} does not exist; pass a text file")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size} is below the {len(alphabet)} bytes and "
                         f"{len(SPECIAL_TOKENS)} special tokens a byte-level BPE needs")
    tok = Tokenizer(models.BPE())
    # transformers loads any tokenizer found in a Qwen2 checkpoint as its Qwen2Tokenizer, which rebuilds
    # this normalizer and pre-tokenizer. Training with the same ones gives the same ids in a LLaMA
    # directory, a Qwen2 directory and the bare tokenizer directory.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                                 initial_alphabet=alphabet, show_progress=False))
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, BOS_ID)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=SPECIAL_TOKENS[EOS_ID],
                                 pad_token=SPECIAL_TOKENS[PAD_ID])
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    # Put the chat template in tokenizer_config.json, where most published checkpoints keep it
    # (transformers 5 would write a separate chat_template.jinja).
    cfg_file = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(chat_template=CHAT_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    write_generation_config(out_dir, BOS_ID, [EOS_ID, IM_END_ID], PAD_ID)
    return out_dir


def write_generation_config(out_dir: Path, bos: int | None, eos: Sequence[int], pad: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=bos, eos_token_id=list(eos) if len(eos) > 1 else eos[0],
                     pad_token_id=pad).save_pretrained(str(out_dir))


ARCHS = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
         "gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3Text"}  # arch -> transformers prefix
# Keys beyond the shared ones: Qwen3Config's and the Gemma configs' head_dim default to 128 and 256 (set to hidden /
# heads below), MistralConfig's window to 4096 tokens (none here: full attention, as Mistral v0.2+). Gemma 2 and 3
# keep their configs' windows (4096 tokens: longer than these models' positions, read as none) and caps (Gemma 2's
# 50 and 30); Gemma 3's RoPE base is one for both layer types here.
FAMILY_KEYS = {"mistral": {"sliding_window": None}}


def _model_class(arch: str, head: str):
    import transformers

    prefix = ARCHS.get(arch)
    suffix = {"causal": "ForCausalLM", "seqcls": "ForSequenceClassification"}.get(head)
    if prefix is None or suffix is None:
        raise ValueError(f"make_tiny_checkpoint: arch must be one of {', '.join(map(repr, ARCHS))} and head "
                         f"'causal' or 'seqcls', got arch={arch!r}, head={head!r}")
    if arch == "gemma3" and head == "causal":  # Gemma3TextConfig's causal LM is Gemma3ForCausalLM
        prefix = "Gemma3"
    return getattr(transformers, ARCHS[arch] + "Config"), getattr(transformers, prefix + suffix)


def make_tiny_checkpoint(out_dir: str | Path,
                         arch: Literal["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2",
                                       "gemma3"] = "llama",
                         head: Literal["causal", "seqcls"] = "causal", vocab_size: int | None = None,
                         hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                         intermediate: int = 176, tie: bool = False, seed: int = 0,
                         max_shard_size: str | int | None = None, tokenizer_dir: str | Path | None = None,
                         max_position_embeddings: int = 256, rope_theta: float = 10000.0,
                         init_std: float = 0.1) -> Path:
    """Save a random tiny model with save_pretrained (safetensors, sharded below ``max_shard_size``).

    ``head="seqcls"`` makes a one-label sequence-classification model (a reward model or critic).
    ``vocab_size`` defaults to the tokenizer's (else 128). ``init_std`` 0.1 rather than HF's 0.02
    gives peaked logits, so greedy decoding has clear winners in tests.
    """
    from realloc.data.tokenizer import Tokenizer

    out_dir = Path(out_dir)
    config_cls, model_cls = _model_class(arch, head)
    if head == "seqcls" and tie:
        raise ValueError("make_tiny_checkpoint: a sequence-classification model has no output embedding to tie")
    tokenizer = Tokenizer.load(tokenizer_dir) if tokenizer_dir is not None else None
    if vocab_size is None:
        vocab_size = tokenizer.vocab_size if tokenizer else 128
    if tokenizer:
        tokenizer.check_model_vocab(vocab_size, "make_tiny_checkpoint")
        bos, eos, pad = tokenizer.bos_token_id, list(tokenizer.eos_token_ids) or [EOS_ID], tokenizer.pad_token_id
    else:
        bos, eos, pad = BOS_ID, [EOS_ID], PAD_ID
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        tie_word_embeddings=tie, rms_norm_eps=1e-6, max_position_embeddings=max_position_embeddings,
                        rope_parameters=({t: {"rope_type": "default", "rope_theta": rope_theta}
                                          for t in ("full_attention", "sliding_attention")} if arch == "gemma3" else
                                         {"rope_type": "default", "rope_theta": rope_theta}),
                        initializer_range=init_std, bos_token_id=bos, eos_token_id=eos[0], pad_token_id=pad,
                        **({"num_labels": 1} if head == "seqcls" else {}), **FAMILY_KEYS.get(arch, {}),
                        **({"head_dim": hidden // heads} if arch in ("qwen3", "gemma", "gemma2", "gemma3") else {}))
    with torch.random.fork_rng(devices=[]):  # deterministic for the seed, and the caller's RNG is untouched
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):  # the block's and final norms, Qwen3's q_norm / k_norm
                    # Gemma's norms scale by 1 + weight: around 0, as HF starts them, for the same scales
                    p.copy_((0 if arch.startswith("gemma") else 1) + init_std * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(init_std * torch.randn_like(p))
    out_dir.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(str(out_dir), safe_serialization=True, **kw)
    write_generation_config(out_dir, bos, eos, pad)
    for f in tokenizer.files() if tokenizer else []:
        shutil.copy2(f, out_dir / f.name)
    return out_dir


# -- command line ----------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m realloc.tiny_assets.hf", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="write the tiny corpus and prompt files")
    d.add_argument("--out", required=True)
    t = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a text file")
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, default=500)
    c = sub.add_parser("checkpoint", help="save a tiny random LLaMA, Qwen2, Qwen3 or Mistral checkpoint")
    c.add_argument("--out", required=True)
    c.add_argument("--arch", default="llama", choices=list(ARCHS))
    c.add_argument("--head", default="causal", choices=["causal", "seqcls"])
    c.add_argument("--tokenizer", default=None, help="tokenizer directory to copy in (sets the vocabulary size)")
    for name, default in (("vocab-size", None), ("hidden", 64), ("layers", 2), ("heads", 4), ("kv-heads", 2),
                          ("intermediate", 176), ("seed", 0)):
        c.add_argument(f"--{name}", type=int, default=default)
    c.add_argument("--tie", action="store_true", help="tie the output projection to the embedding")
    c.add_argument("--max-shard-size", default=None, help="e.g. 50KB: write a sharded checkpoint")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "data":
            from realloc.tiny_assets.text import write_all

            out = write_all(args.out)
        elif args.command == "tokenizer":
            out = [train_tokenizer(args.corpus, args.out, args.vocab_size)]
        else:
            out = [make_tiny_checkpoint(args.out, args.arch, args.head, args.vocab_size, args.hidden, args.layers,
                                        args.heads, args.kv_heads, args.intermediate, args.tie, args.seed,
                                        args.max_shard_size, args.tokenizer)]
    except ValueError as e:
        print(f"tiny_hf {args.command}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(map(str, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
