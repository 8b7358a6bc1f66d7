"""Audit, eleventh round (audit7): the HF families Qwen3 and Mistral, chat tool-call formats and declared tools, as a
new user meets them. Each test failed before its fix, except those marked as checking what held."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from run_helpers import hash_seeded_cli
from test_audit_round9 import _files
from test_families_e2e import WINDOW
from test_runtime_hf_e2e import _plan, write_experiment

REPO = Path(__file__).resolve().parents[1]


# -- a Qwen3 PPO run resumed mid-run (checks what held) -----------------------------------------------------------
def _run(experiment: Path, plan: Path, name: str, extra: tuple[str, ...], hash_seeds: tuple[int, ...]) -> Path:
    run_dir = experiment.parent / name
    cmd = [*hash_seeded_cli(hash_seeds), "run", str(experiment), "--plan", str(plan), "--iterations", "3",
           "--run-dir", str(run_dir), "--quiet", *extra]
    env = {**os.environ, "TMPDIR": str(experiment.parent), "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"
    return run_dir


def test_a_qwen3_ppo_run_resumed_mid_run_is_the_straight_run_whole_checkpoint(hf_assets, tmp_path):
    # Qwen3 actor and reference (tied, per-head q/k norms), a windowed Mistral critic, a Qwen3 reward model, at tp 2 /
    # pp 2 with reallocations between the layouts: the checkpoint after iteration 3 of a run resumed from iteration 2
    # is the straight run's, Adam's moments, the head norms' shards and the RNG states included.
    shutil.copytree(hf_assets.checkpoint("qwen2", arch="qwen3", tie=True), tmp_path / "actor")
    shutil.copytree(hf_assets.checkpoint("llama_reward", arch="mistral"), tmp_path / "critic")
    config = json.loads((tmp_path / "critic/config.json").read_text())
    (tmp_path / "critic/config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    shutil.copytree(hf_assets.checkpoint("qwen2_reward", arch="qwen3"), tmp_path / "reward")
    experiment = write_experiment(tmp_path)
    plan = _plan(experiment, "tp2pp2")
    straight = _run(experiment, plan, "straight", ("--save-every", "1", "--keep-checkpoints", "0"), (1, 2, 3, 4, 5, 6, 7, 8))
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints/iter_00000003")
    _run(experiment, plan, "resumed", ("--resume", str(resumed / "checkpoints/iter_00000002")), (11, 12, 13, 14, 15, 16, 17, 18))
    want, got = (_files(run / "checkpoints/iter_00000003") for run in (straight, resumed))
    assert sorted(got) == sorted(want) and any("exp_avg_sq" in k for k in want)
    assert any("q_norm" in k for k in want) and any("k_norm" in k and "exp_avg" in k for k in want)
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            assert torch.equal(got[k], w), (k, (got[k].float() - w.float()).abs().max().item())
        elif k == "meta.json":
            a, b = (json.loads(x) for x in (w, got[k]))
            assert {**a, "run_id": None, "files": None} == {**b, "run_id": None, "files": None}
        else:
            assert got[k] == w, k


# -- declared tools called by a chat policy -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_env():
    import audit11_tools as fns
    from realloc.envs.tool_env import ToolEnv
    from realloc.tools.declared import tool

    env = ToolEnv(tools=[tool(f) for f in (fns.now, fns.add, fns.boom, fns.echo, fns.scale, fns.square)],
                  call_format="chat")
    env.reset({"answer": "1"})
    return env


def _call(name: str, arguments: object = ...) -> str:
    call = {"name": name} if arguments is ... else {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


@pytest.mark.parametrize("arguments, words", [
    ({"x": "2", "y": "3"}, "add's argument x must be an integer (JSON number without a fraction), got \"2\""),
    ({"x": 2, "y": True}, "add's argument y must be an integer (JSON number without a fraction), got true"),
    ({"x": 2.5, "y": 3}, "add's argument x must be an integer (JSON number without a fraction), got 2.5"),
])
def test_a_declared_tool_s_argument_of_the_wrong_json_type_is_an_error_answer(tool_env, arguments, words):
    # add(x: int, y: int) was called with the strings "2" and "3" and answered "23"; its schema, which the policy was
    # shown, says integer. The call is now an error answer that names the argument, before any process starts.
    observation, _, done = tool_env.step(_call("add", arguments))
    assert not done and observation == f"<result>error: {words}</result>"


def test_declared_arguments_of_the_right_json_types_run(tool_env):
    assert tool_env.step(_call("add", {"x": 2, "y": 3}))[0] == "<result>5</result>"
    assert tool_env.step(_call("square", {"n": 3.0}))[0] == "<result>9</result>"  # an integer to JSON Schema: 3
    assert tool_env.step(_call("scale", {"x": 2, "unit": "km"}))[0] == "<result>2000 m</result>"
    assert tool_env.step(_call("scale", {"x": 1.5, "unit": "m", "note": None}))[0] == "<result>1.5 m</result>"
    assert tool_env.step(_call("scale", {"x": 1, "unit": "mile"}))[0] == \
        "<result>error: scale's argument unit must be one of \"m\", \"km\", got \"mile\"</result>"


def test_one_argument_written_as_text_is_its_json_value_where_the_text_does_not_fit(tool_env):
    # square(n: int) called with the text "5" (a tags call <square>5</square>, or "arguments": "5") is square(n=5);
    # a string argument keeps its text ("5" stays "5" for echo)
    from realloc.tools.keywords import keyword_arguments

    square, echo = ({"n": {"type": "integer"}}, {"text": {"type": "string"}})
    assert keyword_arguments("square", square, "5") == {"n": 5}
    assert keyword_arguments("echo", echo, "5") == {"text": "5"} and keyword_arguments("echo", echo, '"a"') == \
        {"text": '"a"'}
    assert keyword_arguments("square", square, "five").startswith("error: square's argument n must be an integer")
    assert tool_env.step(_call("square", "5"))[0] == "<result>25</result>"


def test_a_call_without_arguments_does_not_run_a_one_argument_tool_on_an_empty_string(tool_env):
    # echo(text: str) called as {"name": "echo"} ran echo(text="") and answered "<>"; a tool of no arguments (now)
    # and one whose arguments all have defaults run without any.
    assert tool_env.step(_call("echo"))[0] == \
        "<result>error: TypeError: echo() missing 1 required positional argument: 'text'</result>"
    assert tool_env.step(_call("echo", None))[0] == tool_env.step(_call("echo"))[0]
    assert tool_env.step(_call("now"))[0] == tool_env.step(_call("now", {}))[0] == "<result>noon</result>"
    assert tool_env.step(_call("echo", ""))[0] == "<result><></result>"  # an empty string, written by the policy


def test_unicode_arguments_and_a_raising_tool_come_back_as_text(tool_env):
    # checks what held: the function's exception is the answer; unicode both ways, a lone surrogate replaced
    assert tool_env.step(_call("boom", {"city": "Zürich 東京 🚀"}))[0] == \
        "<result>error: RuntimeError: kaboom Zürich 東京 🚀</result>"
    assert tool_env.step(_call("echo", {"text": "é 🚀 \ud800"}))[0] == "<result><é 🚀 ?></result>"


def test_a_hermes_call_is_json_read_from_its_tag_on():
    # The call was cut at the first "</tool_call>": an argument holding it was "not JSON", and a whole call whose
    # closing tag the policy left out (its turn ended right after the JSON) was no call at all: the rollout ended
    # and the call's text was scored as the final answer.
    from realloc.envs.chat_format import HERMES

    names = {"echo", "calculator"}
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}'
    assert HERMES.parse(call, names) == HERMES.parse(call + "\n", names) == ("calculator", "1+2", None)
    assert HERMES.parse('<tool_call>{"name": "echo", "arguments": {"text": "a</tool_call>b"}}</tool_call>', names) \
        == ("echo", "a</tool_call>b", None)
    # as before: the first of two calls; a cut-off call and a mere mention of the tag are text; a closed tag
    # around something else is an error answer
    two = '<tool_call>{"name": "echo", "arguments": {"text": "1"}}</tool_call>\n' \
          '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    assert HERMES.parse(two, names) == ("echo", "1", None)
    assert HERMES.parse(call[:-6], names) is None and HERMES.parse("I use <tool_call> tags.", names) is None
    assert HERMES.parse("<tool_call>calculator(1+2)</tool_call>", names).startswith("error: the tool call is not JSON")


def test_prompts_showing_a_keyword_tool_that_the_environment_runs_with_one_string_are_refused():
    # DataConfig.tools showed add(x, y) from its signature while env_args named the same function undeclared
    # ({"add": "module:add"}): the check compared functions only and passed, and every call the policy wrote as the
    # prompts taught it failed in the tool (add() missing 'y'), counted as tool errors.
    import types

    import audit11_tools as fns
    from realloc.envs.prompt_check import prompt_tool_lines
    from realloc.tools.declared import tool

    def call(tools):
        return types.SimpleNamespace(name="actor_gen", interface_args={"env": "tools", "env_args": {
            "tools": tools, "call_format": "chat"}})

    with pytest.raises(ValueError, match="shows the policy tool 'add' with its arguments \\(x, y\\) as keywords, but "
                                         "call 'actor_gen''s environment runs audit11_tools:add as a function of one "
                                         "string"):
        prompt_tool_lines([call({"add": "audit11_tools:add"})], (tool(fns.add),), True)
    assert prompt_tool_lines([call([tool(fns.add)])], (tool(fns.add),), True) == []


# -- prompts that show tools (DataConfig.tools) -------------------------------------------------------------------
# ChatML that writes the tools into a default system turn of its own, and none where the conversation brings its own
# system turn (then only when that turn asks for them with "{tools}"): odd, but valid.
OWN_SYSTEM_TOOLS = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content.replace('{tools}', tools | tojson if tools else '') + "
    "'<|im_end|>\\n' }}{%- set rest = messages[1:] %}"
    "{%- else %}{%- if tools %}{{- '<|im_start|>system\\nTools: ' + tools | tojson + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set rest = messages %}{%- endif %}"
    "{%- for m in rest %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _own_system_tokenizer(hf_assets, out: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_assets.tokenizer), local_files_only=True)
    tok.chat_template = OWN_SYSTEM_TOOLS
    tok.save_pretrained(str(out))
    return out


def test_prompts_whose_template_drops_the_tools_are_refused_as_the_prompts_render(hf_assets, tmp_path):
    # The check rendered a one-question probe, which this template shows the tools in, and passed; every prompt of
    # the dataset brings a system turn, where the template writes no tools: the policy never saw them. It now
    # renders the dataset's first chat prompt.
    from realloc.data.config import DataConfig
    from realloc.data.prompts import PromptDataset
    from realloc.data.tokenizer import Tokenizer
    from realloc.tools.declared import tool

    tok = Tokenizer.load(_own_system_tokenizer(hf_assets, tmp_path / "tok"))
    config = DataConfig(use_chat_template=True, tools=(tool("calculator"),))
    path = tmp_path / "prompts.jsonl"
    system = {"role": "system", "content": "Be brief."}
    path.write_text(json.dumps({"messages": [system, {"role": "user", "content": "7*8?"}]}) + "\n")
    with pytest.raises(ValueError, match="DataConfig.tools: the chat template of tokenizer .* ignores tools="):
        PromptDataset.load(path, 512, tokenizer=tok, config=config)
    # a system turn that asks for them, and a prompt without one, show them: accepted
    for first in ({**system, "content": "Tools: {tools}"}, None):
        path.write_text(json.dumps({"messages": [first] * (first is not None) + [{"role": "user", "content": "?"}]})
                        + "\n")
        data = PromptDataset.load(path, 512, tokenizer=tok, config=config)
        assert "calculator" in tok.decode(data.prompt_tokens(0), skip_special_tokens=False)
