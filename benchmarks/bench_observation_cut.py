"""A huge observation: tokenize-then-cut (what a multi-turn rollout did) against the cut first
(realloc/envs/observation_cut.py), on ``--mb`` MB of story text with the tiny byte-level BPE (Qwen2's
pre-tokenization). The columns are the seconds of each, their ratio, and whether the budget's tokens are the same.

    .venv/bin/python benchmarks/bench_observation_cut.py --mb 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from realloc.data.tokenizer import Tokenizer
from realloc.envs.observation_cut import cut_observation
from realloc.tiny_assets import hf as tiny_hf
from realloc.tiny_assets.text import corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 4096])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "corpus.txt").write_text(corpus())
        tok = Tokenizer.load(str(tiny_hf.train_tokenizer(Path(d) / "corpus.txt", Path(d) / "bpe", vocab_size=500)))
    story = corpus(seed=5)
    n = int(a.mb * 1e6)
    text = (story * (n // len(story) + 1))[:n]
    print("| observation | budget | tokenize then cut (s) | cut first (s) | ratio | same tokens |")
    print("|---|---|---|---|---|---|")
    for budget in a.budgets:
        t0 = time.perf_counter()
        whole = tok.encode(text, add_special_tokens=False)[:budget]
        t1 = time.perf_counter()
        cut = tok.encode(cut_observation(tok, text, budget), add_special_tokens=False)[:budget]
        t2 = time.perf_counter()
        print(f"| {a.mb:g} MB | {budget} | {t1 - t0:.2f} | {t2 - t1:.3f} | {(t1 - t0) / (t2 - t1):.0f}x | "
              f"{whole == cut} |")


if __name__ == "__main__":
    main()
