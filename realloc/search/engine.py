"""Python driver of the C++ MCMC search (csrc/mcmc.h) over a PlanSpace.

The C++ chains run in chunks of a fixed number of proposals with the GIL released.
Between chunks this driver prices the transfer-cost pairs that the chains' promising
provisional plans need (``PlanSpace.price_missing``), lets the engine re-evaluate
them, and reports progress. With ``max_evals`` and no time limit the result depends
only on the seed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from realloc import _C
from realloc.search.build import PlanSpace

# Proposals per replica between two pricing rounds: the first rounds are short, so that the
# transfer costs of the first promising plans are priced early; then up to ~0.1 s at 200k
# evaluations/s per thread.
FIRST_CHUNK = 256
CHUNK = 8_000
# Pending plans per chain whose missing pairs are priced each round. Overlapped with the search,
# small batches come back quickly (a reallocation pair costs the estimator 10-100 ms on 128
# devices); synchronous rounds cost no wall time, so they take more.
PENDING_PER_CHAIN = 1
PENDING_PER_CHAIN_SYNC = 4
# realhf.txt §5.2 uses a fixed sampling temperature; ours accepts a plan 1% slower than the
# best known with this probability.
ACCEPT_1PCT = 0.2
# Parallel tempering: replicas per chain, at temperatures T * LADDER**k.
N_TEMPS = 3
MAX_THREADS = 1024  # more only slices the same cores finer: 100,000 spent the whole search starting threads
LADDER = 4.0


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


@dataclasses.dataclass(frozen=True)
class SearchStats:
    evals: int  # plans the chains decided on
    seconds: float
    time_to_best: float
    evals_to_best: int
    priced_pairs: int
    pricing_seconds: float
    history: tuple[tuple[float, int, float, float, bool], ...]  # (seconds, evals, cost, time, feasible)
    # evaluations simulated to the end; the rest stopped once proven rejected (csrc/mcmc.h early_reject),
    # `unsimulated` of them before any simulation (csrc/simulator.h, the path bound)
    simulations: int = 0
    unsimulated: int = 0

    @property
    def evals_per_second(self) -> float:
        return self.evals / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class SearchOutcome:
    indices: np.ndarray
    evaluation: dict
    start: np.ndarray
    start_evaluation: dict
    stats: SearchStats


Progress = Callable[[float, int, dict], None]  # (seconds, evals, best evaluation)
# A search converged once its best plan stood this many evaluations, and twice as many as it took to find:
# small problems (the demo's, best after 5k evaluations) stop in half a second instead of at the time limit;
# large ones, which still improve after a million, run to it (docs/speed.md).
CONVERGED_EVALS = 200_000


def converged(evals: int, evals_to_best: int) -> bool:
    """Whether a search that has made ``evals`` evaluations, the last improvement at ``evals_to_best``, is done."""
    return evals - evals_to_best >= max(CONVERGED_EVALS, 2 * evals_to_best)


def run_mcmc(space: PlanSpace, *, time_limit: float | None = 10.0, max_evals: int | None = None, seed: int = 0,
             n_chains: int = 2, n_threads: int = 2, n_temps: int = N_TEMPS, ladder: float = LADDER,
             starts: Sequence[np.ndarray] = (), accept_1pct: float = ACCEPT_1PCT,
             progress: Progress | None = None, converge: bool = False,
             **engine_options: float) -> SearchOutcome:
    """Search ``space`` until the time limit or the evaluation budget; with ``converge``, also once the best
    plan has stood for ``converged``'s count of evaluations (when the user gave no time, ``realloc run``).

    Chain i starts from ``starts[i % len(starts)]``; the greedy plan (realhf.txt §5.2:
    each call at its fastest standalone candidate) is always the first start.
    ``engine_options`` set other fields of ``realloc._C.SearchOptions`` (e.g. p_heat).
    """
    if time_limit is None and max_evals is None:
        raise ValueError("give the search a time limit or an evaluation budget (max_evals)")
    if time_limit is not None and not 0 < time_limit < math.inf:  # nan never ran out: the search never stopped
        raise ValueError(f"time limit must be a positive, finite number of seconds, got {time_limit}")
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}")
    if not 1 <= n_threads <= MAX_THREADS:
        raise ValueError(f"n_threads must be from 1 to {MAX_THREADS} (one MCMC chain each), got {n_threads}")
    t0 = time.perf_counter()
    start = space.fastest()
    all_starts = np.stack([start, *[np.asarray(s, np.int32) for s in starts]])
    start_ev = space.evaluate(start)
    for s in all_starts[1:]:
        space.evaluate(s)  # prices every start plan's pairs
    opts = _C.SearchOptions()
    opts.n_chains, opts.n_threads, opts.n_temps, opts.seed = n_chains, n_threads, n_temps, seed
    opts.accept_1pct, opts.ladder = accept_1pct, ladder
    for key, value in engine_options.items():
        if not hasattr(opts, key):
            raise ValueError(f"unknown search option {key!r}")
        setattr(opts, key, value)
    search = _C.Search(space.cpp, opts, all_starts)
    priced = 0
    pricing = 0.0
    budget_per_chain = None if max_evals is None else max(1, max_evals // (n_chains * n_temps))
    done_per_chain = 0
    chunk_size = FIRST_CHUNK
    # With a time limit, the estimator prices pairs in a thread while the chains run (the engine
    # releases the GIL); prices are applied between runs. With only a budget, pricing is
    # synchronous, so that the result depends on the seed alone.
    overlap = time_limit is not None
    pool = ThreadPoolExecutor(1) if overlap else None
    pending: Future | None = None

    def price_round(submit: bool = True) -> None:
        nonlocal pending, priced, pricing
        tp = time.perf_counter()
        if pending is not None:
            prices, seconds = pending.result()
            pending = None
            pricing += seconds
            new = space.apply_prices(prices)
            priced += new
            if new:
                search.resolve()
        missing = search.missing_pairs(PENDING_PER_CHAIN if overlap else PENDING_PER_CHAIN_SYNC) if submit else ()
        if len(missing):
            if overlap:
                pending = pool.submit(_timed, space.compute_prices, missing)
            else:
                new = space.apply_prices(space.compute_prices(missing))
                priced += new
                if new:
                    search.resolve()
        if not overlap:
            pricing += time.perf_counter() - tp

    try:
        while True:
            chunk = chunk_size
            chunk_size = min(CHUNK, 2 * chunk_size)
            if budget_per_chain is not None:
                chunk = min(chunk, budget_per_chain - done_per_chain)
                if chunk <= 0:
                    break
            left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                break
            stopped = search.run(chunk, left if left is not None else 0.0)
            done_per_chain += chunk
            # While the estimator still works on the last batch, the chains just keep going.
            if pending is None or pending.done() or stopped:
                price_round(submit=not stopped)
            if progress is not None:
                progress(time.perf_counter() - t0, search.evals, search.best)
            if stopped or (converge and pending is None and converged(search.evals, search.history[-1][1])):
                break
        if pending is not None:  # a batch started in time still counts
            price_round(submit=False)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    best = np.asarray(search.best_plan, np.int32)
    history = tuple(tuple(h) for h in search.history)
    last = history[-1]
    stats = SearchStats(evals=search.evals, seconds=time.perf_counter() - t0, time_to_best=last[0],
                        evals_to_best=last[1], priced_pairs=priced, pricing_seconds=pricing, history=history,
                        simulations=search.simulations, unsimulated=search.unsimulated)
    return SearchOutcome(indices=best, evaluation=space.evaluate(best), start=start, start_evaluation=start_ev,
                         stats=stats)
