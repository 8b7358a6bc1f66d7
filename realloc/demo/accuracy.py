"""Exact-match accuracy of an HF checkpoint on held-out prompts, decoded greedily with transformers.

    python -m realloc.demo.accuracy CHECKPOINT experiments/data/arith_eval.jsonl [--max-new-tokens 5]
    exact_match_accuracy("ckpt/sft", "experiments/data/arith_eval.jsonl").accuracy

Each record needs a prompt (text, chat or token ids, read like a run's prompts with ``DataConfig``) and an
``answer``; a response scores 1 when :func:`realloc.algorithms.rewards.text_rules.exact_number_match` accepts it.
``right_value`` also counts responses whose first number has the answer's value in another form ("007" for
"7"), so that a gain in exact match can be told apart from a gain in arithmetic.
The tokenizer is the checkpoint's own (or ``tokenizer=``). This is an independent check of a run's
exported model: transformers' ``generate``, not realloc's generation.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Sequence

from realloc.data.config import DataConfig


@dataclasses.dataclass(frozen=True)
class Accuracy:
    n: int
    correct: int
    right_value: int  # the first number equals the answer as an integer, however written
    examples: tuple[tuple[str, str, str], ...]  # (prompt, response, answer) of the first few prompts

    @property
    def accuracy(self) -> float:
        return self.correct / self.n

    @property
    def value_accuracy(self) -> float:
        return self.right_value / self.n

    def describe(self) -> str:
        return (f"exact match {self.correct}/{self.n} = {self.accuracy:.1%} (right value in any form "
                f"{self.value_accuracy:.1%})")


def exact_match_accuracy(checkpoint: str | Path, prompts: str | Path, *, tokenizer: str | Path | None = None,
                         max_new_tokens: int = 8, prompt_len: int = 256, batch_size: int = 256,
                         answer_key: str = "answer", config: DataConfig = DataConfig(),
                         n_examples: int = 5) -> Accuracy:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from realloc.algorithms.rewards.text_rules import exact_number_match, first_number
    from realloc.data.prompts import PromptDataset
    from realloc.data.tokenizer import Tokenizer

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"accuracy: {str(checkpoint)!r} is not an HF checkpoint directory (no config.json)")
    tok = Tokenizer.load(tokenizer if tokenizer is not None else checkpoint)
    data = PromptDataset.load(prompts, prompt_len, tokenizer=tok, config=config)
    answers = data.field(answer_key)
    if any(a is None for a in answers):
        raise ValueError(f"accuracy: dataset {prompts}: row {answers.index(None)} has no {answer_key!r}; every "
                         f"held-out prompt needs its reference answer")
    hf_logging.disable_progress_bar()  # the "Loading weights" bar, once per call
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True).eval()
    pad = tok.pad_token_id
    correct, right_value, examples = 0, 0, []
    for start in range(0, len(data), batch_size):
        rows = list(range(start, min(start + batch_size, len(data))))
        ids = [data.prompt_tokens(r) for r in rows]
        width = max(map(len, ids))
        # Left padding: every prompt ends at the same column, where generation starts.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=list(tok.eos_token_ids) or None,
                                 pad_token_id=pad)
        for r, p, gen in zip(rows, ids, out[:, width:].tolist()):
            prompt_text, response = tok.decode(p), tok.decode(gen)
            correct += int(exact_number_match(prompt_text, response, str(answers[r])))
            got = first_number(response)
            right_value += int(got is not None and _as_int(got) == _as_int(str(answers[r]).strip()))
            if len(examples) < n_examples:
                examples.append((prompt_text, response, str(answers[r])))
    return Accuracy(len(data), correct, right_value, tuple(examples))


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m realloc.demo.accuracy", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="HF checkpoint directory (config.json, safetensors, tokenizer files)")
    p.add_argument("prompts", help="JSONL or Parquet file of prompts with an answer field")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--examples", type=int, default=5, help="print this many prompts with their responses")
    args = p.parse_args(argv)
    try:
        acc = exact_match_accuracy(args.checkpoint, args.prompts, tokenizer=args.tokenizer,
                                   max_new_tokens=args.max_new_tokens, answer_key=args.answer_key,
                                   n_examples=args.examples)
    except ValueError as e:
        print(f"accuracy: error: {e}", file=sys.stderr)
        return 2
    for prompt, response, answer in acc.examples:
        print(f"{prompt!r} -> {response!r} (answer {answer})")
    print(acc.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
