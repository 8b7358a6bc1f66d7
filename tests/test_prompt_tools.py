"""Tools declared once (realloc/tools/declared.py) for the prompt and the environment: prompts rendered with
DataConfig(tools=...) are token for token transformers' apply_chat_template(messages, tools=[...]) for the Llama 3.1,
Mistral v0.3 and Qwen3 templates of tests/chat_templates.py (the reference given the Python functions themselves,
so transformers describes them on its own); a rollout whose prompt shows the tools has its calls answered by the
declared functions, the whole conversation again token for token the template's; bad input is one error each and
one line at `realloc show`."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

import prompt_tool_fns as fns
from chat_templates import tokenizer_folder
from realloc.data.config import DataConfig
from realloc.data.prompts import PromptDataset
from realloc.envs.tool_env import ToolEnv, check_env_args
from realloc.tools.declared import tool

FAMILIES = ("llama31", "mistral", "qwen3")
TOOLS = (tool("calculator"), tool(fns.multiply))
QUESTION = "what is 123*45?"


@pytest.fixture(scope="module")
def folders(hf_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_tools")
    return {f: str(tokenizer_folder(hf_assets.tokenizer, root / f, f)) for f in FAMILIES}


def _ids(got) -> list[int]:
    return list(got["input_ids"] if hasattr(got, "keys") else got)


def test_a_tool_is_described_as_transformers_describes_it():
    from transformers.utils import get_json_schema

    assert tool(fns.multiply).schema() == get_json_schema(fns.multiply)
    assert tool("prompt_tool_fns:multiply") == tool(fns.multiply)
    assert tool(fns.multiply).function == "prompt_tool_fns:multiply" and tool(fns.multiply).keywords
    calc = tool("calculator").schema()["function"]
    assert calc["name"] == "calculator" and calc["parameters"]["required"] == ["expression"]
    assert tool("calculator").function == "realloc.tools.builtin:calculator" and not tool("calculator").keywords
    params = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    given = tool("prompt_tool_fns:shout", name="loud", description="Shout.", parameters=params)
    assert given.schema() == {"type": "function", "function": {"name": "loud", "description": "Shout.",
                                                               "parameters": params}}
    assert not given.keywords  # an explicit schema: a function of one string, as every tool


def test_bad_declarations_are_one_error_each():
    cases = [
        (lambda: tool(fns.undocumented), r"tool\(undocumented\): cannot describe its signature \(.*no docstring"),
        (lambda: tool("prompt_tool_fns:unhinted"), r"cannot describe its signature \(.*missing a type hint"),
        (lambda: tool(lambda text: text), r"must be a module-level function"),
        (lambda: tool("calculator", description="x"), r"give both description= and parameters="),
        (lambda: tool("calculator", description="x", parameters={"a": 1}), r"parameters must be a JSON schema"),
        (lambda: tool("calculator", name="no good"), r"name must be an identifier"),
        (lambda: tool("nope:fn"), r"cannot load 'nope:fn'"),
        (lambda: tool(3), r"a tool is a built-in name"),
        (lambda: DataConfig(tools=("calculator",)), r"DataConfig.tools: tools must be a list of realloc.tools"),
        (lambda: DataConfig(tools=(tool("calculator"), tool("python", name="calculator"))), r"declared twice"),
        (lambda: ToolEnv(tools=[tool("calculator"), "calculator"]), r"ToolEnv: tool name\(s\) 'calculator' given"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_show_the_tools_token_for_token(folders, family, tmp_path):
    from transformers import AutoTokenizer

    from realloc.data.tokenizer import Tokenizer

    folder = folders[family]
    ref, tok = AutoTokenizer.from_pretrained(folder, local_files_only=True), Tokenizer.load(folder)
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "and 7*8?"}]
    path.write_text(json.dumps({"prompt": QUESTION}) + "\n" + json.dumps({"messages": chat}) + "\n")
    if family == "mistral":  # its template takes no system turn
        path.write_text(json.dumps({"prompt": QUESTION}) + "\n")
    data = PromptDataset.load(path, 2048, tokenizer=tok, config=DataConfig(use_chat_template=True, tools=TOOLS))
    # the reference: transformers given the calculator's schema and the Python function itself
    reference_tools = [TOOLS[0].schema(), fns.multiply]
    convs = [[{"role": "user", "content": QUESTION}]] + ([chat] if family != "mistral" else [])
    for row, conv in enumerate(convs):
        want = _ids(ref.apply_chat_template(conv, tools=reference_tools, add_generation_prompt=True, tokenize=True))
        assert data.prompt_tokens(row) == want
        assert "multiply" in tok.decode(want, skip_special_tokens=False)
    # prompts without tools are what they were: the template rendered without them
    plain = PromptDataset.load(path, 2048, tokenizer=tok, config=DataConfig(use_chat_template=True))
    want = _ids(ref.apply_chat_template(convs[0], add_generation_prompt=True, tokenize=True))
    assert plain.prompt_tokens(0) == want != data.prompt_tokens(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rollout_shows_the_tools_and_answers_their_calls_token_for_token(folders, family, tmp_path):
    """A two-call rollout as the multi-turn driver runs it (the policy's turns decoded without special tokens, the
    observations appended): the prompt from the dataset, the declared multiply called with keyword arguments in the
    sandbox, the calculator with its one string."""
    from transformers import AutoTokenizer

    from realloc.data.tokenizer import Tokenizer

    folder = folders[family]
    ref, tok = AutoTokenizer.from_pretrained(folder, local_files_only=True), Tokenizer.load(folder)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": QUESTION, "answer": "5535"}) + "\n")
    data = PromptDataset.load(path, 2048, tokenizer=tok, config=DataConfig(use_chat_template=True, tools=TOOLS))
    env = ToolEnv(tools=list(TOOLS), call_format="chat", chat_template=folder, limits={"wall_s": 20.0})
    env.reset(data.record(0))
    calls = [("multiply", {"a": 123, "b": 45}), ("calculator", {"expression": "5535-0"})]
    eot = {"qwen3": "<|im_end|>", "llama31": "<|eot_id|>", "mistral": "</s>"}[family]
    ids, conversation = data.prompt_tokens(0), [{"role": "user", "content": QUESTION}]
    for k, (name, args) in enumerate(calls):
        ident = f"abcdefgh{k}" if family == "mistral" else f"call{k + 1:05d}"  # Mistral's policy writes its own
        if family == "qwen3":
            turn = "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        elif family == "mistral":
            turn = "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": args, "id": ident}])
        else:
            turn = json.dumps({"name": name, "parameters": args})
        said = tok.encode(turn, add_special_tokens=False) + tok.encode(eot, add_special_tokens=False)
        obs, reward, done = env.step(tok.decode(said))
        assert (reward, done) == (0.0, False)
        ids = ids + said + tok.encode(obs, add_special_tokens=False)
        conversation += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": ident, "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "content": "5535", "name": name, "tool_call_id": ident}]
    assert env.tool_counts["ok"] == 2
    want = ref.apply_chat_template(conversation, tools=[TOOLS[0].schema(), fns.multiply], add_generation_prompt=True,
                                   tokenize=True)
    assert ids == _ids(want)
    assert env.step("It is 5535.") == (None, 1.0, True)


def test_declared_tools_in_the_tags_format_and_their_errors():
    env = ToolEnv(tools=[tool(fns.multiply), tool(fns.shout)], limits={"wall_s": 20.0})
    env.reset({"answer": "6"})
    assert env.step('<multiply>{"a": 2, "b": 3}</multiply>')[0] == "<result>6</result>"
    assert env.step("<shout>hi</shout>")[0] == "<result>HI</result>"  # one argument: the text itself
    assert env.step("<multiply>2 3</multiply>")[0] == \
        "<result>error: multiply takes the arguments a, b: call it with a JSON object</result>"
    assert env.step('<multiply>{"a": 2}</multiply>')[0] == \
        "<result>error: TypeError: multiply() missing 1 required positional argument: 'b'</result>"
    assert env.tool_counts == {**env.tool_counts, "ok": 2, "error": 2}
    check_env_args("gen", {"tools": [tool(fns.multiply)], "call_format": "tags"})
    # how arguments become keywords: an object (or a JSON string of one, as some models write them) as it is, one
    # string for a function of one argument, nothing for a function of none
    from realloc.tools.keywords import keyword_arguments

    assert keyword_arguments("m", ("a", "b"), '{"a": 1, "b": 2}') == {"a": 1, "b": 2} == \
        keyword_arguments("m", ("a", "b"), {"a": 1, "b": 2})
    assert keyword_arguments("s", ("text",), "hi") == {"text": "hi"} and keyword_arguments("n", (), "") == {}
    assert keyword_arguments("m", ("a", "b"), [1, 2]) == "error: m takes the arguments a, b: call it with a JSON object"


EXPERIMENT = '''
import dataclasses
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto
from realloc.data.config import DataConfig
from realloc.tools.declared import tool
import prompt_tool_fns as fns

TOOLS = {tools}
ENV = {{"env": "tools", "max_turns": 2, "env_args": {{"tools": {env_tools}, "call_format": "chat",
                                                    "chat_template": {folder!r}}}}}

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=2, prompt_len=200, gen_len=40)
@dataclasses.dataclass
class MT:
    dataset: str = "prompts.jsonl"
    tokenizer: str = {folder!r}
    data: DataConfig = DataConfig(use_chat_template=True, tools=TOOLS)
    models = {{"actor": {actor!r}, "ref": {actor!r}}}

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, n_samples=2)
'''


def test_bad_input_is_one_line_at_realloc_show(folders, hf_assets, tmp_path, capsys, monkeypatch):
    from realloc.cli import main

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(fns.__file__).parent))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": QUESTION, "answer": "5535"}) + "\n")
    actor = str(hf_assets.checkpoint("qwen2_mqa_tied"))
    exp = tmp_path / "mt.py"

    def show(tools: str, env_tools: str, folder: str) -> list[str]:
        exp.write_text(textwrap.dedent(EXPERIMENT.format(tools=tools, env_tools=env_tools, folder=folder,
                                                         actor=actor)))
        rc = main(["show", str(exp)])
        captured = capsys.readouterr()
        lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
        assert not any("Traceback" in ln for ln in lines), lines
        # an error is the last line, the one that says error (after what show printed before the check)
        return [rc, *[ln for ln in lines if "error" in ln]] if rc != 0 else [rc, *[ln for ln in lines if ln.startswith("warning")]]

    # prompt_len=200 cuts the prompt's beginning, where Qwen's template writes the tools: a warning
    got = show("(tool('calculator'), tool(fns.multiply))", "list(TOOLS)", folders["qwen3"])
    assert got == [0, "warning: 1 prompt(s) longer than prompt_len=200 lost their beginning, where chat templates "
                      "write the tools (calculator, multiply); raise prompt_len so that the policy sees them"], got
    # a tool the prompts show that the environment lacks
    got = show("(tool('calculator'), tool(fns.multiply))", "['calculator']", folders["qwen3"])
    assert got[0] != 0 and len(got) == 2 and "DataConfig.tools shows the policy tool 'multiply', but call " \
        "'actor_gen''s environment has no such tool (it has calculator)" in got[1], got
    # the same name running another function
    got = show("(tool('calculator'),)", "{'calculator': 'prompt_tool_fns:shout'}", folders["qwen3"])
    assert got[0] != 0 and len(got) == 2 and "runs prompt_tool_fns:shout under that name" in got[1], got
    # a function whose signature cannot be described
    got = show("(tool(fns.undocumented),)", "list(TOOLS)", folders["qwen3"])
    assert got[0] != 0 and len(got) == 2 and "tool(undocumented): cannot describe its signature" in got[1] \
        and "Traceback" not in got[1], got
    # a template that ignores tools= (the shipped tiny ChatML one): refused
    tiny = str(hf_assets.tokenizer)
    got = show("(tool('calculator'),)", "list(TOOLS)", tiny)
    assert got[0] != 0 and len(got) == 2 and f"the chat template of tokenizer {tiny} ignores tools=" in got[1], got
    # chat tool calls, but prompts that show no tools: a warning
    got = show("()", "['calculator']", folders["qwen3"])
    assert got[0] == 0 and any(ln.startswith("warning: call 'actor_gen' reads chat tool calls, but the prompts "
                                             "show no tools") for ln in got[1:]), got


def test_a_run_on_the_cpu_cluster_shows_the_policy_its_tools(folders, hf_assets, tmp_path):
    """`realloc run` of a multi-turn GRPO iteration (real workers, which import the experiment's declarations):
    every logged rollout's prompt is apply_chat_template of its question with the declared tools, token for token."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    questions = [f"what is {a}*{b}?" for a, b in ((12, 34), (56, 7))]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": "0"}) + "\n"
                                                    for q in questions))
    exp = EXPERIMENT.format(tools="(tool('calculator'), tool(fns.multiply))", env_tools="list(TOOLS)",
                            folder=folders["qwen3"], actor=str(hf_assets.checkpoint("qwen2",
                                                                                    max_position_embeddings=1024)))
    exp = exp.replace("prompt_len=200", "prompt_len=700").replace('"max_turns": 2', '"max_turns": 2, "turn_tokens": 8')
    (tmp_path / "mt.py").write_text(exp + "\n    sample_every: int = 1\n    log_samples: int = 4\n")
    tests = Path(fns.__file__).parent
    r = subprocess.run([sys.executable, "-m", "realloc.cli", "run", str(tmp_path / "mt.py"), "--iterations", "1",
                        "--run-dir", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TMPDIR": str(tmp_path),
                            "PYTHONPATH": f"{tests.parent}{os.pathsep}{tests}"})
    assert r.returncode == 0, r.stdout + r.stderr
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines() if x.strip()]
    ref = AutoTokenizer.from_pretrained(folders["qwen3"], local_files_only=True)
    want = {q: _ids(ref.apply_chat_template([{"role": "user", "content": q}], tools=[TOOLS[0].schema(), fns.multiply],
                                            add_generation_prompt=True, tokenize=True)) for q in questions}
    assert len(samples) == 4 and all(s["prompt_ids"] in want.values() for s in samples)
    assert all("<tools>" in s["prompt"] and '"name": "multiply"' in s["prompt"] for s in samples)


