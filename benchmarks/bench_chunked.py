"""Fusion as the search chooses it (issue 31: chunked streaming, streaming, migration) against the best unfused
plan, measured on the 2-device local CPU cluster, in RLHFuse's workload shape (rlhfuse.txt §7: critic and reward
model larger than the actor, so inference is a real share of the iteration).

PPO with lengths from the seeded EOS schedule (lognormal, p99 16x the median): actor and reference of model
``tiny``, critic and reward model of model ``small`` (``--setting rlhfuse``, the default; ~30x the actor's
parameters, where RLHFuse pairs a 13B actor with a 33B or 65B critic) or all four ``small`` (``--setting rm``,
bench_fusion.py's), or a ``tiny`` actor with a ``mid`` critic and reward model (``--setting fit``, what
``bench_fusion.py --setting fit`` runs without the chunked disaggregated plans), or all four ``tiny`` on 128 rows of
32-token prompts with lengths lognormal median 4 (``--setting long``, ``bench_fusion.py --setting long``). Plans,
each one ``realloc run``, in turn every round (``--repeats``, each plan's best round):

- unfused: ``colocated dp 2`` (every call over both devices), ``disaggregated`` (generation on device 0, the
  inference calls on device 1, training over both) and ``searched, no tail`` (the search's best plan without a
  tail entry, ``plan_search``'s ``no_tail``);
- fused: ``searched`` (the search's winner with its tail entry: chunked streaming, streaming or migration, as it
  chooses), and the R_t sweep on its placement: every R_t of the grid with its chunk count (or migration's m;
  when the search keeps no tail, ``R=k, streamed``: its placement streaming in 1 chunk, and the sweep counts no
  tail as the grid step below the smallest R_t);
  ``disaggregated, k chunk(s)``: the disaggregated placement streaming in k chunks (R = 5%); ``colocated, migrate
  R=k``: RLHFuse's fusion of the colocated plan (the generation over both devices moves its last k rows to device
  0, the inference calls run on device 1, training over both; R = 5%).

Measured per iteration (medians over the iterations after the first): generation + inference (from the generation's
start on its devices to the end of the last inference call: RLHFuse's "Gen.+Inf.", not counting the wait of a
generation dispatched before the last iteration's training ends), the iteration, and a breakdown from ``requests.jsonl``
(generation; inference work before the generation ended; inference after it; training; everything else: transfers,
reallocations, request overheads, idle). Estimated beside each: the simulator's iteration and generation + inference
span (``search/timeline.estimate_plan``) and the same breakdown from its schedule.

``--profiles DIR`` is ``$REALLOC_PROFILES`` for the estimates and the runs (a profile taken at the same load, e.g.
``realloc profile --model tiny ...`` into DIR, so that estimates do not drift with the machine's load).

    .venv/bin/python benchmarks/bench_chunked.py [--setting rlhfuse|rm --rows 32 --gen-len 128 --iterations 4
                                                  --repeats 1 --search-time 20 --profiles DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
GEN, INFERENCE, TRAIN = "actor_gen", ("rew_inf", "ref_inf", "critic_inf"), ("actor_train", "critic_train")
SETTINGS = {"rlhfuse": ("tiny", "small"), "rm": ("small", "small"),  # actor and reference, critic and reward model
            "fit": ("tiny", "mid"),  # bench_fusion.py --setting fit: inference on one device ~ the generation's tail
            "long": ("tiny", "tiny")}  # bench_fusion.py --setting long: 128 rows, inference on one device ~ generation

def _plans(graph, report, chunked: bool = True) -> dict:
    from realloc.estimator.chunk_cost import CHUNK_GRID
    from realloc.estimator.tail_cost import TAIL_GRID, tail_rows
    from realloc.graph.plan import ExecutionPlan

    both, dev0, dev1 = ("localhost", 2, 1, 1, 1), ("localhost:0", 1, 1, 1, 1), ("localhost:1", 1, 1, 1, 1)
    apart = {c: dev0 if c == GEN else dev1 if c in INFERENCE else both for c in graph.spec.call_names}
    plans = {"colocated dp 2": ExecutionPlan.by_hand(graph, {c: both for c in graph.spec.call_names}, source="hand"),
             "disaggregated": ExecutionPlan.by_hand(graph, apart, source="hand")}
    if report.no_tail is not None:
        plans["searched, no tail"] = report.no_tail
    won = report.plan
    plans["searched"] = won
    r = tail_rows(graph.spec.n_seqs(graph.call(GEN)), TAIL_GRID[0])
    for k in (1, *CHUNK_GRID) if chunked else ():  # FlexRLHF's disaggregated placement streamed in k chunks
        plans[f"disaggregated, {k} chunk(s)"] = ExecutionPlan.by_hand(graph, apart, source="hand", tail={GEN: (r, 0, k)})
    # RLHFuse's fusion (rlhfuse.txt §4) on the colocated plan: the generation over both devices moves its last R rows
    # to device 0, and device 1, freed, runs the inference calls on the finished rows; training over both
    freed = {c: dev1 if c in INFERENCE else both for c in graph.spec.call_names}
    plans[f"colocated, migrate R={r}"] = ExecutionPlan.by_hand(graph, freed, source="hand", tail={GEN: (r, 1)})
    for share in TAIL_GRID[1:3] if not chunked else ():  # fit/long: RLHFuse's R_t over 10 and 20% too (its Fig. 9)
        k = tail_rows(graph.spec.n_seqs(graph.call(GEN)), share)
        plans[f"colocated, migrate R={k}"] = ExecutionPlan.by_hand(graph, freed, source="hand", tail={GEN: (k, 1)})
    tail = won.tail.get(GEN)
    n = graph.spec.n_seqs(graph.call(GEN))
    if tail is None:  # the search keeps no tail: its placement streamed at every grid R_t (is "off" right?)
        return {**plans, **_streamed(graph, won, [tail_rows(n, share) for share in TAIL_GRID])}
    for share in TAIL_GRID:
        r = tail_rows(n, share)
        if r != tail.rows:
            plans[f"R={r}, {tail.chunks} chunk(s)"] = won.model_copy(update={"tail": {GEN: tail.model_copy(
                update={"rows": r})}})
    return plans


def _streamed(graph, won, grid: list[int]) -> dict:
    """``won``'s placement with a stream-only tail entry (1 chunk) at each R_t of ``grid``, where the plan is valid
    (a consumer on a device the generation leaves free)."""
    from realloc.graph.plan import validate_plan
    from realloc.graph.tail import TailMigration

    out = {}
    for r in grid:
        plan = won.model_copy(update={"tail": {GEN: TailMigration(rows=r, instances=0)}})
        try:
            validate_plan(plan, graph)
        except ValueError:
            continue
        out[f"R={r}, streamed"] = plan
    return out


def with_kv(plans: dict, kv: str) -> dict:
    """``plans`` with every migration's ``kv`` set; "both": a migrating plan moves its caches and its twin, named
    'prefill: <name>' (outside the sweeps' names), re-runs the prefill. The estimate prices a twin as the search's
    row of its R_t and m (search/timeline._tail_row)."""
    if kv == "auto":
        return plans
    out = {}
    for name, plan in plans.items():
        tail = plan.tail.get(GEN)
        if tail is None or not tail.instances:
            out[name] = plan
            continue
        for how in (("move", "prefill") if kv == "both" else (kv,)):
            twin = plan.model_copy(update={"tail": {**plan.tail, GEN: tail.model_copy(update={"kv": how})}})
            out[name if how == "move" or kv != "both" else f"prefill: {name}"] = twin
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by ``spans`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(recs: list[dict]) -> dict[str, float]:
    """One iteration's parts from request records (``requests.jsonl`` rows, or the simulator's as the same dicts):
    the generation's span on its devices, inference wall time before and after its end, training, and the rest of
    the span from the first dispatch to the last call's end that no call covers (waits, transfers, reallocations,
    request overheads)."""
    calls = [r for r in recs if r["kind"] == "call"]
    gen = [r for r in calls if r["label"] == GEN]
    g_end = max(r["end"] for r in gen)
    # from the iteration's first work on a device, not the generation's dispatch: a generation dispatched while the
    # last iteration's training still runs on its devices waits there, and that wait is the last iteration's train
    start = min(a for r in recs for a, _ in r["spans"])
    inf = [(a, b) for r in calls if r["label"] in INFERENCE for a, b in r["spans"]]
    # a fused actor/critic train step is one request labelled "actor_train+critic_train"
    train = [(a, b) for r in calls if set(r["label"].split("+")) <= set(TRAIN) for a, b in r["spans"]]
    end = max(r["end"] for r in recs)
    before = _union([(a, min(b, g_end)) for a, b in inf if a < g_end])
    after = _union([(max(a, g_end), b) for a, b in inf if b > g_end])
    inf_end = max(b for _, b in inf)
    g_start = min(a for r in gen for a, _ in r["spans"])  # its devices start (it may wait for the last train)
    return {"gen": g_end - g_start, "inf in gen": before, "inf after": after, "gen+inf": inf_end - g_start,
            "train": _union(train), "other": end - start - _union([(a, b) for r in calls for a, b in r["spans"]]),
            "requests": float(len(recs))}


def _measured(run_dir: Path) -> tuple[float, float, dict[str, float]]:
    """Medians over iterations 2..: generation + inference, the iteration, and the breakdown's parts."""
    rows = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines() if x.strip()]
    its = sorted({r["iteration"] for r in rows if r.get("kind") == "call"})[1:]
    parts = []
    for it in its:
        recs = [dict(kind=r["kind"], label=r["label"], start=r["dispatched"], end=r["completed"],
                     spans=list(r["spans"].values())) for r in rows
                if r["iteration"] == it and r["kind"] not in ("setup", "release", "shutdown")]  # (a release of the
        # iteration's data runs on the workers after the next iteration's first call)
        parts.append(breakdown(recs))
    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return (med["gen+inf"], statistics.median(m["iteration_time"] for m in metrics[1:]),
            {**med, **overheads(run_dir)})


