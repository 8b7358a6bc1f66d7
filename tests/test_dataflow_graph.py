"""Dataflow graph construction, unrolling and validation errors (issue 2, item 5)."""

import networkx as nx
import pytest

from realloc.algorithms.ppo.ppo_config import PPOConfig, ppo_rpcs
from realloc.algorithms.registry import Interface
from realloc.api import GENERATE, INFERENCE, TRAIN_STEP, ModelFunctionCallDef
from realloc.graph.dataflow import DATA, PARAM, build_graph
from spec_helpers import inline_spec


def make_spec(rpcs, batch_size=16, dataset_keys=("prompts",), interfaces=()):
    return inline_spec(rpcs, interfaces, batch_size=batch_size, dataset_keys=dataset_keys)


def _noop(ctx, inputs):
    raise AssertionError("graph tests never run interfaces")


# Interfaces of whatever shape a structural test needs (declared by the experiment, as users do).
SCORE_PROMPTS = Interface("score_prompts", INFERENCE, _noop, inputs=("prompts",), outputs=("logp",))
TRAIN_ON_SEQ = Interface("train_on_seq", TRAIN_STEP, _noop, inputs=("seq",), config="ppo", config_type=PPOConfig)


def call(name, model, itype, inputs=(), outputs=(), model_type=None, **kw):
    return ModelFunctionCallDef(name=name, model_name=model, model_type=model_type, interface_type=itype,
                                input_data=list(inputs), output_data=list(outputs), **kw)


def ppo_graph(n_minibatches=2):
    return build_graph(make_spec(ppo_rpcs("tiny", "tiny-critic", n_minibatches=n_minibatches)))


def test_ppo_edges_data_and_parameter_version():
    g = ppo_graph()
    data = {(u, v) for u, v, k in g.graph.edges(data="kind") if k == DATA}
    param = {(u, v) for u, v, k in g.graph.edges(data="kind") if k == PARAM}
    for reader in ("rew_inf", "ref_inf", "critic_inf"):
        assert ("actor_gen", reader) in data
        assert g.graph.edges["actor_gen", reader]["keys"] == ("seq",)
    assert g.graph.edges["actor_gen", "actor_train"]["keys"] == ("seq", "logp")
    # critic_inf reads the critic version that critic_train replaces: it is also a data edge here
    assert ("critic_inf", "critic_train") in data and not param
    assert set(g.carry_edges) == {("actor_train", "actor_gen"), ("actor_train", "actor_train"),
                                  ("critic_train", "critic_inf"), ("critic_train", "critic_train")}
    assert g.topo_order[0] == "actor_gen" and set(g.topo_order[-2:]) == {"actor_train", "critic_train"}
    assert g.model_types == {"actor": "tiny", "reward": "tiny-critic", "ref": "tiny", "critic": "tiny-critic"}


def test_parameter_version_edge_without_data_dependency():
    g = build_graph(make_spec([
        call("gen", "actor", GENERATE, ["prompts"], ["seq", "logp"], model_type="tiny"),
        call("score", "actor", INFERENCE, ["prompts"], ["logp2"], interface_impl="score_prompts"),
        call("train", "actor", TRAIN_STEP, ["seq"], interface_impl="train_on_seq"),
    ], interfaces=[SCORE_PROMPTS, TRAIN_ON_SEQ]))
    assert g.graph.edges["score", "train"]["kind"] == PARAM  # train waits for readers of the old version
    assert set(g.carry_edges) == {("train", "gen"), ("train", "score"), ("train", "train")}


def test_unroll_three_iterations_figure_4():
    g = ppo_graph()
    u = g.unroll(3)
    assert u.number_of_nodes() == 18
    assert u.number_of_edges() == 3 * g.graph.number_of_edges() + 2 * len(g.carry_edges)
    assert u.has_edge(("actor_train", 0), ("actor_gen", 1))
    assert u.has_edge(("critic_train", 1), ("critic_inf", 2))
    assert not u.has_edge(("actor_train", 0), ("actor_gen", 2))
    assert nx.is_directed_acyclic_graph(u)
    # ref and reward inference of iteration 1 only wait for actor_gen of iteration 1 (cross-iteration overlap)
    assert set(u.predecessors(("ref_inf", 1))) == {("actor_gen", 1)}
    with pytest.raises(ValueError, match="n_iterations"):
        g.unroll(0)


def test_digest_is_stable_and_sensitive():
    assert ppo_graph().digest == ppo_graph().digest
    assert ppo_graph(2).digest != ppo_graph(4).digest


def test_digest_names_the_interface_each_call_runs():
    """GRPO and RLOO graphs have the same shape: a plan (or a checkpoint) of one must not pass for the other."""
    import dataclasses

    from realloc.algorithms.critic_free.grpo import critic_free_rpcs
    from realloc.graph.plan import ExecutionPlan, validate_plan

    rule = dict(actor="tiny", reward="rule", n_samples=4, reward_impl="rule_reward",
                reward_args={"rule": "token_set", "tokens": [1]})
    grpo, rloo = (build_graph(make_spec(critic_free_rpcs(a, **rule))) for a in ("grpo", "rloo"))
    assert grpo.digest != rloo.digest
    plan = ExecutionPlan.by_hand(grpo, {c: ("localhost", 2, 1, 1, 1) for c in grpo.spec.call_names})
    validate_plan(plan, grpo)
    with pytest.raises(ValueError, match="plan was made for a different version of experiment"):
        validate_plan(plan, rloo)
    # What a call runs, as resolved: leaving out interface_impl is the same graph as naming PPO's default.
    implicit = [dataclasses.replace(r, interface_impl=None) if r.interface_impl in ("ppo_actor", "ppo_critic") else r
                for r in ppo_rpcs("tiny", "tiny-critic", n_minibatches=2)]
    assert build_graph(make_spec(implicit)).digest == ppo_graph().digest


