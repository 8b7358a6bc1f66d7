"""Tool calls in each chat template's own format (realloc/envs/chat_format.py, ToolEnv(call_format="chat")): the
format learned from Llama 3.1, Mistral v0.3 and Qwen3 templates (tests/chat_templates.py, in tokenizer folders),
the policy's turn parsed as the driver hands it over (decoded without special tokens), and the conversation checked
token for token against transformers' apply_chat_template of the same conversation; a template without tool
support is one error naming it and call_format, when the graph is built (realloc show)."""

from __future__ import annotations

import dataclasses

import pytest

from chat_templates import NO_TOOLS, tokenizer_folder
from realloc.envs.chat_format import chat_format
from realloc.envs.tool_env import ToolEnv, check_env_args

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ARGS = {"expression": "123*45"}
# each family's call as its model writes it (the documented formats), and the token that ends the turn
TURNS = {
    "llama31": ('{"name": "calculator", "parameters": {"expression": "123*45"}}', "<|eot_id|>"),
    "mistral": ('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "123*45"}, "id": "a1b2c3d4e"}]',
                "</s>"),
    "qwen3": ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call>', "<|im_end|>"),
}


@pytest.fixture(scope="module")
def folders(hf_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_templates")
    return {f: str(tokenizer_folder(hf_assets.tokenizer, root / f, f)) for f in (*TURNS, "no_tools")}


def _env(folder: str) -> ToolEnv:
    env = ToolEnv(tools=["calculator"], call_format="chat", chat_template=folder, limits={"wall_s": 20.0})
    env.reset({"answer": "5535"})
    return env


def test_each_template_s_call_format_is_read_from_the_template(folders):
    got = {f: chat_format("t", folders[f], None) for f in TURNS}
    fmt = {f: (g[1].prefix, g[1].suffix, g[1].arguments, g[1].listed, g[1].id_key, g[2]) for f, g in got.items()}
    assert fmt == {"llama31": ("", "", "parameters", False, None, "<|eot_id|>"),
                   # [TOOL_CALLS] is a special token: the decoded turn has none
                   "mistral": ("", "", "arguments", True, "id", "</s>"),
                   "qwen3": ("<tool_call>", "</tool_call>", "arguments", False, None, "<|im_end|>")}


@pytest.mark.parametrize("family", list(TURNS))
def test_the_conversation_is_the_one_the_template_writes_token_for_token(folders, family):
    from transformers import AutoTokenizer

    from realloc.data.tokenizer import Tokenizer

    folder = folders[family]
    ref, tok = AutoTokenizer.from_pretrained(folder, local_files_only=True), Tokenizer.load(folder)
    turn, eot = TURNS[family]
    question = [{"role": "user", "content": "what is 123*45?"}]
    prompt = tok.encode(ref.apply_chat_template(question, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    said = tok.encode(turn, add_special_tokens=False) + tok.encode(eot, add_special_tokens=False)
    env = _env(folder)
    # as multiturn.py hands it over: the sampled turn decoded without special tokens (its EOS included)
    obs, reward, done = env.step(tok.decode(said))
    assert (reward, done, env.tool_counts["ok"]) == (0.0, False, 1)
    ids = prompt + said + tok.encode(obs, add_special_tokens=False)
    call = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "calculator", "arguments": ARGS}}
    conversation = question + [{"role": "assistant", "content": "", "tool_calls": [call]},
                               {"role": "tool", "content": "5535", "name": "calculator", "tool_call_id": "a1b2c3d4e"}]
    want = ref.apply_chat_template(conversation, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids == list(want)
    assert env.step("so it is 5535") == (None, 1.0, True)


def test_turns_are_parsed_as_each_model_writes_them(folders):
    llama, mistral, qwen = (_env(folders[f]) for f in TURNS)
    # Llama: the JSON alone, or after <|python_tag|> (a special token, whether decoding dropped it or not)
    assert llama.format.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+3"}}',
                              {"calculator"}) == ("calculator", "2+3", None)
    assert llama.format.parse('{"name": "calculator", "parameters": {"expression": "2+3"}} more', {"calculator"}) == \
        ("calculator", "2+3", None)
    assert llama.format.parse("The answer is 5535.", {"calculator"}) is None
    assert llama.format.parse('{"name": calculator}', {"calculator"}).startswith("error: the tool call is not JSON")
    assert llama.format.parse('{"name": "search", "parameters": {}}', {"calculator"}) == \
        "error: no tool 'search'; tools: calculator"
    assert llama.format.parse('{"nom": "calculator"}', {"calculator"}) == \
        'error: a tool call is {"name": ..., "parameters": ...}'
    # Mistral: the list after [TOOL_CALLS], decoded away or not; the call's id goes back with the answer
    obs, _, _ = mistral.step('[{"name": "calculator", "arguments": {"expression": "6*7"}, "id": "Zz9Zz9Zz9"}]')
    assert obs == '[TOOL_RESULTS] {"content": "42", "call_id": "Zz9Zz9Zz9"}[/TOOL_RESULTS]'
    # a call without an id (or one the template refuses) is answered under an id of the environment's
    obs, _, _ = mistral.step('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}, "id": "x"}]')
    assert obs == '[TOOL_RESULTS] {"content": "42", "call_id": "call00002"}[/TOOL_RESULTS]'
    assert mistral.step("[TOOL_CALLS] [{]")[0].startswith('[TOOL_RESULTS] {"content": "error: the tool call is not')
    # the templates given as text alone (no special tokens known): the same calls, decoded or not
    from chat_templates import LLAMA31, MISTRAL, QWEN3

    text_only = {"calculator"}
    assert chat_format("t", LLAMA31, None)[1].parse('{"name": "calculator", "parameters": {"expression": "1"}}',
                                                    text_only) == ("calculator", "1", None)
    mistral_text = chat_format("t", MISTRAL, "</s>")[1]
    for turn in ('[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1"}}]',
                 ' [{"name": "calculator", "arguments": {"expression": "1"}}]'):
        assert mistral_text.parse(turn, text_only) == ("calculator", "1", None)
    # a list of {"tool_name": ..., "parameters": ...} in a fenced block after "Action:" (a Command-R-like format)
    action = QWEN3.replace(
        "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments | tojson"
        " + '}\\n</tool_call>' }}",
        "{{- 'Action: ```json\\n' + [{'tool_name': c.function.name, 'parameters': c.function.arguments}] | tojson"
        " + '\\n```' }}")
    assert action != QWEN3
    fmt = chat_format("t", action, None)[1]
    assert (fmt.prefix, fmt.suffix, fmt.name, fmt.arguments, fmt.listed) == \
        ("Action: ```json", "```", "tool_name", "parameters", True)
    assert fmt.parse('Action: ```json\n[{"tool_name": "calculator", "parameters": {"expression": "7"}}]\n```',
                     text_only) == ("calculator", "7", None)
    assert fmt.parse('Action: ```json\n[{"name": "calculator"}]\n```', text_only) == \
        'error: a tool call is [{"tool_name": ..., "parameters": ...}]'
    # a generation prompt that opens a think block the earlier assistant turns do not have
    thinking = QWEN3.replace("assistant\\n' }}{%- endif %}", "assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    assert thinking != QWEN3
    assert chat_format("t", thinking, None)[1] == chat_format("t", QWEN3, None)[1]
    # Qwen3: text, then the tags
    assert qwen.format.parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                             '"2+3"}}\n</tool_call>', {"calculator"}) == ("calculator", "2+3", None)
    obs, _, _ = qwen.step('<tool_call>{"name": "calculator", "arguments": "2+3"}</tool_call>')
    assert obs == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_tool_support_is_one_error_naming_it_and_call_format(folders, capsys):
    env_args = {"tools": ["calculator"], "call_format": "chat", "chat_template": folders["no_tools"]}
    with pytest.raises(ValueError, match=r"call 'gen': interface_args\['env_args'\] of env 'tools': call_format "
                                         r"'chat' needs a chat template .*the template of .*no_tools fails on a tool "
                                         r"message .*call_format 'tags'"):
        check_env_args("gen", env_args)
    with pytest.raises(ValueError, match="ToolEnv: call_format 'chat' needs a chat template"):
        ToolEnv(**env_args)
    # a template that writes calls other than as a JSON object with the name (the name, then the arguments)
    named = NO_TOOLS.replace("{{- raise_exception('roles must be user or assistant') }}", "") + (
        "{%- for m in messages %}{%- for c in m.tool_calls or [] %}{{- '[TOOL_CALLS]' + c.function.name + '[ARGS]' + "
        "c.function.arguments | tojson }}{%- endfor %}{%- endfor %}")
    with pytest.raises(ValueError, match=r"call_format 'chat' reads tool calls written as JSON objects with the "
                                         r"tool's name; the template of the template text writes one as "
                                         r"'.*\[TOOL_CALLS\]probe_tool_x7\[ARGS\]"):
        check_env_args("gen", {**env_args, "chat_template": named})
    # a template that writes nothing for a tool message
    silent = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="the template of the template text writes nothing for one"):
        check_env_args("gen", {**env_args, "chat_template": silent})
    for bad, message in ((3, "chat_template must be a tokenizer directory or a Jinja"),
                         ("/nonexistent", "chat_template '/nonexistent' is neither")):
        with pytest.raises(ValueError, match=message):
            check_env_args("gen", {**env_args, "chat_template": bad})
    with pytest.raises(ValueError, match="end_of_turn must be the token that ends"):
        check_env_args("gen", {**env_args, "chat_template": folders["qwen3"], "end_of_turn": 5})
    # realloc show: one line, naming the call, the tokenizer and call_format, and no traceback
    from pathlib import Path

    from realloc.cli import main

    exp = Path(folders["no_tools"]).parent / "mt_no_tools.py"
    exp.write_text(f'''
import dataclasses
from realloc.algorithms.critic_free.multiturn_graph import multiturn_rpcs
from realloc.api import auto

ENV = {{"env": "tools", "max_turns": 2, "env_args": {env_args!r}}}

@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=8, prompt_len=8, gen_len=40)
@dataclasses.dataclass
class MT:
    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=4)
''')
    assert main(["show", str(exp)]) != 0
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and "call 'actor_gen'" in lines[0] and "no_tools fails on a tool message" in lines[0] \
        and "call_format 'chat'" in lines[0] and "Traceback" not in lines[0], lines
    # and a template with tool support shows
    exp.write_text(exp.read_text().replace(folders["no_tools"], folders["mistral"]))
    assert main(["show", str(exp)]) == 0


def test_a_tokenizer_with_named_templates_uses_its_tool_use_one(folders, tmp_path):
    import json

    from chat_templates import QWEN3

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": [{"name": "default", "template": NO_TOOLS},
                                                     {"name": "tool_use", "template": QWEN3}]}))
    learned, qwen3 = chat_format("t", str(tmp_path), None), chat_format("t", folders["qwen3"], None)
    assert learned[1].prefix == "<tool_call>" and learned[2] == "<|im_end|>"
    assert dataclasses.replace(learned[1], specials=()) == dataclasses.replace(qwen3[1], specials=())
    # transformers 5 writes them as files
    saved = tmp_path / "saved"
    (saved / "additional_chat_templates").mkdir(parents=True)
    (saved / "chat_template.jinja").write_text(NO_TOOLS)
    (saved / "additional_chat_templates" / "tool_use.jinja").write_text(QWEN3)
    assert chat_format("t", str(saved), "<|im_end|>")[1].prefix == "<tool_call>"