def overheads(run_dir: Path) -> dict[str, float]:
    """The runtime's own costs from ``requests.jsonl``, iterations 2..: requests per iteration; the generation's
    split points per iteration and the seconds its devices stand between two of its requests (the reply, the
    master's handling and the next request: the split-point protocol); medians of the seconds from a request's
    dispatch to its start on a worker that was idle, and from its end on a worker to the master's receipt."""
    rows = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["iteration"] >= 2 and r["kind"] not in ("setup", "shutdown")]
    its = {r["iteration"] for r in rows}
    gaps: list[float] = []
    for it in its:
        gen = sorted((r for r in rows if r["iteration"] == it and r["label"] == GEN), key=lambda r: r["dispatched"])
        gaps += [b["spans"][d][0] - a["spans"][d][1] for a, b in zip(gen, gen[1:]) for d in b["spans"]
                 if d in a["spans"]]
    busy: dict[str, list[tuple[float, float, float]]] = {}  # worker -> (start, end, dispatched) of its requests
    for r in rows:
        for d, (a, b) in r["spans"].items():
            busy.setdefault(d, []).append((a, b, r["dispatched"]))
    idle = [a1 - t1 for v in busy.values() for (_, b0, _), (a1, _, t1) in zip(sorted(v), sorted(v)[1:]) if t1 > b0]
    back = [r["received"][d] - b for r in rows for d, (_, b) in r["spans"].items() if d in r.get("received", {})]
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    n_gen_devices = max(1, max((len(r["spans"]) for r in rows if r["label"] == GEN), default=1))
    return {"requests": len(rows) / len(its), "splits": len(gaps) / len(its) / n_gen_devices,
            "split gap": med(gaps), "dispatch": med(idle), "reply": med(back)}


