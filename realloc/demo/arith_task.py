"""The demo task: one- and two-digit addition and subtraction with a verifiable answer.

    python -m realloc.demo.arith_task data --out experiments/data        # the shipped JSONL files
    python -m realloc.demo.arith_task tokenizer --out experiments/data/arith_tokenizer  # its tokenizer

A problem is ``"a+b="`` or ``"a-b="`` with ``a, b`` in 0..99 and, for subtraction, ``a >= b``, so
every answer is a non-negative number of one to three digits. All 15,050 problems are shuffled once
with the seed and cut into disjoint parts: the held-out prompts, the SFT pairs, and the prompts for
RL. Each prompt record carries its ``answer`` (a string); an SFT record is ``{"prompt", "response"}``; a
preference record (DPO) is ``{"prompt", "chosen", "rejected"}``: the right answer and a wrong one
(``arith_pairs_small.jsonl``: the first 64, which a tiny model can learn to rank in a short run;
``arith_pairs_eval.jsonl``: one pair per held-out prompt, a reward model's eval set).
The demo's SFT data (``arith_sft_padded.jsonl``) is the SFT pairs with most answers zero-padded to
three digits, the way a fixed-width source prints them; the grader wants the number as written.
Everything is a pure function of the seed, so the files in ``experiments/data/`` are re-made byte for
byte by the first command above (a test checks it).

The tokenizer maps every character to one token (digits, ``+``, ``-``, ``=``, space) plus
``<|pad|>``, ``<|bos|>``, ``<|eos|>`` and ``<|unk|>``; BOS goes in front of encoded text and a
response ends with EOS. It is a ``tokenizers`` WordLevel model trained on the task's text and saved
as an HF tokenizer directory (``AutoTokenizer.from_pretrained`` loads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Sequence

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")  # ids 0..3
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARACTERS = "0123456789+-= "
OPERATORS = ("+", "-")
MAX_OPERAND = 99

TRAIN_FILE = "arith_train.jsonl"  # RL prompts with answers
EVAL_FILE = "arith_eval.jsonl"  # held-out prompts with answers
SFT_FILE = "arith_sft.jsonl"  # prompt/response pairs
PAIRS_FILE = "arith_pairs.jsonl"  # prompt/chosen/rejected preference pairs (DPO)
SMALL_PAIRS_FILE = "arith_pairs_small.jsonl"  # the first SMALL_PAIRS of them (dpo_tiny.py)
SMALL_PAIRS = 64
EVAL_PAIRS_FILE = "arith_pairs_eval.jsonl"  # pairs on the held-out prompts (a reward model's eval set)
PADDED_FILE = "arith_sft_padded.jsonl"  # the SFT pairs as a fixed-width source writes them (the demo's SFT data)


@dataclasses.dataclass(frozen=True)
class Split:
    """How many problems go to each part (disjoint, in this order of the seeded shuffle)."""

    seed: int = 0
    n_eval: int = 500
    n_sft: int = 4000
    n_train: int = 4000
    n_pairs: int = 1000  # preference pairs, made from the first SFT problems
    pad_share: float = 0.75  # PADDED_FILE: the share of answers written with three digits ("7" as "007")



def problems() -> list[tuple[str, str]]:
    """Every (prompt, answer) of the task, in a fixed order."""
    out = []
    for a in range(MAX_OPERAND + 1):
        for b in range(MAX_OPERAND + 1):
            out.append((f"{a}+{b}=", str(a + b)))
            if a >= b:
                out.append((f"{a}-{b}=", str(a - b)))
    return out


def split(cfg: Split = Split()) -> dict[str, list[tuple[str, str]]]:
    """The held-out, SFT and RL parts: disjoint, each a pure function of ``cfg``."""
    every = problems()
    if cfg.n_eval + cfg.n_sft + cfg.n_train > len(every):
        raise ValueError(f"arith_task.split: {cfg.n_eval} + {cfg.n_sft} + {cfg.n_train} problems asked for, but the "
                         f"task has only {len(every)}")
    random.Random(cfg.seed).shuffle(every)
    a, b = cfg.n_eval, cfg.n_eval + cfg.n_sft
    return {"eval": every[:a], "sft": every[a:b], "train": every[b:b + cfg.n_train]}


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer one slip away from ``answer``: the units or the tens digit off by one (never negative)."""
    value = int(answer)
    steps = [d for d in (1, -1, 10, -10) if value + d >= 0]
    return str(value + rng.choice(steps))


def wrong_answer(prompt: str, answer: str, rng: random.Random) -> str:
    """A mistake a weak model makes: half the time a number copied from the question (when it is not the
    answer), otherwise a near miss."""
    operands = [x for x in prompt.rstrip("=").replace("-", "+").split("+") if x != answer]
    if operands and rng.random() < 0.5:
        return rng.choice(operands)
    return near_miss(answer, rng)


