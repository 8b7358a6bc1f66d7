"""Errors in the user's own code name the user's file and line, also in a module the experiment imports; keys
get "did you mean", and a key written and never read is flagged by `realloc show`."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from realloc import cli, user_code
from realloc.algorithms.context import CallContext
from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.rewards import reward_fns
from realloc.api import INFERENCE, ModelFunctionCallDef, load_experiment
from realloc.graph.dataflow import build_graph
from spec_helpers import inline_spec

EXPERIMENT = '''
import dataclasses

from rpp_algo import INTERFACES, calls

from realloc.api import auto


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=8)
@dataclasses.dataclass
class Mine:
    @property
    def interfaces(self):
        return INTERFACES

    @property
    def rpcs(self):
        return calls()
'''

MODULE = '''
from realloc.algorithms.critic_free.grpo import critic_free_rpcs
from realloc.algorithms.registry import Interface
from realloc.api import INFERENCE


def score(ctx, inputs):
    return inputs["seq"]["missing"]


INTERFACES = [Interface("mine", INFERENCE, score, inputs=("seq",), outputs=("rewards",), head="none")]


def calls():
    return critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=2, reward_impl="mine",
                            reward_args={BAD_ARGS})
'''


def _write(tmp_path: Path, module: str) -> Path:
    sys.modules.pop("rpp_algo", None)  # a fresh import of the module each time, as in a new process
    (tmp_path / "rpp_algo.py").write_text(module)
    exp = tmp_path / "mine.py"
    exp.write_text(EXPERIMENT)
    return exp


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if text in line)


def test_an_import_error_in_an_imported_module_names_that_module_and_line(tmp_path):
    exp = _write(tmp_path, MODULE.replace("{BAD_ARGS}", "{}").replace(
        'INTERFACES = [Interface("mine"', 'INTERFACES = [Interface("my reward"'))
    with pytest.raises(ValueError) as e:
        load_experiment(str(exp))
    msg = str(e.value)
    # the experiment's import line, and the module's own line, not realloc's interface.py that raised
    assert f"{exp}, line {_line(exp, 'from rpp_algo import')}" in msg
    assert f"in {tmp_path / 'rpp_algo.py'}, line {_line(tmp_path / 'rpp_algo.py', 'INTERFACES =')}" in msg
    assert "interface.py" not in msg and "must be an identifier" in msg


def test_an_error_in_an_imported_module_at_show_names_the_users_line(tmp_path, capsys):
    # calls() (in the module) hands realloc a bad argument: the error comes from realloc, the line is the user's
    exp = _write(tmp_path, MODULE.replace("{BAD_ARGS}", "{}").replace(
        "    return critic_free_rpcs(", '    extra = Interface("x", INFERENCE, score, head="neither")\n'
                                      '    return critic_free_rpcs('))
    assert cli.main(["show", str(exp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    mod = tmp_path / "rpp_algo.py"
    assert "head must be one of" in err[0] and f"in {mod}, line {_line(mod, 'extra = Interface')}" in err[0], err[0]
    # a plain bug of the user's (not a ValueError) is the user's error too, not "internal error"
    exp = _write(tmp_path, MODULE.replace("return critic_free_rpcs(", "return undefined_name + critic_free_rpcs(")
                 .replace("{BAD_ARGS}", "{}"))
    assert cli.main(["show", str(exp)]) == 2
    err = capsys.readouterr().err.strip()
    assert "internal error" not in err and "NameError" in err and f"in {mod}, line" in err, err


def test_an_error_inside_a_users_reward_function_names_its_line_not_realloc(tmp_path):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(textwrap.dedent('''
        def score(prompts, responses, records):
            return [rec["answer"] for rec in records]   # KeyError: the records have no answer
    '''))
    spec = importlib.util.spec_from_file_location("my_rewards_t", mod)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    call = ModelFunctionCallDef(name="rew_inf", model_name="reward", model_type="rule", interface_type=INFERENCE,
                                interface_impl="batch_reward", input_data=["seq"], output_data=["rewards"],
                                interface_args={"fn": m.score})
    ctx = CallContext(call=call, model=None, optimizer=None, config=None, prompt_len=2, gen_len=2, seed=0,
                      iteration=0, ids=range(1), batch_size=1, n_mbs=1, records=lambda row: {"question": "q"})
    seq = {"tokens": torch.tensor([[5, 6, 7, 8]]), "prompt_lens": torch.tensor([2]),
           "gen_mask": torch.tensor([[True, True]]), "rows": torch.tensor([0])}
    with pytest.raises(KeyError) as e:
        reward_fns.batch_scores(ctx, {"seq": seq})
    # what a worker appends to the error it reports (worker.py)
    assert user_code.where(e.value) == f" (in {mod}, line 3: return [rec[\"answer\"] for rec in records]   " \
                                       f"# KeyError: the records have no answer)"
    assert not user_code.is_user_file(reward_fns.__file__) and not user_code.is_user_file(torch.__file__)


def test_a_misspelled_key_gets_did_you_mean():
    rpcs = critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=2, reward_impl="rule_reward",
                            reward_args={"rule": "token_set", "tokens": [1]})
    bad = [dataclasses.replace(r, input_data=["seq", "logp", "ref_logp", "reward"]) if r.is_train else r
           for r in rpcs]
    with pytest.raises(ValueError, match="call 'actor_train' reads key 'reward'.*did you mean 'rewards'"):
        build_graph(inline_spec(bad))


def test_keys_written_and_never_read_are_flagged():
    rpcs = critic_free_rpcs("grpo", actor="tiny", reward="rule", n_samples=2, reward_impl="rule_reward",
                            reward_args={"rule": "token_set", "tokens": [1]})
    assert build_graph(inline_spec(rpcs)).warnings() == ()
    # ReMax's greedy generation must declare log-probs nobody reads: not the user's mistake, no warning
    remax = critic_free_rpcs("remax", actor="tiny", reward="rule", reward_impl="rule_reward",
                             reward_args={"rule": "token_set", "tokens": [1]})
    g = build_graph(inline_spec(remax))
    assert ("greedy_logp", "actor_greedy") in g.unread_keys and g.warnings() == ()
    # a second reward call whose output name is one letter off the key the train step reads
    extra = ModelFunctionCallDef(name="rew2", model_name="reward", interface_type=INFERENCE,
                                 interface_impl="rule_reward", input_data=["seq"], output_data=["reward"],
                                 interface_args={"rule": "token_set", "tokens": [2]})
    w = build_graph(inline_spec(rpcs + [extra])).warnings()
    assert len(w) == 1 and "call 'rew2' writes key 'reward', which no call reads; did you mean 'rewards'" in w[0]
    # a call none of whose outputs is read: its work is dropped
    extra = dataclasses.replace(extra, output_data=["side_scores"])
    w = build_graph(inline_spec(rpcs + [extra])).warnings()
    assert len(w) == 1 and "'side_scores', which no call reads, so its work is dropped" in w[0]


def test_a_run_whose_reward_function_raises_names_the_users_line(tmp_path):
    """In real workers: the reward function (in the experiment file) raises on dp rank 1; the run's one error line
    names the worker, the call and the user's file and line."""
    from test_algorithms_e2e import _failing_run

    err, _ = _failing_run(tmp_path, 'raise KeyError("answer")')
    exp = tmp_path / "own_reward.py"
    line = _line(exp, 'raise KeyError("answer")')
    assert err[0].startswith("realloc run: error: worker 1 failed in call rew_inf (iteration 1): KeyError: 'answer'"), err
    assert f"(in {exp}, line {line}: raise KeyError(\"answer\"))" in err[0], err
