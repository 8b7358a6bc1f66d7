"""Multi-turn rollouts streamed as they finish (issue 34 item 3) against the same placement unstreamed, on the
2-device local CPU cluster, measured and estimated.

GRPO on multi-turn rollouts: 8 prompts x 4 rollouts of the tiny actor, each turn of at most 8 tokens answered by
the calculator tool in the sandbox (a real tool process per step); a turn of even length ends the
rollout (this file's ``make_env``), else the rollout goes on, to 4 turns: rollouts take 1 to 4 turns.
The reference is the ``small`` model, so its inference is a real share of generation + inference. Plans: the
generation on device 0, the reference's inference on device 1, training over both, either

- ``plain``: the reference runs once the last rollout has ended, or
- ``streamed``: the generation hands the finished rollouts to the reference in 2 chunks, the last once at most
  20% of the rollouts are still running (``tail: {"actor_gen": {"rows": 6, "instances": 0, "chunks": 2}}``).

The two run in turn (A, B, A, B, ...: ``--repeats`` rounds), and each one's load average is printed beside it.
Measured per run: the median over iterations 2.. of generation + inference (from the generation's start to the
reference's end, ``bench_chunked.breakdown``) and of the iteration. Estimated: both plans priced by the simulator on
the turn profile of the first plain run (``realloc search --lengths-from``: its turns, tool seconds and the tool
processes of its plan), from the same schedule.

    .venv/bin/python benchmarks/bench_multiturn_stream.py [--iterations 4 --repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
MAX_TURNS = 4
EXPERIMENT = f'''
import dataclasses

from realloc.algorithms.critic_free.grpo import GRPOConfig
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto

ENV = {{"env": "bench_multiturn_stream:make_env", "env_args": {{}}, "max_turns": {MAX_TURNS}, "turn_tokens": 8}}


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=64)
@dataclasses.dataclass
class StreamedTurns:
    seed: int = 1
    dataset: str = "{REPO}/experiments/data/calc_train.jsonl"
    tokenizer: str = "{REPO}/experiments/data/calc_tokenizer"
    sample_every: int = 1
    log_samples: int = 32  # every rollout: the profile of the plain run
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=1e-3, kl_coef=0.01)

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", ref="small", n_samples=4)
'''


class ThirdsEnv:
    """Each turn's length through the calculator tool; an even length (or the last turn) ends the rollout."""

    def __init__(self) -> None:
        from realloc.tools.sandbox import Sandbox, ToolLimits

        self.sandbox, self.t = Sandbox(ToolLimits(wall_s=20.0)), 0
        self.tool_counts: dict[str, int] = {}

    def reset(self, record: dict) -> str:
        self.t = 0
        return "="

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.t += 1
        if len(text) % 2 == 0 or self.t >= MAX_TURNS:
            return None, float(len(text) % 3 == 0), True
        result = self.sandbox.run("realloc.tools.builtin:calculator", f"{len(text)}*7")
        self.tool_counts[result.status] = self.tool_counts.get(result.status, 0) + 1
        return f"<{result.text.strip()}>", 0.0, False


def make_env() -> ThirdsEnv:
    return ThirdsEnv()


def _plans(graph):
    from realloc.graph.plan import ExecutionPlan

    apart = {c: ("localhost", 2, 1, 1, 1) if graph.call(c).is_train else ("localhost:0", 1, 1, 1, 1)
             if c == "actor_gen" else ("localhost:1", 1, 1, 1, 1) for c in graph.spec.call_names}
    return {"plain": ExecutionPlan.by_hand(graph, apart, source="hand"),
            "streamed": ExecutionPlan.by_hand(graph, apart, source="hand", tail={"actor_gen": (6, 0, 2)})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="rounds of A/B")
    p.add_argument("--keep", default=None, help="keep the runs' directories under this folder")
    args = p.parse_args()
    from bench_chunked import _estimated, _measured
    from bench_fusion import run_plan

    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.search.turns_report import profile_lines, turns_from

    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        exp = tmp / "multiturn_streamed.py"
        exp.write_text(EXPERIMENT)
        spec = load_experiment(str(exp))
        plans = _plans(build_graph(spec))
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
        runs: dict[str, list[tuple[float, float, float, dict]]] = {n: [] for n in plans}
        first = None
        for rep in range(args.repeats):
            for name, plan in plans.items():
                load = os.getloadavg()[0]
                run_dir = tmp / f"{name}_{rep}"
                run_plan(exp, plan, run_dir, args.iterations, env)
                gi, it, parts = _measured(run_dir)
                runs[name].append((gi, it, load, parts))
                first = first or run_dir
        profiled = build_graph(turns_from(spec, first))  # the first plain run's turns, tool time and processes
        est = {n: _estimated(profiled, plan) for n, plan in plans.items()}

    print(f"GRPO multi-turn, 32 rollouts of 1-{MAX_TURNS} turns (calculator tool per turn), actor tiny, reference "
          f"small; generation on device 0, reference on device 1; {args.iterations} iterations, medians over "
          f"2..{args.iterations}; {args.repeats} rounds A/B")
    print(*profile_lines(profiled), sep="\n")
    print(f"{'plan':<10}{'round':>6}{'load':>6}{'gen+inf s':>11}{'iter s':>8}   gen | inf in gen | inf after")
    for rep in range(args.repeats):
        for name in plans:
            gi, it, load, parts = runs[name][rep]
            split = " | ".join(f"{parts[k]:.3f}" for k in ("gen", "inf in gen", "inf after"))
            print(f"{name:<10}{rep + 1:>6}{load:>6.1f}{gi:>11.3f}{it:>8.3f}   {split}")
    print(f"{'plan':<10}{'gen+inf (median)':>17}{'est':>7}{'e/m':>6}{'iter (median)':>15}{'est':>7}{'e/m':>6}")
    med = {}
    for name in plans:
        gi = statistics.median(r[0] for r in runs[name])
        it = statistics.median(r[1] for r in runs[name])
        e_it, e_gi, e_parts = est[name]
        med[name] = (gi, it, e_gi, e_it)
        split = " | ".join(f"{e_parts[k]:.3f}" for k in ("gen", "inf in gen", "inf after"))
        print(f"{name:<10}{gi:>17.3f}{e_gi:>7.3f}{e_gi / gi:>6.2f}{it:>15.3f}{e_it:>7.3f}{e_it / it:>6.2f}   "
              f"est. {split}")
    pairs = [runs["plain"][r][0] / runs["streamed"][r][0] for r in range(args.repeats)]
    print(f"streamed vs plain, generation + inference: {med['plain'][0] / med['streamed'][0]:.2f}x measured "
          f"(per round {', '.join(f'{x:.2f}' for x in pairs)}), {med['plain'][2] / med['streamed'][2]:.2f}x estimated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
