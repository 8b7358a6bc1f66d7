"""How long PromptDataset.load takes for 100k prompts (text, chat, token ids), cold and from its cache.

    .venv/bin/python benchmarks/bench_prompt_loading.py [--n 100000]

Prompts come from the shipped generator (realloc/tiny_assets/text.py, the kinds and length mix of
experiments/data/*.jsonl) and are tokenized with the tiny tokenizer trained on the shipped corpus,
prompt_len 64. The tokenizer's vocabulary (500) is tiny, so a prompt has more tokens than with a
real one; the time is dominated by the Rust tokenizer and, for chat, by rendering the Jinja template.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realloc.data import PromptDataset, Tokenizer  # noqa: E402
from realloc.tiny_assets import text as tiny_text# noqa: E402
from realloc.tiny_assets.hf import train_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100_000)
    args = p.parse_args()
    torch.set_num_threads(1)  # as in a worker (runtime/control/worker.py); the batch timing is what a worker sees
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok = Tokenizer.load(train_tokenizer(REPO / "experiments/data/tiny_corpus.txt", d / "tok"))
        text = tiny_text.text_prompts(n=args.n)
        files = {"text": text, "chat": tiny_text.chat_prompts(n=args.n),
                 "token ids": [{"prompt": ids} for ids in tok.encode_batch([r["prompt"] for r in text])]}
        print(f"load: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
        print(f"{'records':>10} {'kind':>10} {'cold s':>8} {'cold cpu s':>10} {'prompts/s':>10} {'cached s':>9}  stats")
        for kind, records in files.items():
            path = d / f"{kind.replace(' ', '_')}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            times, cpu = [], time.process_time()  # process time counts the tokenizer's threads too
            for _ in range(2):  # the first load tokenizes and writes the cache, the second reads it
                t = time.perf_counter()
                ds = PromptDataset.load(path, 64, tokenizer=tok, vocab_size=512, cache_dir=d / "cache")
                times.append(time.perf_counter() - t)
                cpu = time.process_time() - cpu if len(times) == 1 else cpu
            print(f"{len(records):>10} {kind:>10} {times[0]:>8.2f} {cpu:>10.2f} {len(records) / times[0]:>10.0f} "
                  f"{times[1]:>9.3f}  {ds.stats.describe()}")
        t = time.perf_counter()
        for it in range(10):
            ds.batch(it, 1024, seed=1)
        print(f"batch of 1024 prompts: {(time.perf_counter() - t) / 10 * 1e3:.1f} ms")
        print(f"load: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