# -- every validation error names the call and key ---------------------------------------------

def test_cycle_is_rejected_with_path():
    rpcs = [call("a", "m1", INFERENCE, ["y"], ["x"], model_type="tiny"),
            call("b", "m2", INFERENCE, ["x"], ["y"], model_type="tiny")]
    with pytest.raises(ValueError, match=r"cycle: (a -> b -> a|b -> a -> b).*via (x|y)"):
        build_graph(make_spec(rpcs))


def test_cycle_through_parameter_version():
    # 'gen' reads the new version produced by 'train', but 'train' must wait for readers of the old one
    rpcs = [call("train", "actor", TRAIN_STEP, ["prompts"], ["stats"], model_type="tiny"),
            call("gen", "actor", GENERATE, ["stats"], ["seq"])]
    with pytest.raises(ValueError, match="cycle.*parameter version"):
        build_graph(make_spec(rpcs))


def test_missing_input_names_call_and_key():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq"], model_type="tiny"),
            call("train", "actor", TRAIN_STEP, ["seq", "rewards"])]
    with pytest.raises(ValueError, match="call 'train' reads key 'rewards', which no call produces and the dataset "
                                         "does not supply"):
        build_graph(make_spec(rpcs))


def test_two_producers_of_one_key():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq", "logp"], model_type="tiny"),
            call("ref", "ref", INFERENCE, ["seq"], ["logp"], model_type="tiny")]
    with pytest.raises(ValueError, match="key 'logp' is produced by both call 'gen' and call 'ref'"):
        build_graph(make_spec(rpcs))


def test_output_shadowing_a_dataset_key():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["prompts"], model_type="tiny")]
    with pytest.raises(ValueError, match="call 'gen' produces key 'prompts', which the dataset already supplies"):
        build_graph(make_spec(rpcs))


def test_one_model_name_two_types():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq"], model_type="tiny"),
            call("train", "actor", TRAIN_STEP, ["seq"], model_type="small")]
    with pytest.raises(ValueError, match="model 'actor' is declared as 'tiny' in call 'gen' and as 'small' in call "
                                         "'train'"):
        build_graph(make_spec(rpcs))


def test_model_without_any_type():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq"])]
    with pytest.raises(ValueError, match="call 'gen': model 'actor' has no model_type"):
        build_graph(make_spec(rpcs))


def test_unknown_model_type():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq"], model_type="gpt5")]
    with pytest.raises(ValueError, match="call 'gen': unknown model_type 'gpt5'"):
        build_graph(make_spec(rpcs))


def test_unknown_interface_type():
    with pytest.raises(ValueError, match="call 'gen': unknown interface_type 'sample'.*GENERATE"):
        call("gen", "actor", "sample", ["prompts"], ["seq"], model_type="tiny")


def test_unknown_interface_impl_and_mismatch():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq"], model_type="tiny", interface_impl="dpo")]
    with pytest.raises(ValueError, match="call 'gen': unknown interface_impl 'dpo'"):
        build_graph(make_spec(rpcs))
    rpcs = [call("gen", "critic", GENERATE, ["prompts"], ["seq"], model_type="tiny", interface_impl="ppo_critic")]
    with pytest.raises(ValueError, match="call 'gen': interface_impl 'ppo_critic' does not implement GENERATE"):
        build_graph(make_spec(rpcs))


def test_rule_model_only_infers():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq", "logp"], model_type="tiny"),
            call("score", "fn", TRAIN_STEP, ["seq"], model_type="rule", interface_impl="rule_reward")]
    with pytest.raises(ValueError, match="call 'score': interface_impl 'rule_reward' does not implement TRAIN_STEP"):
        build_graph(make_spec(rpcs))
    rpcs[1] = call("score", "fn", TRAIN_STEP, ["seq"], model_type="rule", interface_impl="train_on_seq")
    with pytest.raises(ValueError, match="call 'score': model 'fn' is a parameter-free rule .* which a TRAIN_STEP "
                                         "cannot train"):
        build_graph(make_spec(rpcs, interfaces=[TRAIN_ON_SEQ]))
    rpcs[1] = call("score", "fn", INFERENCE, ["seq"], ["r"], model_type="rule")
    with pytest.raises(ValueError, match="call 'score'.*needs interface_impl"):
        build_graph(make_spec(rpcs))


def test_batch_not_splittable_into_minibatches():
    rpcs = [call("gen", "actor", GENERATE, ["prompts"], ["seq"], model_type="tiny"),
            call("train", "actor", TRAIN_STEP, ["seq"], n_minibatches=3)]
    with pytest.raises(ValueError, match="call 'train': its batch of 16 sequences cannot be split into "
                                         "n_minibatches=3"):
        build_graph(make_spec(rpcs))


def test_minibatches_only_for_training():
    with pytest.raises(ValueError, match="call 'gen': n_minibatches applies only to TRAIN_STEP"):
        call("gen", "actor", GENERATE, ["prompts"], ["seq"], model_type="tiny", n_minibatches=2)


@pytest.mark.parametrize("kw,msg", [
    (dict(name="actor gen"), "must be an identifier"),
    (dict(input_data="prompts"), "must be a list of keys"),
    (dict(output_data=["a", "a"]), "lists a key twice"),
    (dict(n_seqs=0), "n_seqs must be a positive integer"),
    (dict(model_name=""), "model_name must be a non-empty string"),
])
def test_call_def_field_errors(kw, msg):
    base = dict(name="gen", model_name="actor", interface_type=GENERATE, model_type="tiny", input_data=["prompts"])
    base.update(kw)
    with pytest.raises(ValueError, match=msg):
        ModelFunctionCallDef(**base)