def test_plain_text_prompts_and_a_failing_template_are_one_error_each(folders, tmp_path):
    from realloc.data.tokenizer import Tokenizer

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": QUESTION}) + "\n")
    tok = Tokenizer.load(folders["qwen3"])
    with pytest.raises(ValueError, match=r"DataConfig.tools: the prompt at .*prompts.jsonl:1 is plain text, which "
                                         r"shows the policy no tools; set DataConfig\(use_chat_template=True\)"):
        PromptDataset.load(path, 2048, tokenizer=tok, config=DataConfig(tools=TOOLS))
    broken = tmp_path / "broken"
    shutil.copytree(folders["qwen3"], broken)
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    cfg["chat_template"] = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0].content }}"
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"DataConfig.tools: the chat template of tokenizer .*broken fails with "
                                         r"tools= \(TemplateError: no tools here\)"):
        PromptDataset.load(path, 2048, tokenizer=Tokenizer.load(str(broken)),
                           config=DataConfig(use_chat_template=True, tools=TOOLS))


def test_sft_records_share_the_prompts_with_tools(folders, tmp_path):
    """An SFT record's prompt is rendered with the tools too, so SFT traces and rollouts start alike; prompt and reply
    together are transformers' rendering of the conversation with the tools."""
    from transformers import AutoTokenizer

    from realloc.data.pairs import SFTDataset
    from realloc.data.tokenizer import Tokenizer

    ref, tok = AutoTokenizer.from_pretrained(folders["qwen3"], local_files_only=True), Tokenizer.load(folders["qwen3"])
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": QUESTION, "response": "It is 5535."}) + "\n")
    ds = SFTDataset.load(path, 2048, 16, tokenizer=tok, config=DataConfig(use_chat_template=True, tools=TOOLS))
    conv = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It is 5535."}]
    full = _ids(ref.apply_chat_template(conv, tools=[TOOLS[0].schema(), fns.multiply], tokenize=True))
    prompt, reply = ds.prompt_tokens(0), ds.tokens("response", 0)
    assert prompt + reply + tok.encode("\n", add_special_tokens=False) == full
    assert "<tools>" in tok.decode(prompt, skip_special_tokens=False)
