"""Tool calls in a chat model's format (realloc/envs/chat_tools.py, ToolEnv(call_format="chat")): Qwen2/Hermes
``<tool_call>`` JSON parsed, and each tool answer rendered as the chat template writes a tool message, checked
against the template's rendering of the whole conversation (a Qwen2-style template written out here, and the
shipped tiny tokenizer's template through transformers' apply_chat_template, token by token)."""

from __future__ import annotations

import pytest

from realloc.envs.chat_tools import ChatObservation, parse_tool_call, tool_input
from realloc.envs.tool_env import ToolEnv

# Qwen2's way of writing a tool answer: a user turn holding <tool_response>...</tool_response> (a minimal template
# of that shape, written for this test)
QWEN2_STYLE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call>'


def test_tool_calls_in_the_chat_format_are_parsed():
    names = {"calculator", "python"}
    assert parse_tool_call("let me compute " + CALL + " then <tool_call>{}</tool_call>", names) == \
        ("calculator", "123*45")
    assert parse_tool_call('<tool_call>{"name": "python", "arguments": "print(1)"}</tool_call>', names) == \
        ("python", "print(1)")
    assert parse_tool_call("the answer is 5535", names) is None
    assert parse_tool_call("<tool_call>{name: calculator}</tool_call>", names).startswith("error: the tool call is not JSON")
    assert parse_tool_call('<tool_call>{"name": "search"}</tool_call>', names) == \
        "error: no tool 'search'; tools: calculator, python"
    assert parse_tool_call('<tool_call>["calculator"]</tool_call>', names).startswith("error: a tool call is")
    assert tool_input({"a": 1, "b": 2}) == '{"a": 1, "b": 2}' and tool_input({"n": 7}) == "7"


def test_a_tool_answer_is_what_the_template_writes_for_a_tool_message():
    obs = ChatObservation("ToolEnv", QWEN2_STYLE).observation("5535")
    # written out from the format: the end of the policy's turn (it generated <|im_end|> itself), the tool's
    # answer as a user turn, the next assistant turn's prompt
    assert obs == "\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_the_chat_tool_env_runs_the_call_and_answers_in_the_template_s_tool_turn():
    env = ToolEnv(tools=["calculator"], call_format="chat", chat_template=QWEN2_STYLE, limits={"wall_s": 20.0})
    env.reset({"answer": "5535"})
    obs, reward, done = env.step(CALL)
    assert obs == ChatObservation("t", QWEN2_STYLE).observation("5535") and (reward, done) == (0.0, False)
    obs, _, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    assert "<tool_response>\nerror: ZeroDivisionError" in obs and not done
    obs, _, _ = env.step("<tool_call>not json</tool_call>")
    assert "<tool_response>\nerror: the tool call is not JSON" in obs
    assert env.tool_counts["ok"] == 1 and env.tool_counts["error"] == 2
    assert env.step("so it is 5535") == (None, 1.0, True)
    # without a template the tool answer uses result_format
    plain = ToolEnv(call_format="chat", limits={"wall_s": 20.0})
    plain.reset({"answer": "1"})
    assert plain.step(CALL) == ("<result>5535</result>", 0.0, False)
    with pytest.raises(ValueError, match="call_format must be one of tags, chat"):
        ToolEnv(call_format="json")
    with pytest.raises(ValueError, match="chat_template '/nonexistent' is neither a Jinja template nor"):
        ToolEnv(call_format="chat", chat_template="/nonexistent")


def test_the_conversation_is_the_one_the_shipped_tokenizer_s_template_writes(hf_assets, tiny_tok, tiny_ref):
    question = [{"role": "user", "content": "what is 123*45?"}]
    turn, answer = CALL, "5535"
    env = ToolEnv(call_format="chat", chat_template=str(hf_assets.tokenizer), limits={"wall_s": 20.0})
    env.reset({"answer": answer})
    obs, _, _ = env.step(turn)
    # what multiturn.py builds: the prompt (template with generation prompt), the policy's turn and its EOS
    # (<|im_end|>), then the observation, encoded without special tokens added
    ids = (tiny_tok.encode_chat(question) + tiny_tok.encode(turn, add_special_tokens=False)
           + tiny_tok.encode("<|im_end|>", add_special_tokens=False) + tiny_tok.encode(obs, add_special_tokens=False))
    conversation = question + [{"role": "assistant", "content": turn}, {"role": "tool", "content": answer}]
    want = tiny_ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ids == list(want)
