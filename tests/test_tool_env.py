"""The built-in tool-calling environment (realloc/envs/tool_env.py) and the multi-turn call's arguments,
without a model: the documented format in, observations and rewards out."""

from __future__ import annotations

import pytest

from realloc.envs.base import check_step, env_factory
from realloc.envs.rollout_args import rollout_args
from realloc.envs.tool_env import ToolEnv


def _env(**kw) -> ToolEnv:
    env = ToolEnv(**{"tools": ["calculator", "python"], "limits": {"wall_s": 20.0, "cpu_s": 5}, **kw})
    assert env.reset({"answer": "5535", "other": 1}) == ""
    return env


def test_a_tool_call_runs_the_tool_and_its_answer_is_the_next_observation():
    env = _env()
    assert env.step("let me see <calculator>123*45</calculator> and ignore <python>print(1)</python>") == \
        ("<result>5535</result>", 0.0, False)
    assert env.step("<python>print(7 * 8)</python>") == ("<result>56</result>", 0.0, False)
    assert env.tool_counts["ok"] == 2


def test_a_failing_tool_is_an_error_observation_and_counted():
    env = _env(result_format="[{}]", call_reward=-0.1)
    obs, reward, done = env.step("<calculator>import os</calculator>")
    assert obs.startswith("[error: ValueError: not an arithmetic expression") and (reward, done) == (-0.1, False)
    obs, _, _ = env.step("<python>while True: pass</python>")
    assert obs.startswith("[error: the tool ran past its") and env.tool_counts["error"] == 1
    assert env.tool_counts["cpu"] + env.tool_counts["timeout"] == 1


def test_a_turn_without_a_call_is_the_final_answer():
    env = _env()
    assert env.step("the answer is 5535") == (None, 1.0, True)
    assert _env().step("5534") == (None, 0.0, True)
    assert _env().step("<unknown>x</unknown> 5535") == (None, 1.0, True)  # not a tool of this environment
    custom = ToolEnv(rule=lambda prompt, response, answer: float(answer in response))
    custom.reset({"answer": "x"})
    assert custom.step("a x b") == (None, 1.0, True)


def test_bad_environment_settings_and_answers_are_one_clear_error():
    with pytest.raises(ValueError, match="tool 'sum' must be a built-in name"):
        ToolEnv(tools={"sum": lambda t: t})
    with pytest.raises(ValueError, match="result_format must contain"):
        ToolEnv(result_format="<r>")
    with pytest.raises(ValueError, match=r"no field 'answer' \(it has q\); set env_args\['field'\]"):
        ToolEnv().reset({"q": 1})
    with pytest.raises(ValueError, match=r"env: step\(\) must return \(observation or None, reward, done\)"):
        check_step("env", ("obs", 1.0))
    with pytest.raises(ValueError, match="reward must be finite"):
        check_step("env", ("obs", float("nan"), False))
    with pytest.raises(ValueError, match="cannot load interface_args\\['env'\\] 'no_such_module:f'"):
        env_factory("call 'g'", "no_such_module:f")
    assert env_factory("call 'g'", "tools") is ToolEnv


@pytest.mark.parametrize("args, match", [
    ({}, r"interface_args\['env'\] must be 'tools' or an environment factory"),
    ({"env": "tools", "max_turn": 3}, "unknown interface_args 'max_turn'"),
    ({"env": "tools", "max_turns": 0}, r"interface_args\['max_turns'\] must be a positive integer"),
    ({"env": "tools", "env_args": [1]}, r"interface_args\['env_args'\] must be a dict"),
])
def test_bad_rollout_arguments_name_the_call_and_key(args, match):
    with pytest.raises(ValueError, match=f"call 'actor_gen': {match}"):
        rollout_args("actor_gen", args)
    assert rollout_args("g", {"env": "tools", "turn_tokens": 8}).max_turns == 4