def _estimated(graph, plan) -> tuple[float, float, dict[str, float]]:
    """The simulator's iteration, generation + inference and breakdown of a middle iteration."""
    from realloc.estimator.cost import CostModel
    from realloc.search.tail_report import gen_inf_span
    from realloc.search.timeline import estimate_plan

    space, idx = estimate_plan(graph, plan, CostModel(graph))
    names = space.problem.call_names
    sched = space.cpp.schedule(idx)
    mid = space.problem.n_iterations // 2
    # kinds: 0 call, 1 data, 2 reallocation, 3 a tail's second part, 5 a consumer's part 1 (search/tail_reference.py)
    label = {0: "call", 3: "call", 5: "call"}
    recs = [dict(kind=label.get(r[0], "other"), label=names[r[1]], start=r[4], end=r[5], spans=[(r[4], r[5])])
            for r in sched if r[3] == mid and r[5] > r[4]]
    return (float(space.to_plan(idx, "e").estimated_time or 0.0), gen_inf_span(space, idx), breakdown(recs))


def _run(exp: Path, plan, run_dir: Path, iterations: int, env: dict) -> tuple[float, float, dict[str, float]]:
    from bench_fusion import run_plan

    run_plan(exp, plan, run_dir, iterations, env)
    return _measured(run_dir)


