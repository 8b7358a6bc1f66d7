"""Where a migrating generation spends its time, phase by phase, against the plain generation of the same rows
(issue 31; docs/streaming.md, "Faster fused runs"): two gloo processes, the ``long`` setting's generation (the
``tiny`` actor at dp 2, 64 rows of 32-token prompts per replica, lengths lognormal median 4 and p99 128), no master.

Each round runs, on both replicas, the plain ``model.generate`` of the replica's rows, then the runtime's own
``worker_tail.migrating_generation`` with a tail entry (R_t rows to replica 0), once per ``--kv`` way of getting the
tail's KV caches there (``TailMigration.kv``: "prefill" re-runs it, "move" moves the caches; both: interleaved, the
order alternating by round), and prints medians over the rounds after the first: wall and CPU seconds
(``time.thread_time``) of each, and the migration's phases (phase 1 and 2 also in CPU seconds) from its clock (phase 1 with the asynchronous counts,
the rows packed, the all-gather, the caches' transfer, phase 2's decoding -- after the re-run prefill, or from the
moved caches -- on the tail replica, the interface run on the freed replica before it replies). Wall times need a
quiet machine; the CPU column reads the same under load.

    .venv/bin/python benchmarks/bench_tail_phases.py [--rows 13 --rounds 6 --kv both]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the gloo process pool of the tests (mp_pool.py)
ROWS, PROMPT, MAX_NEW = 128, 32, 128


def _rounds(ctx, tail_rows: int, rounds: int, kvs: tuple[str, ...]) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    import realloc.runtime.control.worker_tail as wt
    from model_helpers import build_model
    from realloc.algorithms.context import CallContext
    from realloc.graph.tail import TailMigration
    from realloc.lengths import ResponseLengths
    from realloc.models.config import get_model_config
    from realloc.models.sampling import GenerationConfig

    torch.set_num_threads(1)
    model = build_model(ctx, get_model_config("tiny"), 2, 1, 1, seed=3)
    k = model.groups.dp_rank
    rng = random.Random(PROMPT)
    prompts = torch.tensor([[rng.randrange(64) for _ in range(PROMPT)] for _ in range(ROWS)])
    ids = list(range(k * ROWS // 2, (k + 1) * ROWS // 2))
    clocks: list[tuple[dict, dict]] = []
    wt._Clock.report = lambda self, call, dp_rank, **extra: clocks.append(
        ({**self.parts, **{f"{k} cpu": v for k, v in self.cpu.items()}}, extra))
    out = []
    for r in range(rounds):
        gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=100 + r, eos_token_ids=(1,), temperature=1.0,
                                   length_schedule=ResponseLengths.lognormal(median=4, p99=MAX_NEW))
        row: dict[str, float] = {}
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        model.generate([prompts[i] for i in ids], gconfig, seq_ids=ids)
        row["plain"], row["plain cpu"] = time.perf_counter() - t0, time.thread_time() - c0

        def fn(c, inputs, g=gconfig):
            return c.model.generate(list(inputs["x"]["p"]), g, seq_ids=list(c.ids))

        cctx = CallContext(call=None, model=model, optimizer=None, config=None, prompt_len=PROMPT, gen_len=MAX_NEW,
                           seed=1, iteration=r, ids=ids, batch_size=ROWS, n_mbs=1)
        for kv in (kvs if r % 2 == 0 else kvs[::-1]):  # interleaved, alternating order
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            wt.migrating_generation(cctx, fn, {"x": {"p": prompts[ids]}},
                                    TailMigration(rows=tail_rows, instances=1, kv=kv), "actor_gen")
            row[f"{kv}/migrating"], row[f"{kv}/migrating cpu"] = time.perf_counter() - t0, time.thread_time() - c0
            parts, extra = clocks[-1]
            row.update({f"{kv}/{name}": v for name, v in parts.items()})
            row[f"{kv}/reductions"] = float(str(extra["counts"]).split()[0])
        out.append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=13, help="R_t: rows left at the migration point")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--kv", choices=("both", "move", "prefill"), default="both",
                   help="how the tail's KV caches reach the tail replica (TailMigration.kv)")
    args = p.parse_args()
    kvs = ("prefill", "move") if args.kv == "both" else (args.kv,)
    from mp_pool import GlooPool

    with tempfile.TemporaryDirectory() as tmp, GlooPool(2, Path(tmp)) as pool:
        got = pool.run(_rounds, args.rows, args.rounds, kvs, timeout=1800)
    keys = ("plain", "plain cpu", "migrating", "migrating cpu", "phase 1", "phase 1 cpu", "rows packed",
            "all-gather", "caches moved", "phase 2", "phase 2 cpu", "replay", "reductions")
    print(f"tail phases, long setting (tiny actor, dp 2, {ROWS // 2} rows of {PROMPT} prompt tokens per replica), "
          f"R_t = {args.rows} to replica 0; medians over rounds 2..{args.rounds}; milliseconds (reductions: count)")
    print(f"{'replica':<22}" + "".join(f"{k:>14}" for k in keys))
    for kv in kvs:
        for k, rows in enumerate(got):
            med = {key: statistics.median(r[name] for r in rows[1:] if name in r) for key in keys
                   for name in (key if key.startswith("plain") else f"{kv}/{key}",) if name in rows[-1]}
            role = ("0 (tail)" if k == 0 else f"{k} (freed)") + f" {kv}"
            print(f"{role:<22}" + "".join(f"{med[key] * (1 if key == 'reductions' else 1e3):>14.1f}" if key in med
                                          else f"{'-':>14}" for key in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
