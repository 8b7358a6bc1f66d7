"""``realloc run`` on pools of two device kinds (issue 32 items 4-5, docs/heterogeneous.md): each layout in its
pool's dtype, cast on receive equal to loading the sender's checkpoint in the receiver's dtype, a home that
keeps its own dtype's state, and a local run on ``cpu`` + ``cpu-bf16`` against the same run on one kind."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from mp_pool import GlooPool
from test_param_realloc import _batch, _loss

from realloc.api import load_experiment
from realloc.graph.dataflow import build_graph
from realloc.graph.plan import ExecutionPlan

REPO = Path(__file__).resolve().parents[1]
TWO_KINDS = str(REPO / "experiments/ppo_tiny_two_kinds.py")  # pool 0: cpu0 (cpu, fp32); pool 1: cpu1 (cpu-bf16)
# The reference, the critic's inference and its copy of the critic on the bf16 pool; the rest on the fp32 pool.
SPLIT = {"actor_gen": "cpu0", "rew_inf": "cpu0", "ref_inf": "cpu1", "critic_inf": "cpu1", "actor_train": "cpu0",
         "critic_train": "cpu0"}
HEADLINE = ("reward", "kl", "actor_loss", "critic_loss", "approx_kl", "actor_grad_norm", "critic_grad_norm",
            "adv_abs_mean", "value_mean", "return_mean")


def _program(placement: dict[str, str]):
    from realloc.runtime.control.program import RuntimeProgram

    graph = build_graph(load_experiment(TWO_KINDS))
    return RuntimeProgram(graph, ExecutionPlan.by_hand(graph, {c: (m, 1, 1, 1, 1) for c, m in placement.items()}))


# -- what the program derives -------------------------------------------------------------------------------
def test_each_layout_holds_its_pools_dtype_and_a_narrowing_trip_keeps_home():
    from realloc.runtime.control.pool_dtypes import DtypeRoutes, casts_exactly

    prog = _program(SPLIT)
    assert prog.dtype_of("critic_train") == ("float32", 4) and prog.dtype_of("critic_inf") == ("bfloat16", 2)
    out, back = (r for r in prog.reallocs("critic") if not r.snapshot)
    assert (out.src_call, out.dst_call) == ("critic_train", "critic_inf")
    # bytes travel in the sender's dtype
    assert prog.realloc_plan(out).bytes_per_element == 4 and prog.realloc_plan(back).bytes_per_element == 2
    # fp32 home -> bf16 and back would round the home's weights: home keeps them, the way back is skipped
    routes = DtypeRoutes.of(prog)
    assert routes.keep == {("critic", "critic_train", "critic_inf")}
    assert routes.skip == {("critic", "critic_inf", "critic_train")}
    # a bf16 home through fp32 and back is exact: it moves as on one pool
    flipped = _program({**SPLIT, "critic_inf": "cpu0", "critic_train": "cpu1"})
    assert DtypeRoutes.of(flipped) == DtypeRoutes()
    assert [casts_exactly(a, b) for a, b in [("bfloat16", "float32"), ("float32", "bfloat16"),
                                             ("bfloat16", "float16"), ("float16", "bfloat16")]] == [1, 0, 0, 0]


# -- cast on receive, on two gloo processes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(2, tmp_path_factory.mktemp("pools")) as p:
        yield p


def _round_trip(ctx, placement: dict[str, str], ckpt: str):
    """Train the actor at home, move it to the generation layout on the other pool and back, train again."""
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout
    from realloc.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
    from realloc.runtime.control.pool_dtypes import reallocate_model
    from realloc.runtime.transfer.param_realloc import Reallocator

    prog = _program(placement)
    home, gen = prog.calls["actor_train"], prog.calls["actor_gen"]
    cfg = prog.model_config("actor")
    lay = {cl.call: ModelLayout.for_model(cfg, cl.mesh, cl.strategy) for cl in (home, gen)}
    ctx.groups.ensure_layouts(list(lay.values()))
    out, back = (r for r in prog.reallocs("actor") if not r.snapshot)
    mover = Reallocator(ctx.groups, ctx.rank)
    mover.prepare([prog.realloc_plan(r) for r in (out, back)])

    def model(cl, init="random"):
        if ctx.rank not in cl.ranks:
            return None
        return ParallelModel(cfg, ctx.groups.model_groups(lay[cl.call]), dtype=getattr(torch, prog.dtype_of(cl.call)[0]),
                             init=init, seed=5)

    rows = (0, 4)
    expected = None
    trained = model(home)
    if trained is not None:  # the reference: two steps without moving
        ref = model(home)
        ref_opt = ref.make_optimizer(lr=1e-2)
        for seed in (1, 2):
            ref.train_step([_batch(seed, cfg.vocab_size, rows)], _loss, ref_opt)
        expected = {n: p.detach().clone() for n, p in ref.params().items()}
        opt = trained.make_optimizer(lr=1e-2)
        trained.train_step([_batch(1, cfg.vocab_size, rows)], _loss, opt)
        save_hf_checkpoint(trained, ckpt)  # the sender's parameters as a checkpoint, in its dtype
    copy = model(gen, "empty")
    reallocate_model(mover, prog, out, trained, copy, "cpu", drop_src=True)
    same_as_loaded = kept = None
    if copy is not None:  # the checkpoint was written before the sender sent
        loaded = model(gen, "empty")
        load_hf_checkpoint(loaded, ckpt)
        same_as_loaded = all(p.dtype == loaded.dtype and torch.equal(p, loaded.params()[n])
                             for n, p in copy.params().items())
    if trained is not None:
        kept = trained.state == "ready"
        if not kept:
            trained.materialize()
    reallocate_model(mover, prog, back, copy, trained, "cpu", drop_src=True)
    same_after = None
    if trained is not None:
        trained.train_step([_batch(2, cfg.vocab_size, rows)], _loss, opt)
        same_after = all(torch.equal(p, expected[n]) for n, p in trained.params().items())
    return same_as_loaded, kept, same_after


@pytest.mark.parametrize("home,gen,kept", [("cpu0", "cpu1", True), ("cpu1", "cpu0", False)],
                         ids=["fp32-home-bf16-copy", "bf16-home-fp32-copy"])
def test_cast_on_receive_equals_loading_the_checkpoint_and_home_keeps_its_state(pool, tmp_path, home, gen, kept):
    placement = {**SPLIT, "actor_train": home, "actor_gen": gen}
    (loaded_gen, _, _), (_, kept_home, same_home) = sorted(
        pool.run(_round_trip, placement, str(tmp_path / "ckpt")), key=lambda x: x[0] is None)
    assert loaded_gen, "the received copy differs from the sender's checkpoint loaded in the receiver's dtype"
    assert same_home, "training after the trip differs from training without it"
    assert kept_home is kept  # fp32 home: kept while a bf16 copy runs; bf16 home: released (fp32 holds it exactly)


# -- a local run on two kinds ------------------------------------------------------------------------------------
ONE_KIND = """
import dataclasses, sys
sys.path.insert(0, {experiments!r})
from ppo_tiny import TinyPPO
from realloc.api import Pool, auto

