"""Streaming and long-tail migration (issue 31 items 2 and 3, docs/streaming.md): generation stopped at the
migration point and continued elsewhere after a re-run prefill gives the unmigrated tokens; migrated and streamed
runs give the unmigrated run's samples, rewards, losses and final parameters."""

from __future__ import annotations

import pytest
import torch

from model_helpers import build_model
from realloc.lengths import ResponseLengths
from realloc.models.config import get_model_config
from realloc.models.length_schedule import scheduled_lengths
from realloc.models.sampling import GenerationConfig
from test_length_schedule import MAX_NEW, N_ROWS, SCHEDULE, pool  # noqa: F401 - the module's gloo pool
from test_length_schedule import _prompts as _prompt_lists


def _prompts():
    return [torch.tensor(p) for p in _prompt_lists()]


def _responses(out):
    return [(out.sequences[b, out.prompt_lengths[b]:out.lengths[b]].tolist(),
             out.logprobs[b, out.prompt_lengths[b]:out.lengths[b]]) for b in range(out.lengths.numel())]


def model_and_plain(ctx, gconfig, n_mbs):
    """On one replica: the tiny model, the prompts and their plain generation's responses (None off rank 0)."""
    model = build_model(ctx, get_model_config("tiny"), 1, 1, 1, seed=3)
    if model is None:
        return None
    rows = _prompts()
    return model, rows, _responses(model.generate([r.tolist() for r in rows], gconfig, seq_ids=range(N_ROWS),
                                                  n_mbs=n_mbs))


def _two_phases(ctx, gconfig, threshold, n_mbs):
    """On one replica: plain generation, and phase 1 to ``threshold`` rows then phase 2 on the rest."""
    from realloc.models.tail_decode import continue_decoding, decode_until

    got = model_and_plain(ctx, gconfig, n_mbs)
    if got is None:
        return None
    model, rows, plain = got
    counts = []
    one = decode_until(model, rows, gconfig, range(N_ROWS), n_mbs, lambda n: counts.append(n) or n, threshold)
    got = dict(zip(one.finished, _responses(one.output)))
    tail_ids = one.tail.seq_ids
    if tail_ids:
        got.update(zip(tail_ids, _responses(continue_decoding(model, one.tail, gconfig, n_mbs=2))))
    return plain, [got[i] for i in range(N_ROWS)], one.step, counts, tail_ids


@pytest.mark.parametrize("eos,n_mbs", [((40, 41), 1), ((), 3)])
def test_a_tail_continued_after_a_rerun_prefill_gives_the_unmigrated_tokens(pool, eos, n_mbs):
    gconfig = GenerationConfig(max_new_tokens=MAX_NEW, seed=5, eos_token_ids=eos, temperature=0.9,
                               length_schedule=SCHEDULE)
    plain, migrated, step, counts, tail_ids = next(r for r in pool.run(_two_phases, gconfig, 3, n_mbs) if r)
    lengths = scheduled_lengths(SCHEDULE, MAX_NEW, 5, range(N_ROWS))
    # the migration point: the first step after which at most 3 rows are unfinished (by the schedule's lengths)
    want_step = min(t for t in range(MAX_NEW) if sum(n > t + 1 for n in lengths) <= 3)
    assert step == want_step and counts[-1] == len(tail_ids) <= 3 and len(counts) == step + 1
    assert sorted(tail_ids) == [i for i, n in enumerate(lengths) if n > step + 1] and tail_ids
    assert [len(t) for t, _ in migrated] == lengths
    for (a, lpa), (b, lpb) in zip(plain, migrated):
        assert a == b
        assert torch.allclose(lpa, lpb, atol=1e-5)




def _gathered(ctx):
    import torch.distributed as dist

    from realloc.runtime.control.worker_tail import _gather

    n = 2 if ctx.rank == 0 else 0  # a replica with no rows to send
    table = {"id": torch.arange(n) + 10 * ctx.rank, "eos": torch.ones(n, dtype=torch.bool),
             "tok": torch.arange(3 * n).view(n, 3) + 100}
    return _gather(table, dist.group.WORLD, 2, torch.device("cpu"))


def test_the_all_gather_of_rows_takes_replicas_with_none(pool):
    for got in pool.run(_gathered):
        assert got["id"].tolist() == [0, 1] and got["eos"].tolist() == [True, True]
        assert got["tok"].tolist() == [[100, 101, 102], [103, 104, 105]]

# -- the rows' bookkeeping: deals, split consumers, row lists in the data store ---------------------------------------
def _ppo_plan(places, tail):
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from run_helpers import TINY

    graph = build_graph(load_experiment(TINY))
    return graph, ExecutionPlan.by_hand(graph, places, source="hand", tail=tail)


