"""The interface registry: every call is checked against its interface's contract at `realloc show`, one line
per mistake; an experiment can declare its own interfaces; a function that breaks its declaration is caught."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from realloc.algorithms.context import CallResult, reward_sums
from realloc.algorithms.critic_free.grpo import GRPOConfig, critic_free_rpcs
from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.algorithms.registry import Interface, builtin_interfaces
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP
from realloc.graph.dataflow import build_graph
from spec_helpers import inline_spec

REPO = Path(__file__).resolve().parents[1]


def _graph(rpcs, interfaces=(), **fields):
    return build_graph(inline_spec(rpcs, interfaces, attrs=fields))


def _replace(rpcs, name, **kw):
    return [dataclasses.replace(r, **kw) if r.name == name else r for r in rpcs]


PPO = ppo_rpcs("tiny", "tiny-critic", n_minibatches=2)
REMAX = critic_free_rpcs("remax", actor="tiny", reward="tiny-critic")


def test_shipped_interfaces_are_all_declared_and_resolvable():
    table = builtin_interfaces()
    names = {n for n, _ in table}
    assert {"ppo_actor", "ppo_critic", "reward", "rule_reward", "verifiable_reward", "grpo_actor", "rloo_actor",
            "remax_actor", "remax_greedy", "dpo_ref", "dpo_actor", "sft"} <= names
    for i in table.values():
        assert callable(i.resolve()), i.name


@pytest.mark.parametrize("change, words", [
    # A critic-free graph calling PPO's train step: its slot 'values' has no key.
    (lambda r: _replace(r, "actor_train", input_data=["seq", "logp", "ref_logp", "rewards"]),
     ["call 'actor_train'", "no key for slot 'values'", "ppo_actor"]),
    # Keys in the wrong order: 'values' read where the rewards go.
    (lambda r: _replace(r, "actor_train", input_data=["seq", "logp", "ref_logp", "values", "rewards"]),
     ["call 'actor_train' reads key 'values' as its slot 'rewards'", "critic_inf"]),
    # A generation that does not list the log-probs it writes (nobody reads them, but they are declared).
    (lambda r: _replace(REMAX, "actor_greedy", output_data=["greedy_seq"]),
     ["call 'actor_greedy'", "output_data has no key for slot 'logp'"]),
    (lambda r: _replace(r, "actor_train", interface_impl="ppo_actr"), ["unknown interface_impl 'ppo_actr'"]),
    (lambda r: _replace(r, "critic_inf", interface_impl="ppo_actor"),
     ["call 'critic_inf'", "needs a vocabulary", "scalar"]),
    (lambda r: _replace(r, "ref_inf", input_data=["sq"]), ["call 'ref_inf' reads key 'sq'", "no call produces"]),
])
def test_contract_violations_name_the_call_and_slot(change, words):
    with pytest.raises(ValueError) as e:
        _graph(change(PPO))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_settings_of_the_wrong_type_and_group_rules():
    grpo = critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=4, reward_impl="rule_reward",
                            reward_args={"rule": "token_set", "tokens": [1]})
    g = _graph(grpo)
    assert g.spec.group_size == 4 and g.spec.n_seqs(g.call("actor_train")) == 32
    assert g.dp_error(2) is None and "whole groups" in g.dp_error(16)
    with pytest.raises(ValueError, match="field 'grpo' must be a GRPOConfig"):
        _graph(grpo, grpo=PPOConfig())
    with pytest.raises(ValueError, match="n_samples .* applies only to GENERATE"):
        _replace(grpo, "ref_inf", n_samples=2)


def test_experiment_interfaces_join_the_table_and_cannot_shadow_shipped_ones():
    def length_reward(ctx, inputs):
        score = inputs["seq"]["gen_mask"].sum(dim=1).float()
        return CallResult({"rewards": {"score": score}}, {}, {})

    mine = Interface("length_reward", INFERENCE, length_reward, inputs=("seq",), outputs=("rewards",), head="none")
    rpcs = _replace(PPO, "rew_inf", model_type="rule", interface_impl="length_reward")
    g = _graph(rpcs, [mine])
    assert g.interfaces["rew_inf"] is mine and g.interfaces["actor_gen"].name == "ppo_actor"
    clash = dataclasses.replace(mine, name="reward")
    with pytest.raises(ValueError, match="'reward' INFERENCE is already shipped"):
        _graph(PPO, [clash])
    with pytest.raises(ValueError, match="TRAIN_STEP interface needs settings"):
        Interface("t", TRAIN_STEP, length_reward, inputs=("seq",))
    with pytest.raises(ValueError, match="head must be one of"):
        Interface("t", GENERATE, length_reward, head="critic")


def test_a_function_that_breaks_its_declaration_is_caught():
    keys = {"seq": "seq", "logp": "gen_logp"}
    ok = CallResult({"seq": {}, "logp": {}}, {}, {})
    ok.check("gen", "ppo_actor", keys, rank=1, early_stage=False)
    CallResult({}, {}, {}).check("gen", "ppo_actor", keys, rank=0, early_stage=True)  # a pipeline stage before the last
    CallResult({}, {}, {}).check("train", "grpo_actor", {}, rank=0, early_stage=False)  # declares no outputs
    with pytest.raises(ValueError, match="declared outputs \\['seq', 'logp'\\] but produced \\['seq'\\] on rank 3"):
        CallResult({"seq": {}}, {}, {}).check("gen", "ppo_actor", keys, rank=3, early_stage=False)
    # A data-parallel rank (or the last stage) that returns nothing: one error naming the call, rank and key, not a
    # store error later in whichever call reads the key.
    with pytest.raises(ValueError) as e:
        CallResult({}, {}, {}).check("gen", "ppo_actor", {"logp": "gen_logp"}, rank=1, early_stage=False)
    assert str(e.value).startswith("call 'gen': interface 'ppo_actor' returned no outputs on rank 1, so key "
                                   "'gen_logp' (slot 'logp') has no rows from it"), str(e.value)


def test_show_reports_a_contract_error_in_one_line(tmp_path):
    exp = tmp_path / "grpo_bad.py"
    exp.write_text(textwrap.dedent('''
        import dataclasses
        from realloc.algorithms.ppo.ppo_config import PPOConfig
        from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef, auto

        @auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
        @dataclasses.dataclass
        class CriticFreePPO:
            @property
            def rpcs(self):
                return [
                    ModelFunctionCallDef(name="gen", model_name="actor", model_type="tiny", interface_type=GENERATE,
                                         input_data=["prompts"], output_data=["seq", "logp"]),
                    ModelFunctionCallDef(name="ref", model_name="ref", model_type="tiny", interface_type=INFERENCE,
                                         input_data=["seq"], output_data=["ref_logp"]),
                    ModelFunctionCallDef(name="rew", model_name="rw", model_type="rule", interface_type=INFERENCE,
                                         interface_impl="rule_reward", input_data=["seq"], output_data=["rewards"],
                                         interface_args={"rule": "token_set", "tokens": [1]}),
                    ModelFunctionCallDef(name="train", model_name="actor", interface_type=TRAIN_STEP,
                                         input_data=["seq", "logp", "ref_logp", "rewards"]),
                ]
    '''))
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "show", str(exp)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "call 'train'" in err and "'values'" in err, err
    assert torch is not None


def test_the_readme_example_of_an_own_interface_validates_and_scores_by_hand(tmp_path):
    from realloc.api import load_experiment

    text = (REPO / "docs/algorithms.md").read_text()
    start = text.index("```python\n", text.index("## Your own interface")) + len("```python\n")
    exp = tmp_path / "no_repeats.py"
    exp.write_text(text[start:text.index("```", start)].replace("data/ppo_tiny_prompts.jsonl",
                                                                str(REPO / "experiments/data/ppo_tiny_prompts.jsonl")))
    g = build_graph(load_experiment(str(exp)))
    variety = g.interfaces["rew_inf"]
    assert (variety.name, variety.head, g.interfaces["actor_train"].name) == ("variety", "none", "grpo_actor")
    seq = {"tokens": torch.tensor([[1, 2, 5, 5, 7, 0], [3, 4, 4, 4, 0, 0]]), "prompt_lens": torch.tensor([2, 1]),
           "gen_mask": torch.tensor([[True, True, True, False], [True, True, True, False]])}
    out = variety.resolve()(None, {"seq": seq})  # responses [5, 5, 7] and [4, 4, 4]: 2 and 1 distinct of 3
    torch.testing.assert_close(out.outputs["rewards"]["score"], torch.tensor([2 / 3, 1 / 3]))
    assert out.sums == {}  # the function reports nothing; the framework makes the reward stats from its scores
    assert reward_sums("rew_inf", "variety", out, ["rewards"], 2) == {"score_sum": pytest.approx(1.0),
                                                                      "n_seqs_scored": 2.0}


RULE = dict(reward="rule", reward_impl="rule_reward", reward_args={"rule": "token_set", "tokens": [1]})


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_group_baseline_needs_two_responses_per_prompt(algo):
    """One response per prompt: RLOO's leave-one-out baseline is undefined (it crashed in the workers) and GRPO's
    advantage is 0 (it trained on nothing); both are one line at validation naming the call and n_samples."""
    with pytest.raises(ValueError) as e:
        _graph(critic_free_rpcs(algo, actor="tiny", n_samples=1, **RULE))
    msg = str(e.value)
    for w in ("call 'actor_train'", f"'{algo}_actor' TRAIN_STEP", "at least 2 responses per prompt",
              "'actor_gen' samples n_samples=1", "set n_samples to 2 or more on 'actor_gen'"):
        assert w in msg, (w, msg)
    assert _graph(critic_free_rpcs(algo, actor="tiny", n_samples=2, **RULE)).spec.group_size == 2
    # ReMax compares with a greedy response, not the group: one sample per prompt is its design.
    assert _graph(critic_free_rpcs("remax", actor="tiny", **RULE)).spec.group_size == 1
    with pytest.raises(ValueError, match="min_group_size must be a positive integer"):
        Interface("x", INFERENCE, "m:f", min_group_size=0)


def test_a_train_step_needs_a_model_with_parameters():
    def nothing(ctx, inputs):
        return CallResult({}, {}, {})

    with pytest.raises(ValueError, match="Interface 't': a TRAIN_STEP interface trains a model's parameters, so head "
                                         "must be 'lm' or 'value', not 'none'"):
        Interface("t", TRAIN_STEP, nothing, inputs=("seq",), head="none", config="grpo", config_type=GRPOConfig)
    own = Interface("t", TRAIN_STEP, nothing, inputs=("seq",), config="grpo", config_type=GRPOConfig)
    rpcs = _replace(critic_free_rpcs("grpo", actor="tiny", n_samples=2, **RULE), "actor_train", model_name="reward",
                    interface_impl="t", input_data=["seq"])
    with pytest.raises(ValueError, match="call 'actor_train': model 'reward' is a parameter-free rule"):
        _graph(rpcs, [own])


def test_a_settings_field_that_no_call_reads_is_an_error():
    grpo = critic_free_rpcs("grpo", actor="tiny", n_samples=4, **RULE)
    with pytest.raises(ValueError) as e:
        _graph(grpo, gpro=GRPOConfig(lr=1e-3))  # misspelled: it used to run on GRPOConfig's defaults
    assert str(e.value) == ("experiment Exp: field 'gpro' holds a GRPOConfig, but no call's interface reads it (they "
                            "read: grpo), so it would change nothing; did you mean 'grpo'? rename or remove it")
    with pytest.raises(ValueError, match="field 'ppo' holds a PPOConfig, but no call's interface reads it"):
        _graph(grpo, grpo=GRPOConfig(), ppo=PPOConfig())
    # Settings that are read, and fields of other kinds, are fine.
    from realloc.runtime.inputs.evaluation import EvalConfig

    assert _graph(grpo, grpo=GRPOConfig(lr=1e-3), eval=EvalConfig()).interfaces["actor_train"].config == "grpo"


def test_n_minibatches_comes_from_the_settings_and_a_conflicting_call_is_an_error():
    grpo = critic_free_rpcs("grpo", actor="tiny", n_samples=4, **RULE)  # the call leaves it out
    g = _graph(grpo, grpo=GRPOConfig(n_minibatches=4))
    assert g.call("actor_train").n_minibatches == 4 and g.steps_n_seqs("actor_train") == 8  # 32 sequences / 4
    assert _graph(grpo).call("actor_train").n_minibatches == 1  # GRPOConfig's default
    assert _graph(ppo_rpcs("tiny", "tiny-critic")).call("critic_train").n_minibatches == 8  # PPOConfig's default
    # Without the settings field the call's own number stands; with it, the two must agree.
    two = _replace(grpo, "actor_train", n_minibatches=2)
    assert _graph(two).call("actor_train").n_minibatches == 2
    assert _graph(two, grpo=GRPOConfig(n_minibatches=2)).call("actor_train").n_minibatches == 2
    with pytest.raises(ValueError) as e:
        _graph(two, grpo=GRPOConfig(n_minibatches=4))
    for w in ("call 'actor_train': n_minibatches=2", "grpo.n_minibatches is 4", "GRPOConfig(n_minibatches=...)",
              "--set grpo.n_minibatches=N"):
        assert w in str(e.value), (w, str(e.value))


def test_a_settings_override_sets_the_train_calls_optimizer_steps():
    from realloc.overrides import load_with_overrides

    spec = load_with_overrides(str(REPO / "experiments/grpo_tiny.py"), ["grpo.n_minibatches=4"])
    assert spec.config.grpo.n_minibatches == 4 and spec.call("actor_train").n_minibatches == 4
    assert build_graph(spec).steps_n_seqs("actor_train") == 8
