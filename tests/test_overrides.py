"""``--set KEY=VALUE`` overrides and the learning-rate schedule (issue 14, item 2), without workers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from realloc.algorithms.ppo.ppo_config import PPOConfig
from realloc.cli import main
from realloc.graph.dataflow import build_graph
from realloc.overrides import load_with_overrides

TINY = "experiments/ppo_tiny.py"


def test_overrides_reach_nested_fields_the_workload_and_the_graph():
    spec = load_with_overrides(TINY, ["ppo.lr=1e-6", "ppo.n_minibatches=4", "seed=7", "batch_size=64",
                                      "ppo.lr_schedule=cosine", "dataset=/data/p.jsonl"])
    assert spec.config.ppo.lr == 1e-6 and spec.config.seed == 7 and spec.batch_size == 64
    assert spec.config.ppo.lr_schedule == "cosine" and spec.config.dataset == "/data/p.jsonl"
    assert spec.config.ppo.critic_lr == 2e-3  # untouched fields keep the file's values
    assert spec.call("actor_train").n_minibatches == 4  # rpcs are rebuilt from the new config
    plain = load_with_overrides(TINY)
    assert plain.batch_size == 32 and plain.config.ppo.lr == 2e-3


@pytest.mark.parametrize("item, message", [
    ("ppo.lrr=1", "ppo has no field 'lrr' (fields: n_minibatches, lr,"),
    ("bogus=1", "experiment TinyPPO has no field 'bogus' (fields: seed, dataset, iterations, ppo, eval; workload"),
    ("ppo.lr=fast", "--set ppo.lr: expected a number, got 'fast'"),
    ("seed=1.5", "--set seed: expected an integer, got '1.5'"),
    ("batch_size=x", "--set batch_size: expected an integer"),
    ("ppo.lr_schedule=step", "'step' is not one of constant, linear, cosine"),
    ("ppo.grad_dtype=fp16", "'fp16' is not one of fp32, bf16"),
    ("ppo=1", "--set ppo: this is a group of fields"),
    ("seed.x=1", "--set seed.x: seed is a int, not a group of fields"),
    ("ppo.warmup_proportion=1.5", "warmup_proportion must be in [0, 1)"),
    ("seed", "write KEY=VALUE"),
])
def test_bad_overrides_are_one_clear_error(item, message):
    with pytest.raises(ValueError) as e:
        load_with_overrides(TINY, [item])
    assert message in str(e.value)


def test_cli_reports_a_bad_override_in_one_line(capsys):
    assert main(["search", TINY, "--evals", "100", "--set", "ppo.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ppo has no field 'lrr'" in err


def test_grad_dtype_is_one_setting_checked_once():
    """The bf16 gradient buffers' setting: --set reaches it, a bad value in code is one error naming the field,
    and bf16 gradients for the fp32 models of a CPU cluster are refused before any worker starts."""
    assert load_with_overrides(TINY, ["ppo.grad_dtype=bf16"]).config.ppo.grad_dtype == "bf16"
    assert load_with_overrides(TINY).config.ppo.grad_dtype == "fp32"
    with pytest.raises(ValueError, match="PPOConfig.grad_dtype must be one of fp32, bf16, got 'fp16'"):
        PPOConfig(grad_dtype="fp16")


def test_cli_refuses_bf16_gradients_of_fp32_models_in_one_line(capsys):
    assert main(["search", TINY, "--evals", "100", "--set", "ppo.grad_dtype=bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "call 'actor_train': ppo.grad_dtype='bf16' needs a bf16 model" in err
    with pytest.raises(ValueError, match="devices train in fp32; set ppo.grad_dtype to fp32"):
        build_graph(load_with_overrides(TINY, ["ppo.grad_dtype=bf16"]))


def test_search_sees_the_overridden_workload(capsys):
    assert main(["search", TINY, "--evals", "200", "--threads", "1", "--set", "batch_size=64"]) == 0
    assert "workload   batch 64," in capsys.readouterr().out


def test_schedules_at_chosen_steps():
    """Hand-computed values: 10 steps, warmup 2 steps ((s+1)/2), then decay over steps 2..9 to 0.1 x lr."""
    base = 1e-3
    lin = PPOConfig(lr_schedule="linear", warmup_proportion=0.2, min_lr_ratio=0.1)
    cos = dataclasses.replace(lin, lr_schedule="cosine")
    const = dataclasses.replace(lin, lr_schedule="constant")
    low = 1e-4
    for cfg in (lin, cos, const):
        assert cfg.lr_at(base, 0, 10) == pytest.approx(5e-4)  # warmup: the first step already moves
        assert cfg.lr_at(base, 1, 10) == pytest.approx(1e-3)
        assert cfg.lr_at(base, 2, 10) == pytest.approx(1e-3)  # decay starts at lr
    # progress (s - 2) / 7
    assert lin.lr_at(base, 5, 10) == pytest.approx(low + (base - low) * (1 - 3 / 7))
    assert cos.lr_at(base, 5, 10) == pytest.approx(low + (base - low) * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert lin.lr_at(base, 9, 10) == pytest.approx(low) and cos.lr_at(base, 9, 10) == pytest.approx(low)
    assert const.lr_at(base, 9, 10) == base
    assert PPOConfig().lr_at(base, 0, 10) == base  # the default: constant, no warmup
    # Monotone non-increasing after warmup.
    for cfg in (lin, cos):
        after = [cfg.lr_at(base, s, 10) for s in range(2, 10)]
        assert all(a >= b for a, b in zip(after, after[1:]))


def test_eval_overrides_are_checked():
    spec = load_with_overrides(TINY, ["eval.every=5", "eval.greedy=false", "eval.batches=2"])
    assert (spec.config.eval.every, spec.config.eval.greedy, spec.config.eval.batches) == (5, False, 2)
    for order in (["eval.dataset=none", "eval.every=3"], ["eval.every=3", "eval.dataset=none"]):
        with pytest.raises(ValueError, match="EvalConfig.every > 0 needs EvalConfig.dataset"):
            load_with_overrides(TINY, order)  # one dataclass's keys are validated together, in any order
    assert load_with_overrides(TINY, ["eval.dataset=none"]).config.eval.dataset is None
    with pytest.raises(ValueError, match="EvalConfig.batches must be an integer >= 1"):
        load_with_overrides(TINY, ["eval.batches=0"])


OLD_N_SAMPLES = '''
import dataclasses
from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.api import auto

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Exp:
    {FIELD}: int = 8
    grpo: GRPOConfig = GRPOConfig()

    @property
    def rpcs(self):
        return critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=4, reward_impl="rule_reward",
                                reward_args={{"rule": "token_set", "tokens": [1]}})
'''


def test_samples_jsonl_count_is_log_samples_and_the_old_name_is_an_error(tmp_path, capsys):
    """``n_samples`` on the experiment (sequences to samples.jsonl) read like a GENERATE call's n_samples (responses
    per prompt): it is ``log_samples`` now, and the old name is one error pointing at both."""
    from realloc.runtime.inputs.run_config import RunConfig

    new = tmp_path / "new.py"
    new.write_text(OLD_N_SAMPLES.format(FIELD="log_samples"))
    assert RunConfig.of(load_with_overrides(str(new)), require_dataset=False).log_samples == 8
    assert RunConfig.of(load_with_overrides(str(new), ["log_samples=3"]), require_dataset=False).log_samples == 3
    old = tmp_path / "old.py"
    old.write_text(OLD_N_SAMPLES.format(FIELD="n_samples"))
    assert main(["show", str(old)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in ("experiment 'Exp': field n_samples", "write log_samples", "GENERATE call's n_samples"):
        assert w in err, (w, err)
    with pytest.raises(ValueError, match="samples.jsonl's count is log_samples, and responses per prompt are the "
                                         "GENERATE call's n_samples"):
        load_with_overrides(TINY, ["n_samples=2"])