def test_split_consumers_are_the_non_train_readers_on_freed_devices_only():
    from realloc.graph.streaming import deal, split_consumers

    assert deal([9, 1, 7, 3, 5], 2) == ((1, 3, 5), (7, 9)) and deal([4], 3) == ((4,), (), ())
    both, dev0, dev1 = ("localhost", 2, 1, 1, 1), ("localhost:0", 1, 1, 1, 1), ("localhost:1", 1, 1, 1, 1)
    places = {"actor_gen": both, "rew_inf": dev1, "ref_inf": dev0, "critic_inf": dev1, "actor_train": both,
              "critic_train": dev1}
    graph, plan = _ppo_plan(places, {"actor_gen": (4, 1)})
    # replica 0 (device 0) keeps the tail: ref_inf shares its device, the train steps wait for the whole batch
    assert split_consumers(plan, graph, "actor_gen") == ["rew_inf", "critic_inf"]
    graph, plan = _ppo_plan(places, {})
    assert split_consumers(plan, graph, "actor_gen") == []


def test_row_lists_round_trip_through_the_data_store_and_a_single_row_unpacks_at_any_offset():
    from realloc.runtime.transfer.data_store import DataStore, index_runs, pack_rows, unpack_rows
    from realloc.runtime.wire.protocol import TensorMeta

    store = DataStore()
    ids = [0, 2, 3, 7]
    rows = {"x": torch.arange(8).view(4, 2), "f": torch.tensor([True, False, True, True])}
    store.put_rows("k", 0, ids, rows)
    assert index_runs(ids) == [(0, 1), (2, 4), (7, 8)]
    got = store.get_rows("k", 0, [2, 3, 7])
    assert torch.equal(got["x"], rows["x"][1:]) and torch.equal(got["f"], rows["f"][1:])
    assert torch.equal(store.get_rows("k", 0, range(2, 4))["x"], rows["x"][1:3])
    # one row whose int64 column starts at an odd byte (a bool column before it), in a buffer at an odd offset
    metas = [TensorMeta(name="a", dtype="bool", shape=[3]), TensorMeta(name="b", dtype="int64", shape=[2])]
    one = {"a": torch.tensor([[True, False, True]]), "b": torch.tensor([[5, -6]])}
    buf = torch.cat([torch.zeros(5, dtype=torch.uint8), pack_rows(one, metas)])[5:]
    back = unpack_rows(buf, metas, 1)
    assert torch.equal(back["a"], one["a"]) and torch.equal(back["b"], one["b"])


def test_what_the_runtime_cannot_migrate_is_one_value_error():
    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from realloc.graph.streaming import check_runtime_tail
    from realloc.runtime.control.master_tail import split_map
    from realloc.runtime.control.program import RuntimeProgram

    big = build_graph(load_experiment("experiments/ppo_7b_7b.py"))
    places = {n: ("trainer[01-02]", 4, 2, 2, 4) for n in big.spec.call_names}
    with pytest.raises(ValueError, match=r"'actor_gen'.*pp 1 only \(it streams at any pp: instances=0\), and the "
                                         r"call runs at pp 2"):
        check_runtime_tail(ExecutionPlan.by_hand(big, places, tail={"actor_gen": (100, 1)}), big)
    check_runtime_tail(ExecutionPlan.by_hand(big, places, tail={"actor_gen": (100, 0)}), big)  # streams at pp 2
    check_runtime_tail(ExecutionPlan.by_hand(big, places), big)  # no tail entry: nothing to check
    places = {c: ("localhost", 2, 1, 1, 1) for c in ("actor_gen", "rew_inf", "ref_inf", "critic_inf",
                                                     "actor_train", "critic_train")}
    graph, plan = _ppo_plan(places, {"actor_gen": (4, 1)})
    assert split_map(RuntimeProgram(graph, plan)) == {}  # every consumer shares device 0 with the tail replica


# -- runs: PPO and GRPO on the 2-device CPU cluster, generation at dp 2 migrating its tail to replica 0 ------------
LONG_TAIL = "ResponseLengths.lognormal(median=2, p99=14)"
R_T = 4
EXPERIMENTS = {
    "ppo": ("ppo_tiny.py", "TinyPPO", "ppo", "PPOConfig(n_minibatches=2, lr=2e-3, critic_lr=2e-3, kl_coef=0.01, "
            "length_schedule=SCHEDULE)", "from realloc.algorithms.ppo.ppo_config import PPOConfig"),
    "grpo": ("grpo_tiny.py", "TinyGRPO", "grpo", "GRPOConfig(n_minibatches=2, lr=2e-3, kl_coef=0.01, "
             "length_schedule=SCHEDULE)", "from realloc.algorithms.critic_free.grpo import GRPOConfig"),
}
EXPERIMENT_FILE = '''
import dataclasses
import importlib.util

from realloc.api import ResponseLengths, auto
IMPORT

_spec = importlib.util.spec_from_file_location("base", BASE)
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=BATCH, prompt_len=8, gen_len=16)
@dataclasses.dataclass
class Streamed(_base.CLASS):
    dataset: str = DATASET
    FIELD: object = SETTINGS
    sample_every: int = 1
    log_samples: int = 32
'''
N_ITER = 2


