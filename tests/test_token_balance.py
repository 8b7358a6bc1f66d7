"""Token-balanced data parallelism (issue 31, item 4): the split, the transfer plans over it, and a run whose
later calls' dp ranks get equal tokens rather than equal rows, with the unbalanced run's results."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan
from realloc.graph.row_balance import rank_tokens, token_balanced_ranges
from realloc.graph.row_deal import deal_rows, worst_ratio
from realloc.graph.transfer_plan import DataLayout, dp_ranges, plan_data_transfer
from realloc.lengths import ResponseLengths, lengths_from_run
from realloc.models.length_schedule import scheduled_lengths
from realloc.cluster import ClusterSpec
from realloc.strategy import ParallelStrategy as S
from test_runtime_e2e import EXPERIMENT, REPO, env, metrics

LONG_TAIL = ResponseLengths.lognormal(median=64, p99=1024)


def _ratio(tokens, ranges):
    per = rank_tokens(tokens, ranges)
    return max(per) / min(per)


@pytest.mark.parametrize("seed", range(5))
def test_a_lognormal_mix_is_balanced_within_5_percent_where_equal_rows_are_not(seed):
    """512 responses, p99 16x the median: 1.05 holds down to 64 rows per rank (dp 8); equal rows miss it."""
    tokens = [32 + n for n in scheduled_lengths(LONG_TAIL, 2048, seed=seed, seq_ids=range(512))]
    for dp in (2, 4, 8):
        ranges = token_balanced_ranges(tokens, dp)
        assert ranges[0][0] == 0 and ranges[-1][1] == 512 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert _ratio(tokens, ranges) <= 1.05
        if dp > 2:
            assert _ratio(tokens, dp_ranges(512, dp)) > 1.05


def test_each_boundary_is_the_closest_to_its_share_by_brute_force():
    tokens = [5, 1, 1, 9, 2, 2, 8, 1, 3, 4]
    best = min(range(1, 10), key=lambda c: (abs(sum(tokens[:c]) - sum(tokens) / 2), c))
    assert token_balanced_ranges(tokens, 2) == ((0, best), (best, 10))
    # groups of 2 responses stay together; every rank keeps at least 4 rows
    grouped = token_balanced_ranges(tokens, 2, unit=2, min_rows=4)
    assert all(lo % 2 == 0 and hi - lo >= 4 for lo, hi in grouped)
    cuts = [c for c in range(4, 7, 2)]
    want = min(cuts, key=lambda c: (abs(sum(tokens[:c]) - sum(tokens) / 2), c))
    assert grouped == ((0, want), (want, 10))
    # equal lengths or too few rows: the even split
    assert token_balanced_ranges([7] * 10, 3) == dp_ranges(10, 3)
    assert token_balanced_ranges(tokens, 2, min_rows=6) == dp_ranges(10, 2)
    with pytest.raises(ValueError, match="whole units of 3"):
        token_balanced_ranges(tokens, 2, unit=3)


def test_transfer_plans_deliver_each_rank_exactly_its_balanced_rows():
    cluster = ClusterSpec.from_nodelist("localhost", 4, "cpu")
    mesh = cluster.whole
    src_ranges, dst_ranges = ((0, 3), (3, 10)), ((0, 6), (6, 7), (7, 9), (9, 10))
    producer = DataLayout(mesh, S(2, 2, 1), (0,), src_ranges)
    consumer = DataLayout(mesh, S(4, 1, 1), (0,), dst_ranges)
    plan = plan_data_transfer({"seq": [8] * 10}, producer, consumer)
    got: dict[int, set[int]] = {}
    for t in plan.transfers:
        for d in t.dsts:
            got.setdefault(d, set()).update(range(t.lo, t.hi))
    for c in plan.local_copies:
        got.setdefault(c.device, set()).update(range(c.lo, c.hi))
    for dp_rank, (lo, hi) in enumerate(dst_ranges):
        assert got[consumer.layout.device(dp_rank, 0, 0)] == set(range(lo, hi))
    for t in plan.transfers:  # a source sends only rows its rank produced
        k = producer.layout.coords_by_device[t.src][0]
        assert src_ranges[k][0] <= t.lo < t.hi <= src_ranges[k][1]
    with pytest.raises(ValueError, match="do not tile"):
        plan_data_transfer({"seq": [8] * 11}, producer, consumer)
    with pytest.raises(ValueError, match="3 row ranges for 4 dp ranks"):
        DataLayout(mesh, S(4, 1, 1), (0,), ((0, 1), (1, 2), (2, 10)))


# -- a run: ppo_tiny with lengths from the EOS schedule, every call after generation at dp 2 -------------------
SCHEDULE = "ResponseLengths.lognormal(median=2, p99=7)"
EXPERIMENT_FILE = f'''
import dataclasses
import importlib.util

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.api import ResponseLengths, auto

_spec = importlib.util.spec_from_file_location("ppo_tiny_base", {EXPERIMENT!r})
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Balanced(_base.TinyPPO):
    dataset: str = {str(REPO / "experiments/data/ppo_tiny_prompts.jsonl")!r}
    ppo: PPOConfig = PPOConfig(n_minibatches=2, lr=2e-3, critic_lr=2e-3, kl_coef=0.01, length_schedule={SCHEDULE})
    balance_tokens: bool = BALANCE
    sample_every: int = 1
    log_samples: int = 32  # every sequence's lengths go to samples.jsonl
'''
N_ITER = 3


def run_balanced(tmp_path, text: str, balance: bool, iterations: int, fused: bool = False, places=None):
    """``realloc run`` of experiment ``text`` (BALANCE replaced) on a hand plan: every call at dp 2 over both
    devices (or ``places``), the train pair fused or not."""
    exp = tmp_path / f"balanced_{balance}.py"
    exp.write_text(text.replace("BALANCE", str(balance)))
    graph = build_graph(load_experiment(str(exp)))
    plan = tmp_path / f"plan_{fused}.json"
    ExecutionPlan.by_hand(graph, places or {c: ("localhost", 2, 1, 1, 1) for c in graph.spec.call_names},
                          source="hand", fused=[("actor_train", "critic_train")] if fused else []).save(plan)
    run_dir = tmp_path / f"run_{balance}_{fused}"
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet", "--plan",
           str(plan), "--iterations", str(iterations)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


def logged_rows(run_dir) -> dict[tuple[int, str], tuple[tuple[int, ...], ...]]:
    """(iteration from 0, call) -> each dp rank's rows, as worker 0's log shows the requests that named them."""
    seen = {}
    for line in (run_dir / "logs" / "worker0.log").read_text().splitlines():
        m = re.search(r"iteration (\d+) call (\w+) rows (\[.*\])", line)
        if m:
            seen[int(m.group(1)) - 1, m.group(2)] = tuple(tuple(r) for r in eval(m.group(3)))  # noqa: S307
    return seen


def logged_tokens(run_dir, t: int) -> list[int]:
    """Each sequence's tokens (prompt + response) in iteration t (from 0), from samples.jsonl."""
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    rows = sorted((s for s in samples if s["iteration"] == t + 1 and "prompt_ids" in s), key=lambda s: s["seq"])
    return [len(s["prompt_ids"]) + len(s["response_ids"]) for s in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The PPO runs: balanced, unbalanced (equal contiguous rows), balanced with the train pair fused."""
    base = tmp_path_factory.mktemp("token_balance")
    cache: dict[tuple[bool, bool], object] = {}

    def get(balance: bool, fused: bool = False):
        if (balance, fused) not in cache:
            cache[balance, fused] = run_balanced(base, EXPERIMENT_FILE, balance, N_ITER, fused)
        return cache[balance, fused]

    return get


def test_a_balanced_run_deals_rows_by_tokens_and_matches_the_unbalanced_run(runs):
    """Every later call's dp ranks ran on the row lists ``deal_rows`` makes of the iteration's lengths (per
    mini-batch for the train steps), and the run equals the one that deals equal contiguous rows: samples,
    rewards, losses, gradient norms, and the final checkpoint with the optimizer state (float order only)."""
    from test_streaming import assert_same_runs

    balanced, even = runs(True), runs(False)
    # the row lists the workers ran each later call with: the token-balanced dealing of each iteration's lengths
    seen = logged_rows(balanced)
    assert not any(re.search(r"call \w+ rows", x) for x in (even / "logs" / "worker0.log").read_text().splitlines())
    samples = [json.loads(x) for x in (balanced / "samples.jsonl").read_text().splitlines()]
    contiguous = []
    for t in range(N_ITER):
        tokens = logged_tokens(balanced, t)
        assert len(tokens) == 32
        want = deal_rows(tokens, 2)
        contiguous.append(_ratio(tokens, token_balanced_ranges(tokens, 2)))
        assert worst_ratio(tokens, want) <= 1.05 and sorted(i for r in want for i in r) == list(range(32))
        for call in ("rew_inf", "ref_inf", "critic_inf"):
            assert seen[t, call] == want
        train = deal_rows(tokens, 2, n_minibatches=2)  # balanced per mini-batch (index mod 2), a row of each
        assert worst_ratio(tokens, train, 2) <= 1.05
        assert all(sum(i % 2 == k for i in r) >= 1 for r in train for k in (0, 1))
        for call in ("actor_train", "critic_train"):
            assert seen[t, call] == train
    assert max(contiguous) > 1.05  # contiguous shares could not balance some iteration
    # realloc search --lengths-from reads the lengths back: the schedule's, drawn per sequence
    schedule = ResponseLengths.lognormal(median=2, p99=7)
    lens = [len(x["response_ids"]) for x in samples if "response_ids" in x]
    assert len(lens) == 32 * N_ITER and len(set(lens)) > 3 and max(lens) <= 8
    assert lengths_from_run(balanced) == ResponseLengths.empirical(lens)
    assert schedule.quantile(0.5, 8) - 1 <= sorted(lens)[len(lens) // 2] <= schedule.quantile(0.5, 8) + 1
    # the same samples, rewards, losses and grad norms as the run that deals equal rows, and the same checkpoint
    for a, b in zip(metrics(balanced), metrics(even)):
        for k in ("reward", "response_len", "kl", "actor_loss", "critic_loss", "actor_grad_norm", "critic_grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    # the same tokens; log-probabilities from iteration 2 on through parameters equal up to float order
    assert_same_runs(balanced, even, N_ITER)


def test_a_fused_train_pair_at_dp_2_runs_on_the_balanced_row_lists(runs):
    """actor_train and critic_train fused into one request (docs/fused-training.md) get their row lists as
    ``rows`` and ``fused_rows``: the same lists and the same run as the balanced serial one."""
    from test_streaming import assert_same_runs

    fused, serial = runs(True, fused=True), runs(True)
    labels = [json.loads(x).get("label") for x in (fused / "requests.jsonl").read_text().splitlines()]
    assert labels.count("actor_train+critic_train") == N_ITER  # one request per iteration ran the pair
    seen = logged_rows(fused)
    for t in range(N_ITER):
        assert seen[t, "actor_train"] == deal_rows(logged_tokens(fused, t), 2, n_minibatches=2)
    assert_same_runs(fused, serial, N_ITER)


def test_transfer_plans_move_lists_of_rows_exactly_by_brute_force():
    """Ranks holding and needing arbitrary row lists (issue 31, item 2's planner): every consumer device gets
    exactly its rows, none it holds or twice, each from a device that holds it; nothing moves twice."""
    import numpy as np

    rng = np.random.default_rng(4)
    cluster = ClusterSpec.from_nodelist("n[1-2]", 4, "cpu")
    strategies = [S(1, 1, 1), S(2, 1, 1), S(4, 1, 1), S(2, 2, 1), S(2, 1, 2), S(1, 2, 2)]
    meshes = [m for m in cluster.device_meshes()]
    for trial in range(60):
        n = int(rng.integers(1, 14))
        lays = []
        for _ in range(2):
            s = strategies[int(rng.integers(len(strategies)))]
            mesh = next(m for m in rng.permutation(meshes) if m.size == s.world_size)
            owner = rng.integers(0, s.dp, size=n)
            rows = tuple(tuple(int(i) for i in np.flatnonzero(owner == k)) for k in range(s.dp))
            lays.append((mesh, s, rows))
        (pm, ps, prows), (cm, cs, crows) = lays
        producer = DataLayout(pm, ps, (ps.pp - 1,), rows=prows)
        consumer = DataLayout(cm, cs, tuple(range(cs.pp)), rows=crows)
        plan = plan_data_transfer({"seq": [int(b) for b in rng.integers(1, 9, size=n)]}, producer, consumer)
        holds = {producer.layout.device(k, t, ps.pp - 1): set(r) for k, r in enumerate(prows) for t in range(ps.tp)}
        got: dict[int, list[int]] = {}
        for t in plan.transfers:
            assert set(range(t.lo, t.hi)) <= holds[t.src], trial
            for d in t.dsts:
                got.setdefault(d, []).extend(range(t.lo, t.hi))
        for c in plan.local_copies:
            assert set(range(c.lo, c.hi)) <= holds.get(c.device, set()), trial
            got.setdefault(c.device, []).extend(range(c.lo, c.hi))
        for k, r in enumerate(crows):
            for st in range(cs.pp):
                for t in range(cs.tp):
                    dev = consumer.layout.device(k, t, st)
                    assert sorted(got.get(dev, [])) == sorted(r), trial
        assert plan.redundancy_ratio == 1.0
    with pytest.raises(ValueError, match="each of the batch's 3 sequences exactly once"):
        DataLayout(meshes[0], S(1, 1, 1), (0,), rows=((0, 2),)).row_runs(3)
    with pytest.raises(ValueError, match="not contiguous"):
        DataLayout(cluster.whole, S(8, 1, 1), (0,), rows=((0, 2),) + ((1,),) + ((),) * 6).row_ranges(3)
