"""LoRA in the graph, the estimator and the search (no workers): settings, the base as reference, bad inputs,
and the memory and time a LoRA train step is priced at next to full fine-tuning."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.api import LoRAConfig, experiment_spec, load_experiment, reference_from_base
from realloc.estimator.hardware import Precision
from realloc.estimator.memory import Workload, call_memory, stage_call_memory
from realloc.estimator.opcount import Part, Phase, op_work
from realloc.calls import InterfaceType
from realloc.graph.dataflow import build_graph
from realloc.models.config import get_model_config
from realloc.models.lora_config import is_adapter
from realloc.models.param_layout import param_specs, stage_param_specs
from realloc.overrides import apply_overrides, load_with_overrides
from realloc.strategy import ParallelStrategy

REPO = Path(__file__).resolve().parents[1]
TINY_LORA = str(REPO / "experiments" / "arith_grpo_lora.py")
BIG_LORA = str(REPO / "experiments" / "grpo_7b_lora.py")


def test_the_reference_of_a_lora_actor_is_its_base_and_no_reference_model_exists():
    graph = build_graph(load_experiment(TINY_LORA))
    assert set(graph.model_configs) == {"actor", "reward"}  # no "ref"
    ref = graph.call("ref_inf")
    assert ref.model_name == "actor" and ref.interface_args["adapters"] == "off"
    assert graph.model_configs["actor"].lora == LoRAConfig(rank=8, alpha=16)
    # the reference is read before the train step replaces the adapters, like any reader of the actor
    assert graph.graph.has_edge("ref_inf", "actor_train")


def test_lora_settings_are_set_from_the_command_line_and_change_the_digest():
    spec = load_experiment(TINY_LORA)
    other = apply_overrides(spec, ["lora.rank=16", "lora.target_modules=[\"q_proj\", \"v_proj\"]"])
    cfg = build_graph(other).model_configs["actor"]
    assert cfg.lora.rank == 16 and cfg.lora.target_modules == ("q_proj", "v_proj")
    assert cfg.adapter_params == cfg.n_layers * 16 * (64 + 64 + 64 + 64)
    assert build_graph(other).digest != build_graph(spec).digest


@pytest.mark.parametrize("kw, match", [
    (dict(rank=0), "rank must be a positive integer"),
    (dict(alpha=-1.0), "alpha must be a positive number"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(target_modules=("qkv",)), "unknown module 'qkv'"),
    (dict(target_modules=()), "target_modules is empty"),
    (dict(models=()), "models must name"),
])
def test_bad_lora_settings_are_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kw)


def _with(spec, lora, rpcs=None):
    @dataclasses.dataclass
    class Exp(type(spec.config)):
        pass

    cfg = Exp(**{f.name: getattr(spec.config, f.name) for f in dataclasses.fields(spec.config)})
    cfg.lora = lora
    if rpcs is not None:
        type(cfg).rpcs = property(lambda self: rpcs)
    return experiment_spec(cfg, source=spec.source, auto_config=getattr(type(spec.config), "__realloc_auto__"))


def test_lora_on_a_model_that_is_not_trained_or_not_there_is_refused():
    spec = load_experiment(TINY_LORA)
    with pytest.raises(ValueError, match="lora.models names 'critic', which no call uses"):
        build_graph(_with(spec, LoRAConfig(models=("critic",))))
    with pytest.raises(ValueError, match="'reward', a parameter-free rule"):
        build_graph(_with(spec, LoRAConfig(models=("actor", "reward"))))
    # adapters off on a model without adapters: the run would silently use the trained weights as reference
    with pytest.raises(ValueError, match="runs model 'actor' without its LoRA adapters, but it has none"):
        build_graph(_with(spec, None))
    with pytest.raises(ValueError, match="must be a LoRAConfig"):
        build_graph(_with(spec, {"rank": 8}))


def test_a_frozen_lora_model_and_a_train_step_without_adapters_are_refused():
    from realloc.algorithms.critic_free.grpo import critic_free_rpcs

    spec = load_experiment(TINY_LORA)
    rpcs = critic_free_rpcs("grpo", reward="rule", n_samples=8, reward_impl="verifiable_reward",
                            reward_args={"rule": "exact_match", "field": "answer"})
    # the plain graph with a separate reference model "ref": LoRA on the frozen reference makes no sense
    plain = _with(spec, LoRAConfig(models=("ref",)), rpcs)
    object.__setattr__(plain, "models", {**plain.models, "ref": plain.models["actor"]})
    with pytest.raises(ValueError, match="lora.models names 'ref', which no call trains"):
        build_graph(plain)
    train_off = [dataclasses.replace(r, interface_args={"adapters": "off"}) if r.is_train else r
                 for r in reference_from_base(rpcs)]
    with pytest.raises(ValueError, match="a train step cannot run with the adapters off"):
        build_graph(_with(spec, LoRAConfig(), train_off))
    gen_off = [dataclasses.replace(r, interface_args={"adapters": "off"}) if r.name == "actor_gen" else r
               for r in reference_from_base(rpcs)]
    with pytest.raises(ValueError, match="'off' is for INFERENCE calls"):
        build_graph(_with(spec, LoRAConfig(), gen_off))
    bad = [dataclasses.replace(r, interface_args={"adapters": "no"}) if r.name == "ref_inf" else r
           for r in reference_from_base(rpcs)]
    with pytest.raises(ValueError, match="must be 'on' or 'off'"):
        build_graph(_with(spec, LoRAConfig(), bad))


def test_a_lora_train_step_holds_the_adapters_gradients_and_optimizer_state_only():
    full = get_model_config("llama3-8b")
    lora = dataclasses.replace(full, lora=LoRAConfig(rank=16, alpha=32))
    # by hand: per block, r x (in + out) for q (4096, 4096), k/v (4096, 1024), o (4096, 4096), gate/up
    # (4096, 14336), down (14336, 4096)
    per_block = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert lora.adapter_params == lora.trained_params == 32 * per_block
    assert sum(s.numel for s in param_specs(lora)) == full.allocated_params + 32 * per_block
    prec = Precision.for_dtype("bf16")
    work = Workload(InterfaceType.TRAIN_STEP, n_seqs=128, n_steps=1, prompt_len=1024, gen_len=1024)
    for strategy in (ParallelStrategy(8, 1, 1), ParallelStrategy(2, 2, 2), ParallelStrategy(1, 8, 1)):
        a = call_memory(lora, work, strategy, 8, prec)
        b = call_memory(full, work, strategy, 8, prec)
        tp, pp, dp = strategy.tp, strategy.pp, strategy.dp
        k = _reported_stage(lora, work, strategy, prec)
        trained = [s for s in stage_param_specs(lora, pp, k) if is_adapter(s.name)]
        assert a.grads == sum(s.shard_numel(tp) for s in trained) * prec.grad  # fp32 main_grad of the adapters
        # fp32 master, m and v of this dp rank's chunk of each adapter (ZeRO-1)
        assert a.optimizer == sum(-(-s.shard_numel(tp) // dp) for s in trained) * prec.optimizer
        assert a.params > b.params  # the adapters are held besides the base
        assert a.grads + a.optimizer < 0.02 * (b.grads + b.optimizer)  # tp 8: each rank holds whole A of q..up
        assert a.total < b.total
    # the backward computes no weight gradients of the frozen projections: about half the block's GEMM FLOPs
    bw_full = op_work(full, Part.BLOCK, Phase.BWD, 1, 1, 1024, prec).gemm_flops
    bw_lora = op_work(lora, Part.BLOCK, Phase.BWD, 1, 1, 1024, prec).gemm_flops
    assert 0.5 * bw_full < bw_lora < 0.55 * bw_full


def _reported_stage(cfg, work, strategy, prec):
    """The pipeline stage call_memory reports (the one with the largest total)."""
    totals = [stage_call_memory(cfg, work, strategy, 8, k, prec).total for k in range(strategy.pp)]
    return totals.index(max(totals))


def test_search_dry_run_on_a_7b_lora_experiment_places_no_reference_model_and_a_smaller_train_step():
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "search", BIG_LORA, "--dry-run", "--time", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    calls = [line.split()[0] for line in out.split("searched plan")[1].splitlines()[3:7]]
    assert calls == ["actor_gen", "rew_inf", "ref_inf", "actor_train"]
    assert "reallocate ref " not in out and "ref_inf run(s) actor's base (adapters off)" in out
    line = next(x for x in out.splitlines() if "actor_train at dp" in x)
    lora_mem = float(line.split("train-step memory ")[1].split()[0])
    full_mem = float(line.split("(full fine-tuning ")[2].split(")")[0])
    assert lora_mem < full_mem, line
    graph = build_graph(load_with_overrides(BIG_LORA))
    assert "ref" not in graph.model_configs


def test_a_measured_profile_prices_a_lora_backward_without_the_frozen_weight_gradients():
    # profiles measure full models: a LoRA model's backward is the measured time scaled by the roofline's
    # LoRA/full compute ratio; forwards are measured as they are
    from realloc.estimator.comm import CommModel
    from realloc.estimator.profile_table import ProfiledCosts
    from realloc.estimator.roofline import RooflineCosts
    from test_profile_table import TINY, make_table

    cluster = load_experiment(str(REPO / "experiments" / "ppo_tiny.py")).cluster
    comm = CommModel(cluster)
    full_roof = RooflineCosts(TINY, cluster.hardware, comm)

    def measured(key, tp, b, s):
        part, phase = key.split(".")
        return 3 * sum(full_roof.op(Part(part), Phase(phase), tp, b, s)) + 1e-5

    lora_cfg = dataclasses.replace(TINY, lora=LoRAConfig(rank=8))
    lora_roof = RooflineCosts(lora_cfg, cluster.hardware, comm)
    table = make_table(measured, tps=(1, 2))
    full, lora = ProfiledCosts(table, TINY, full_roof, comm), ProfiledCosts(table, lora_cfg, lora_roof, comm)
    for tp, b, s in [(1, 4, 16), (2, 8, 32), (4, 2, 16)]:
        assert lora.op(Part.BLOCK, Phase.FWD, tp, b, s) == full.op(Part.BLOCK, Phase.FWD, tp, b, s)
        fc, fx = full.op(Part.BLOCK, Phase.BWD, tp, b, s)
        lc, lx = lora.op(Part.BLOCK, Phase.BWD, tp, b, s)
        # measured at tp 1 and 2; tp 4 is scaled from tp 2 by the roofline, which comes to the same ratio
        ratio = lora_roof.op(Part.BLOCK, Phase.BWD, tp, b, s)[0] / full_roof.op(Part.BLOCK, Phase.BWD, tp, b, s)[0]
        assert lc == pytest.approx(fc * ratio, rel=1e-9) and lx <= fx, (tp, lc, fc, ratio)
        assert ratio < 0.97 or tp > 1  # rank 8 next to 64/tp columns: the adapters are no longer small