def preference_pairs(cfg: Split = Split()) -> list[dict[str, str]]:
    """``{"prompt", "chosen", "rejected"}``: the right answer preferred over a wrong one (``wrong_answer``), for
    the first ``n_pairs`` SFT problems (the wrong answers drawn with the split's seed)."""
    sft = split(cfg)["sft"]
    if cfg.n_pairs > len(sft):
        raise ValueError(f"arith_task.preference_pairs: {cfg.n_pairs} pairs asked for, but the SFT part has only "
                         f"{len(sft)} problems")
    rng = random.Random(f"pairs/{cfg.seed}")
    return [{"prompt": p, "chosen": a, "rejected": wrong_answer(p, a, rng)} for p, a in sft[:cfg.n_pairs]]


def eval_preference_pairs(cfg: Split = Split()) -> list[dict[str, str]]:
    """Preference pairs on the held-out prompts (one per eval problem, wrong answers drawn as in
    ``preference_pairs`` from their own stream): a reward model trained on ``PAIRS_FILE`` never saw them."""
    rng = random.Random(f"eval-pairs/{cfg.seed}")
    return [{"prompt": p, "chosen": a, "rejected": wrong_answer(p, a, rng)} for p, a in split(cfg)["eval"]]


def padded_sft(cfg: Split = Split()) -> list[dict[str, str]]:
    """The SFT pairs with a ``pad_share`` of the answers zero-padded to three digits (drawn with the split's
    seed), as a source that prints fixed-width numbers would write them. The exact-match grader reads
    "007" as a different number from "7", so a model that copies the habit is marked wrong on those."""
    rng = random.Random(f"padded/{cfg.seed}")
    return [{"prompt": p, "response": a.zfill(3) if rng.random() < cfg.pad_share else a}
            for p, a in split(cfg)["sft"]]


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def files(cfg: Split = Split()) -> dict[str, str]:
    """File name -> content of the shipped data files."""
    parts = split(cfg)
    return {TRAIN_FILE: _jsonl([{"prompt": p, "answer": a} for p, a in parts["train"]]),
            EVAL_FILE: _jsonl([{"prompt": p, "answer": a} for p, a in parts["eval"]]),
            SFT_FILE: _jsonl([{"prompt": p, "response": a} for p, a in parts["sft"]]),
            PAIRS_FILE: _jsonl(preference_pairs(cfg)),
            SMALL_PAIRS_FILE: _jsonl(preference_pairs(cfg)[:SMALL_PAIRS]),
            EVAL_PAIRS_FILE: _jsonl(eval_preference_pairs(cfg)),
            PADDED_FILE: _jsonl(padded_sft(cfg))}


def write_data(out_dir: str | Path, cfg: Split = Split()) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files(cfg).items():
        (out_dir / name).write_text(text, encoding="utf-8")
        written.append(out_dir / name)
    return written


def train_tokenizer(out_dir: str | Path, characters: str = CHARACTERS) -> Path:
    """Train the task's character-level tokenizer (one token per character of ``characters``) and save it as an
    HF tokenizer directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from realloc.tiny_assets.hf import write_generation_config

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join the characters back without separators
    # Trained on the alphabet itself: every character once, so the trainer keeps them all and, with equal
    # counts, orders them lexicographically (" +-0123456789=" -> ids 4..17) whatever the task's text.
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.train_from_iterator(list(characters), trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, BOS_ID)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=SPECIAL_TOKENS[EOS_ID],
                                 pad_token=SPECIAL_TOKENS[PAD_ID], unk_token=SPECIAL_TOKENS[UNK_ID])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    cfg_file = out_dir / "tokenizer_config.json"  # the class name that transformers 4 and 5 both load
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"},
                                   indent=2, sort_keys=True) + "\n")
    write_generation_config(out_dir, BOS_ID, [EOS_ID], PAD_ID)
    return out_dir


# -- command line ----------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m realloc.demo.arith_task", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help=f"write {TRAIN_FILE}, {EVAL_FILE}, {SFT_FILE}, {PAIRS_FILE}, {SMALL_PAIRS_FILE} "
                                    f"and {PADDED_FILE}")
    d.add_argument("--out", required=True)
    for field in dataclasses.fields(Split):
        d.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    t = sub.add_parser("tokenizer", help="train the character tokenizer and save it as an HF directory")
    t.add_argument("--out", required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "data":
            cfg = Split(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Split)})
            out = write_data(args.out, cfg)
        else:
            out = [train_tokenizer(args.out)]
    except ValueError as e:
        print(f"arith_task {args.command}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(map(str, out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