def _experiment(tmp_path, algo: str):
    from run_helpers import REPO

    base, cls, field, settings, imp = EXPERIMENTS[algo]
    text = (EXPERIMENT_FILE.replace("IMPORT", imp).replace("BASE", repr(str(REPO / "experiments" / base)))
            .replace("CLASS", cls).replace("FIELD", field).replace("SETTINGS", settings.replace("SCHEDULE", LONG_TAIL))
            .replace("DATASET", repr(str(REPO / "experiments/data/ppo_tiny_prompts.jsonl")))
            .replace("BATCH", "32" if algo == "ppo" else "8"))
    path = tmp_path / f"streamed_{algo}.py"
    path.write_text(text)
    return path


def _run(tmp_path, exp, name: str, tail: dict, gen_mesh: tuple = ("localhost", 2, 1, 1, 1),
         infer: tuple = ("localhost:1", 1, 1, 1, 1), train: tuple = ("localhost", 2, 1, 1, 1),
         places: dict | None = None, iterations: int = N_ITER):
    import subprocess
    import sys

    from realloc.api import load_experiment
    from realloc.graph.dataflow import build_graph
    from realloc.graph.plan import ExecutionPlan
    from test_runtime_e2e import env

    graph = build_graph(load_experiment(str(exp)))
    # generation at dp 2 over both devices (or on ``gen_mesh``); the inference calls on device 1 only (a freed
    # replica's device: they stream), the train steps over both
    places = places or {c: (train if graph.call(c).is_train else gen_mesh if c == "actor_gen" else infer)
                        for c in graph.spec.call_names}
    plan = tmp_path / f"{name}.json"
    ExecutionPlan.by_hand(graph, places, source="hand", tail=tail).save(plan)
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "realloc.cli", "run", str(exp), "--run-dir", str(run_dir), "--quiet", "--plan",
           str(plan), "--iterations", str(iterations)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return run_dir


def _checkpoint(run_dir, iterations: int = N_ITER):
    from safetensors import safe_open

    out = {}
    for f in sorted((run_dir / f"checkpoints/iter_{iterations:08d}").rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({f"{f.name}/{k}": h.get_tensor(k) for k in h.keys()})
    return out


def _samples(run_dir):
    import json

    rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    return {(s["iteration"], s["key"] if "key" in s else "", s["seq"]): s for s in rows}


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_migrated_and_streamed_run_matches_the_unmigrated_run(tmp_path, algo):
    exp = _experiment(tmp_path, algo)
    fused = _run(tmp_path, exp, "fused", {"actor_gen": (R_T, 1)})
    plain = _run(tmp_path, exp, "plain", {})
    # the workers streamed: each inference call ran twice per iteration, first on the rows finished at the
    # migration point (the first step after which at most R_T rows of the 32 run), then on the rest
    assert_inference_in_two_parts(fused)
    assert_same_runs(fused, plain)


def assert_inference_in_two_parts(run_dir) -> None:
    """Device 1's inference calls ran on the rows finished after the first step that left at most R_T of the 32
    rows running (by the EOS schedule), then on the rest, per iteration (worker1.log)."""
    import re

    from realloc.models.weights import param_seed

    calls = {}
    for line in (run_dir / "logs" / "worker1.log").read_text().splitlines():
        m = re.search(r"iteration (\d+) call (\w+) rows (\[.*\])", line)
        if m:
            calls.setdefault((int(m.group(1)) - 1, m.group(2)), []).append(eval(m.group(3))[0])  # noqa: S307
    inference = [c for c in ("rew_inf", "ref_inf", "critic_inf") if c in {k[1] for k in calls}]
    assert len(inference) >= 2
    for t in range(N_ITER):
        lengths = scheduled_lengths(ResponseLengths.lognormal(median=2, p99=14), 16,
                                    param_seed(1, f"generate/{t}"), range(32))
        step = min(s for s in range(16) if sum(n > s + 1 for n in lengths) <= R_T)
        part1 = [i for i, n in enumerate(lengths) if n <= step + 1]
        assert 0 < 32 - len(part1) <= R_T
        for c in inference:
            assert calls[t, c] == [part1, [i for i in range(32) if i not in part1]], (t, c)


def assert_same_runs(fused, plain, iterations: int = N_ITER) -> None:
    """The same samples, rewards, losses, and final parameters and optimizer state (after ``iterations``)."""
    from test_runtime_e2e import metrics

    for a, b in zip(metrics(fused), metrics(plain), strict=True):
        for k, v in b.items():
            if isinstance(v, float) and k not in ("time", "iteration_time") and not k.endswith("_s"):
                assert a[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    got, want = _samples(fused), _samples(plain)
    assert got.keys() == want.keys() and len(want) >= 32 * iterations
    for k, s in want.items():
        for f, v in s.items():
            if f == "logp":
                assert got[k][f] == pytest.approx(v, abs=1e-5)
            elif f != "reward":
                assert got[k][f] == v, (k, f)
            else:
                assert got[k][f] == pytest.approx(v, abs=1e-6)
    a, b = _checkpoint(fused, iterations), _checkpoint(plain, iterations)
    assert a.keys() == b.keys() and a
    for k in b:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-6), k
