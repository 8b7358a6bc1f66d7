"""The tool demo's task: a three-digit number times a two-digit one, with or without a calculator tool.

    python -m realloc.demo.calc_task --out experiments/data     # the JSONL files and the tokenizer

A problem is ``"a*b="`` with ``a`` in 100..999 and ``b`` in 10..99 (81,000 problems, shuffled once with the seed
and cut into disjoint parts). Each prompt record carries its ``answer``. The SFT records come in two forms:

- with the tool (``calc_sft_tool.jsonl``): the response is the whole conversation, the call ``<c>a*b</c>`` and
  its EOS, the calculator's answer as ``ToolEnv`` writes it (``<r>5535</r>``), then the final answer:
  ``{"prompt": "123*45=", "response": "<c>123*45</c><|eos|><r>5535</r>5535"}``;
- without (``calc_sft_direct.jsonl``): ``{"prompt": "123*45=", "response": "5535"}``.

The tokenizer is the arithmetic demo's character tokenizer (``arith_task.train_tokenizer``) over the characters
of these texts. Everything is a pure function of the seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Sequence

CHARACTERS = "0123456789*=<>/cr"
TOOL = "c"  # the calculator's tag: <c>123*45</c>
RESULT_FORMAT = "<r>{}</r>"
EOS_TEXT = "<|eos|>"

TRAIN_FILE = "calc_train.jsonl"
EVAL_FILE = "calc_eval.jsonl"
SFT_TOOL_FILE = "calc_sft_tool.jsonl"
SFT_DIRECT_FILE = "calc_sft_direct.jsonl"
TOKENIZER_DIR = "calc_tokenizer"


@dataclasses.dataclass(frozen=True)
class Split:
    seed: int = 0
    n_eval: int = 200
    n_sft: int = 1000  # a few tool-use traces (1.2% of the problems)
    n_train: int = 4000


def problems() -> list[tuple[str, str]]:
    return [(f"{a}*{b}=", str(a * b)) for a in range(100, 1000) for b in range(10, 100)]


def split(cfg: Split = Split()) -> dict[str, list[tuple[str, str]]]:
    items = problems()
    random.Random(cfg.seed).shuffle(items)
    cuts = {"eval": cfg.n_eval, "sft": cfg.n_sft, "train": cfg.n_train}
    out, i = {}, 0
    for name, k in cuts.items():
        out[name] = items[i:i + k]
        i += k
    return out


def tool_trace(prompt: str, answer: str) -> str:
    call = prompt.rstrip("=")
    return f"<{TOOL}>{call}</{TOOL}>{EOS_TEXT}{RESULT_FORMAT.format(answer)}{answer}"


def files(cfg: Split = Split()) -> dict[str, str]:
    parts = split(cfg)

    def jsonl(records: list[dict]) -> str:
        return "".join(json.dumps(r) + "\n" for r in records)

    return {
        TRAIN_FILE: jsonl([{"prompt": p, "answer": a} for p, a in parts["train"]]),
        EVAL_FILE: jsonl([{"prompt": p, "answer": a} for p, a in parts["eval"]]),
        SFT_TOOL_FILE: jsonl([{"prompt": p, "response": tool_trace(p, a)} for p, a in parts["sft"]]),
        SFT_DIRECT_FILE: jsonl([{"prompt": p, "response": a} for p, a in parts["sft"]]),
    }


def write_data(out_dir: str | Path, cfg: Split = Split()) -> list[Path]:
    from realloc.demo.arith_task import train_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files(cfg).items():
        (out_dir / name).write_text(text)
        written.append(out_dir / name)
    written.append(train_tokenizer(out_dir / TOKENIZER_DIR, CHARACTERS))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m realloc.demo.calc_task", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSONL files and the tokenizer")
    args = p.parse_args(argv)
    for path in write_data(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