def chunked_args(doc: str | None, default: str = "rlhfuse") -> argparse.ArgumentParser:
    """The options of this benchmark (also bench_fusion.py's for ``--setting fit``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(SETTINGS), default=default)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--median", type=int, default=None, help="the lengths' median (default gen-len / 16; p99 gen-len)")
    p.add_argument("--prompt", type=int, default=8, help="prompt tokens per row (8: the shipped prompts)")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="rounds over the plans; each plan's best round counts")
    p.add_argument("--search-time", type=float, default=20.0)
    p.add_argument("--profiles", default=None, help="profiles folder ($REALLOC_PROFILES) for estimates and runs")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this folder")
    p.add_argument("--estimate-only", action="store_true", help="print the estimates without running")
    p.add_argument("--kv", choices=("auto", "move", "prefill", "both"), default="auto",
                   help="how every migrating plan's tail gets its KV caches (TailMigration.kv); both: each such plan "
                        "twice, the re-run prefill's twin named 'prefill: ...', run in turn with it")
    if default == "long":  # bench_fusion.py --setting long: docs/streaming.md, "A longer batch"
        p.set_defaults(rows=128, prompt=32, median=4)
    return p


def main() -> int:
    return compare(chunked_args(__doc__).parse_args())


def compare(args: argparse.Namespace, chunked: bool = True, balance_tokens: bool = False) -> int:
    """Search, run every plan in turn ``args.repeats`` rounds, print the table. ``chunked``: also the disaggregated
    placement in 1, 2 and 4 chunks; ``balance_tokens``: the experiment deals rows to dp ranks by tokens."""
    if args.profiles:
        os.environ["REALLOC_PROFILES"] = str(Path(args.profiles).resolve())
    from bench_fusion import write_experiment

    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.search.planner import RunLimits, plan_search

    actor, critic = SETTINGS[args.setting]
    median = args.median or max(1, args.gen_len // 16)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        exp = tmp / f"chunked_ppo_{args.setting}.py"
        write_experiment(exp, "rm", args.rows, args.gen_len, actor, critic + "-critic",  # a learned reward model
                         balance_tokens=balance_tokens, median=median, prompt=args.prompt)
        graph = build_graph(load_experiment(str(exp)))
        report = plan_search(str(exp), time_limit=args.search_time, n_threads=1, seed=0, runnable=RunLimits())
        plans = with_kv(_plans(graph, report, chunked), getattr(args, "kv", "auto"))
        est = {n: _estimated(graph, plan) for n, plan in plans.items()}
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
        measured: dict[str, list] = {n: [] for n in plans}
        loads = []
        for rep in range(0 if args.estimate_only else args.repeats):
            for name, plan in plans.items():
                loads.append(os.getloadavg()[0])
                run_dir = tmp / f"{args.setting}_{''.join(ch if ch.isalnum() else '_' for ch in name)}_{rep}"
                measured[name].append(_run(exp, plan, run_dir, args.iterations, env))
    print(f"setting {args.setting}: PPO, actor and reference {actor}, critic and reward model {critic}; 2 CPU devices; "
          f"{args.rows} rows of {args.prompt} prompt tokens, lengths lognormal median {median}, p99 {args.gen_len}; "
          f"{args.iterations} iterations, medians over 2..{args.iterations}, the best of {args.repeats} rounds; "
          f"load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; profiles "
          f"{os.environ.get('REALLOC_PROFILES', 'shipped')}")
    won = report.plan.tail.get(GEN)
    print(f"searched ({args.search_time:.0f} s): {won if won else 'no tail entry'}")
    print(f"{'plan':<26}{'gen+inf':>8}{'est':>7}{'e/m':>6}{'iter':>7}{'est':>7}{'e/m':>6}   measured (estimated): "
          f"gen | inf in gen | inf after | train | other")
    rows = {}
    for name in plans:
        gi, it, parts = min(measured[name], key=lambda m: m[1]) if measured[name] else (float("nan"),) * 2 + ({},)
        e_it, e_gi, e_parts = est[name]
        rows[name] = (gi, it, e_gi, e_it)
        split = " | ".join(f"{parts.get(k, float('nan')):.3f} ({e_parts[k]:.3f})"
                           for k in ("gen", "inf in gen", "inf after", "train", "other"))
        print(f"{name:<26}{gi:>8.3f}{e_gi:>7.3f}{e_gi / gi:>6.2f}{it:>7.3f}{e_it:>7.3f}{e_it / it:>6.2f}   {split}")
    print("runtime overheads per plan, medians over iterations 2.. (ms): requests per iteration | the generation's "
          "split points per iteration, its devices' gap at each | dispatch to start (idle worker) | end to master")
    for name in plans:
        m = min(measured[name], key=lambda m: m[1])[2] if measured[name] else {}
        if m:
            print(f"  {name:<26}{m['requests']:5.0f} | {m['splits']:3.0f} x {m['split gap'] * 1e3:5.1f} | "
                  f"{m['dispatch'] * 1e3:5.1f} | {m['reply'] * 1e3:5.1f}")
    unfused = [n for n in plans if n in ("colocated dp 2", "disaggregated", "searched, no tail")]
    fused = [n for n in plans if n not in unfused and plans[n].tail]  # ('searched' may keep no tail)
    col = 0 if not args.estimate_only else 2
    for what, k in (("generation + inference", col), ("iteration", col + 1)):
        base = min(unfused, key=lambda n: rows[n][k])
        best = min(fused, key=lambda n: rows[n][k])
        print(f"{what}: best unfused '{base}' {rows[base][k]:.3f} s; searched {'fused' if won else '(no tail)'} "
              f"{rows['searched'][k]:.3f} s "
              f"({rows[base][k] / rows['searched'][k]:.2f}x); best fused of the sweep '{best}' {rows[best][k]:.3f} s "
              f"({rows[base][k] / rows[best][k]:.2f}x)")

    def r_of(name: str) -> int:  # a plan's R_t; 0 for no tail ("off", the grid step below the smallest R_t)
        t = plans[name].tail.get(GEN)
        return t.rows if t is not None else 0

    sweep = sorted((r_of(n), n) for n in plans if n == "searched" or n.startswith("R="))
    if len(sweep) > 1:  # the searched R_t against the sweep's best, in grid steps (the issue's "within one")
        names = [n for _, n in sweep]
        for what, k in (("generation + inference", col), ("iteration", col + 1)):
            best = min(names, key=lambda n: rows[n][k])
            print(f"R_t sweep by {what}: best R = {r_of(best) or 'off'} ({rows[best][k]:.3f} s), searched R = "
                  f"{r_of('searched') or 'off'}: {abs(names.index(best) - names.index('searched'))} grid "
                  f"step(s) apart")
    moved = [n for _, n in sorted((plans[n].tail[GEN].rows, n) for n in fused if n.startswith("colocated, migrate"))]
    if len(moved) > 1:  # RLHFuse's fusion of the colocated plan: the estimate's best R_t against the measured one
        base = "colocated dp 2"
        for what, k in (("generation + inference", 0), ("iteration", 1)):
            e = min(moved, key=lambda n: rows[n][k + 2])
            line = (f"colocated migration by {what}: estimated best R = {plans[e].tail[GEN].rows} "
                    f"({rows[e][k + 2]:.3f} s, {rows[base][k + 2] / rows[e][k + 2]:.2f}x the colocated plan)")
            if not args.estimate_only:
                m = min(moved, key=lambda n: rows[n][k])
                steps = abs(moved.index(m) - moved.index(e))
                line += (f"; measured best R = {plans[m].tail[GEN].rows} ({rows[m][k]:.3f} s, "
                         f"{rows[base][k] / rows[m][k]:.2f}x), {steps} grid step(s) apart")
            print(line)
    if balance_tokens:
        print(token_balance(args.rows, args.gen_len, args.iterations, args.prompt, median))
    return 0


def token_balance(rows: int, gen_len: int, iterations: int, prompt: int = 8, median: int | None = None) -> str:
    """Max/min tokens per dp rank at dp 2 over the runs' scheduled lengths, dealt by rows, by contiguous token
    shares and by row lists (``balance_tokens``: graph/row_deal.py), beside 40 seeds of the same length mix
    (benchmarks/token_balance.py)."""
    from token_balance import token_balance as report

    return report(rows, gen_len, iterations, prompt, median=median or 0)


if __name__ == "__main__":
    sys.exit(main())
