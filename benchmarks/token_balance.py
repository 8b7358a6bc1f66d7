"""Max/min tokens per dp rank of a batch's scheduled lengths, by each dealing (issue 31, item 4): printed by
bench_fusion.py / bench_chunked.py after their runs with ``balance_tokens``, and runnable alone:

    python benchmarks/token_balance.py --rows 32 --gen-len 64 --iterations 4 --seeds 40

Dealings: contiguous equal rows (``balance_tokens`` off), contiguous shares by tokens (``row_balance``, the
master's dealing before row lists) and row lists by tokens (``row_deal.deal_rows``, what the master deals every
later call's dp ranks by now; for a train step per mini-batch, row i in mini-batch i mod n_minibatches).
The lengths are the runs' own: the EOS schedule's (lognormal, median gen_len / 16, p99 gen_len), seeded per
iteration as algorithms/common.py seeds it, for experiment seeds 1..``seeds``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realloc.graph.row_balance import token_balanced_ranges  # noqa: E402
from realloc.graph.row_deal import deal_rows, worst_ratio  # noqa: E402
from realloc.graph.transfer_plan import dp_ranges  # noqa: E402
from realloc.lengths import ResponseLengths  # noqa: E402
from realloc.models.length_schedule import scheduled_lengths  # noqa: E402
from realloc.models.weights import param_seed  # noqa: E402


def ratios(tokens: list[int], dp: int, n_minibatches: int) -> tuple[float, float, float, float]:
    """max/min by equal rows, contiguous by tokens, row lists by tokens (inference), row lists per mini-batch."""
    n = len(tokens)
    runs = lambda ranges: [range(lo, hi) for lo, hi in ranges]  # noqa: E731
    return (worst_ratio(tokens, runs(dp_ranges(n, dp))), worst_ratio(tokens, runs(token_balanced_ranges(tokens, dp))),
            worst_ratio(tokens, deal_rows(tokens, dp)),
            worst_ratio(tokens, deal_rows(tokens, dp, n_minibatches=n_minibatches), n_minibatches))


def token_balance(rows: int, gen_len: int, iterations: int, prompt: int = 8, seeds: int = 40, dp: int = 2,
                  n_minibatches: int = 2, median: int = 0, p99: int = 0) -> str:
    """The report: the run's own iterations (seed 1), then ``seeds`` experiment seeds of the same length mix
    (lognormal, ``median`` default gen_len / 16, ``p99`` default gen_len, at most gen_len)."""
    median, p99 = median or max(1, gen_len // 16), p99 or gen_len
    sched = ResponseLengths.lognormal(median=median, p99=p99)

    def batch(seed: int, it: int) -> list[int]:
        return [prompt + n for n in scheduled_lengths(sched, gen_len, param_seed(seed, f"generate/{it}"), range(rows))]

    def span(vals: list[float]) -> str:
        return f"{min(vals):.3f}-{max(vals):.3f}"

    run = [ratios(batch(1, it), dp, n_minibatches) for it in range(iterations)]
    many = [ratios(batch(s, it), dp, n_minibatches) for s in range(1, seeds + 1) for it in range(iterations)]
    cols = ("contiguous by rows", "contiguous by tokens", "row lists by tokens (inference)",
            f"row lists per mini-batch (train, {n_minibatches} mini-batches)")
    lines = [f"max/min tokens per dp rank at dp {dp}, {rows} rows (prompt {prompt} + lognormal median {median}, p99 "
             f"{p99}, at most {gen_len}); balance_tokens deals row lists (graph/row_deal.py):"]
    lines.append(f"  {'dealing':<50} {'iterations 1..' + str(iterations):>18} {f'{seeds} seeds x {iterations} it.':>20}")
    for k, name in enumerate(cols):
        lines.append(f"  {name:<50} {span([r[k] for r in run]):>18} {span([r[k] for r in many]):>20}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--n-minibatches", type=int, default=2)
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens per row")
    p.add_argument("--median", type=int, default=0, help="default: gen_len / 16")
    p.add_argument("--p99", type=int, default=0, help="default: gen_len")
    a = p.parse_args()
    print(token_balance(a.rows, a.gen_len, a.iterations, a.prompt, a.seeds, a.dp, a.n_minibatches, a.median, a.p99))
    return 0


if __name__ == "__main__":
    sys.exit(main())
