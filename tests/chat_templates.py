"""Chat templates of three model families' tool calling, written for the tests from the formats as their model cards
and prompt-format guides describe them (not copies of the published templates), and tokenizer folders that carry
them: the tiny BPE tokenizer with each family's special tokens added.

- Llama 3.1: header tokens around each role; the tools listed in the first user turn; a call is the JSON object
  ``{"name": ..., "parameters": {...}}`` alone in the assistant turn, ended by ``<|eot_id|>``; the tool's answer is a
  turn of the ``ipython`` role.
- Mistral v0.3: ``[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]`` before the last user turn, ``[INST] ...[/INST]``;
  calls ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}]</s>`` with 9-character ids; answers
  ``[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]``; no generation prompt.
- Qwen3: ChatML; the tools in a system turn inside ``<tools></tools>``; a call ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``; answers as a user turn holding ``<tool_response>...</tool_response>``; an
  empty think block before the last assistant turn after the last question.
"""

from __future__ import annotations

from pathlib import Path

LLAMA31 = (
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m.tool_calls %}{{- {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' or m.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if loop.first and tools %}"
    "{{- 'Answer with a JSON function call, {\"name\": function name, \"parameters\": its arguments}, if one helps.'"
    " + '\\n\\n' }}{%- for t in tools %}{{- t | tojson + '\\n\\n' }}{%- endfor %}"
    "{%- endif %}"
    "{{- m.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

MISTRAL = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{{- '[INST] ' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for c in m.tool_calls %}"
    "{%- if c.id is not defined or c.id | length != 9 %}{{- raise_exception('tool call ids have 9 characters') }}"
    "{%- endif %}"
    "{{- {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- elif m.role == 'assistant' %}{{- ' ' + m.content + eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{- raise_exception('tool call ids have 9 characters') }}{%- endif %}"
    "{{- '[TOOL_RESULTS] ' + {'content': m.content, 'call_id': m.tool_call_id} | tojson + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('roles are user, assistant and tool') }}"
    "{%- endif %}"
    "{%- endfor %}")

QWEN3 = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou may call functions. Their signatures, in <tools></tools>:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + t | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nWrite each call as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>'"
    " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- if not loop.first or m.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments | tojson"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# A template without tools: it refuses any role but user and assistant.
NO_TOOLS = (
    "{%- for m in messages %}"
    "{%- if m.role not in ['user', 'assistant'] %}{{- raise_exception('roles must be user or assistant') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# family -> (template, special tokens, ordinary added tokens, bos, eos: the token that ends a turn)
FAMILIES = {
    "llama31": (LLAMA31, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                          "<|eom_id|>", "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "<s>", "</s>"),
    "qwen3": (QWEN3, [], ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                          "</think>"], None, "<|im_end|>"),
    "no_tools": (NO_TOOLS, [], [], None, "<|im_end|>"),
}


def tokenizer_folder(base: Path, out: Path, family: str) -> Path:
    """The tiny tokenizer at ``base`` with ``family``'s tokens and template, saved to ``out``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    template, special, plain, bos, eos = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    if bos is not None:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return out


def round_trip(folder: str, question: list, tools: list, turn: str, eot: str, env, conversation: list):
    """(the environment's step on ``turn`` + ``eot`` as the driver hands it over (decoded without special tokens),
    the ids of prompt + turn + observation, ``apply_chat_template`` of ``question`` + ``conversation``'s ids)."""
    from transformers import AutoTokenizer

    from realloc.data.tokenizer import Tokenizer

    ref, tok = AutoTokenizer.from_pretrained(folder, local_files_only=True), Tokenizer.load(folder)
    prompt = tok.encode(ref.apply_chat_template(question, tools=tools, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    said = tok.encode(turn, add_special_tokens=False) + tok.encode(eot, add_special_tokens=False)
    step = env.step(tok.decode(said))
    want = ref.apply_chat_template(question + conversation, tools=tools, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    return step, prompt + said + tok.encode(step[0], add_special_tokens=False), list(want)