@auto(pools=[Pool("cpu0", "cpu", 1), Pool("cpu1", "cpu", 1)], batch_size=32, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class OneKind(TinyPPO):
    dataset: str = {dataset!r}
"""


def _run(experiment: str, base: Path, name: str, iterations: int) -> list[dict]:
    graph = build_graph(load_experiment(experiment))
    plan = base / f"{name}.json"
    ExecutionPlan.by_hand(graph, {c: (m, 1, 1, 1, 1) for c, m in SPLIT.items()}, source="hand").save(plan)
    cmd = [sys.executable, "-m", "realloc.cli", "run", experiment, "--plan", str(plan), "--iterations",
           str(iterations), "--run-dir", str(base / name), "--quiet", "--no-final-checkpoint"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(base), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
    return [json.loads(x) for x in (base / name / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_local_run_on_two_kinds_matches_one_kind_within_bf16(tmp_path):
    one_kind = tmp_path / "one_kind.py"
    one_kind.write_text(textwrap.dedent(ONE_KIND.format(experiments=str(REPO / "experiments"),
                                                        dataset=str(REPO / "experiments/data/ppo_tiny_prompts.jsonl"))))
    one = _run(str(one_kind), tmp_path, "one", 2)
    two = _run(TWO_KINDS, tmp_path, "two", 2)
    first_one, first_two = one[0], two[0]
    # Iteration 1: the same samples (generation on the fp32 pool), the reference's and the critic's inference
    # in bf16 (the critic reallocated there, cast on receive): every metric within bf16's rounding.
    assert first_two["reward"] == first_one["reward"]
    for k in HEADLINE:
        assert first_two[k] == pytest.approx(first_one[k], rel=2e-2, abs=5e-4), k
    assert first_two["value_mean"] != first_one["value_mean"]  # the bf16 pool really computed in bf16
    # Later iterations sample from slightly different weights (Adam's first steps amplify any difference), so
    # they are compared by what they are: finite, the same size of numbers.
    assert len(two) == 2 and all(math.isfinite(two[1][k]) for k in HEADLINE)


# -- measuring a kind on a loaded machine --------------------------------------------------------------------
def test_profile_can_time_in_cpu_time():
    from realloc.cli import build_parser
    from realloc.estimator.profile_cli import build_job, command_line

    args = build_parser().parse_args(["profile", "--model", "tiny", "--kind", "cpu-bf16", "--clock", "cpu"])
    assert build_job(args).clock == "cpu" and "--clock cpu" in command_line(args)
    assert build_job(build_parser().parse_args(["profile", "--model", "tiny"])).clock == "wall"
    # what the CPU clock measures: tests/test_profile_clock.py


def test_an_unknown_kind_is_one_line_at_show(tmp_path, capsys):
    from realloc import cli

    exp = tmp_path / "typo.py"
    exp.write_text(textwrap.dedent(ONE_KIND.format(experiments=str(REPO / "experiments"), dataset="x.jsonl"))
                   .replace('Pool("cpu1", "cpu", 1)', 'Pool("cpu1", "cpu-bf61", 1)'))
    assert cli.main(["show", str(exp)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pool 1: unknown device kind 'cpu-bf61'" in err[0] and "cpu-bf16" in err[0]
