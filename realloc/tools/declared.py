"""A tool declared once: the function that runs, and the JSON schema a chat template shows the policy.

    from realloc.tools.declared import tool
    TOOLS = (tool("calculator"), tool("my_tools:lookup"))     # a built-in; a function described by its signature
    ENV = {"env": "tools", "env_args": {"tools": list(TOOLS), "call_format": "chat", "chat_template": TOK}}
    data = DataConfig(use_chat_template=True, tools=TOOLS)    # prompts rendered with apply_chat_template(tools=...)

The schema is the one ``apply_chat_template(messages, tools=[function])`` passes its template: transformers'
``get_json_schema`` of the function (its type hints and its docstring's ``Args:`` section), or ``description`` and
``parameters`` given explicitly. A tool described by its signature is called with the call's arguments as keywords
(``lookup(city="Paris", year=2020)`` in the sandbox's child; ``keywords.py`` reads them); a tool given an explicit
``parameters`` schema, a built-in's included, is a function of one string as every ``ToolEnv`` tool
(``chat_format.tool_input``). Torch-free; transformers is imported only to describe a signature.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from typing import Any, Callable

from realloc.tools.builtin import BUILTIN_TOOLS

# The built-ins' schemas: each takes one string, named as a model would name it.
BUILTIN_SCHEMAS = {
    "calculator": ("Evaluate an arithmetic expression (+ - * / // % **, parentheses) and return its value.",
                   "expression", "The expression, for example 123*45."),
    "python": ("Run a Python program and return what it prints.", "code", "The program's source code."),
}


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str  # what the policy calls it
    function: str  # "module:function": what runs, in the sandbox's child process
    schema_json: str  # {"type": "function", "function": {"name", "description", "parameters", ...}} as JSON text
    keywords: bool = False  # called as function(**arguments) (described from its signature), else function(text)

    def schema(self) -> dict[str, Any]:
        """The tool as ``apply_chat_template(..., tools=[...])`` takes it."""
        return json.loads(self.schema_json)

    @property
    def params(self) -> tuple[str, ...]:
        """The names of its arguments."""
        return tuple(self.properties)

    @property
    def properties(self) -> dict[str, Any]:
        """Its arguments' JSON schemas by name, in order."""
        return dict(self.schema()["function"].get("parameters", {}).get("properties", {}))


def _function_path(where: str, fn: Callable[..., Any]) -> str:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", qualname):
        raise ValueError(f"{where}: the tool runs in a fresh process, which imports it by name, so it must be a "
                         f"module-level function of an importable module (got {module}:{qualname}); put it in a "
                         f"module next to the experiment and pass it or 'module:function'")
    return f"{module}:{qualname}"


def _load(where: str, path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: cannot load {path!r} ({e}); put its module on PYTHONPATH or next to the "
                         f"experiment") from None
    if not callable(fn):
        raise ValueError(f"{where}: {path!r} is not a function")
    return fn


def _described(where: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """transformers' ``get_json_schema`` of ``fn``, or one ValueError saying what its signature lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001  (DocstringParsingException, TypeHintParsingException, ...)
        raise ValueError(f"{where}: cannot describe its signature ({e}); give every argument a type hint and a line "
                         f"in the docstring's Args: section, or pass description= and parameters=") from None


def tool(function: str | Callable[..., Any], *, name: str | None = None, description: str | None = None,
         parameters: dict[str, Any] | None = None) -> Tool:
    """A tool: a built-in name (``"calculator"``, ``"python"``), ``"module:function"`` or the function itself;
    described by its signature and docstring, or by ``description`` and ``parameters`` (a JSON schema of an
    object) given explicitly. ``name`` renames it."""
    where = f"tool({function!r})" if isinstance(function, str) else f"tool({getattr(function, '__name__', function)})"
    if (description is None) != (parameters is None):
        raise ValueError(f"{where}: give both description= and parameters=, or neither (then they are read from the "
                         f"function's signature and docstring)")
    keywords = False
    if isinstance(function, str) and function in BUILTIN_TOOLS:
        path = BUILTIN_TOOLS[function]
        if description is None:
            text, arg, arg_text = BUILTIN_SCHEMAS[function]
            description, parameters = text, {"type": "object", "properties": {arg: {
                "type": "string", "description": arg_text}}, "required": [arg]}
        schema = {"type": "function", "function": {"name": name or function}}
    elif isinstance(function, str) and ":" in function or callable(function):
        path = function if isinstance(function, str) else _function_path(where, function)
        fn = function if callable(function) else _load(where, path)
        schema = _described(where, fn) if description is None else {"type": "function", "function": {}}
        schema["function"]["name"] = name or schema["function"].get("name") or path.partition(":")[2]
        keywords = description is None
    else:
        raise ValueError(f"{where}: a tool is a built-in name ({', '.join(BUILTIN_TOOLS)}), 'module:function' or a "
                         f"function")
    if description is not None:
        if not isinstance(description, str) or not description.strip():
            raise ValueError(f"{where}: description must be a non-empty string")
        if not (isinstance(parameters, dict) and parameters.get("type") == "object"
                and isinstance(parameters.get("properties", {}), dict)):
            raise ValueError(f"{where}: parameters must be a JSON schema of an object, {{'type': 'object', "
                             f"'properties': {{...}}, 'required': [...]}}, got {parameters!r}")
        schema["function"] |= {"description": description, "parameters": parameters}
    tool_name = schema["function"]["name"]
    if not isinstance(tool_name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", tool_name):
        raise ValueError(f"{where}: name must be an identifier, got {tool_name!r}")
    try:
        text = json.dumps(schema, sort_keys=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: parameters must be JSON ({e})") from None
    return Tool(tool_name, path, text, keywords)


def schemas(tools: tuple[Tool, ...] | list[Tool]) -> list[dict[str, Any]]:
    """The tools as ``apply_chat_template(..., tools=...)`` takes them."""
    return [t.schema() for t in tools]


def check_tools(where: str, tools: Any) -> tuple[Tool, ...]:
    """``tools`` as a tuple of :class:`Tool` with distinct names, or one ValueError naming ``where``."""
    if isinstance(tools, Tool) or not isinstance(tools, (list, tuple)) or \
            not all(isinstance(t, Tool) for t in tools):
        raise ValueError(f"{where}: tools must be a list of realloc.tools.declared.tool(...), got {tools!r}")
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where}: tool name(s) {', '.join(map(repr, twice))} declared twice; pass name= to tell "
                         f"them apart")
    return tuple(tools)


def env_tools(where: str, tools: Any) -> tuple[Any, dict[str, tuple[str, ...]]]:
    """``ToolEnv``'s ``tools`` with declared tools as ``{name: "module:function"}`` entries, and the tools called
    with keywords (name -> their arguments' JSON schemas by name); anything else (built-in names, a dict) unchanged, for ``ToolEnv``."""
    if not isinstance(tools, (list, tuple)) or not any(isinstance(t, Tool) for t in tools):
        return tools, {}
    names = [t.name if isinstance(t, Tool) else t for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1}, key=str)
    if twice:
        raise ValueError(f"{where}: tool name(s) {', '.join(map(repr, twice))} given twice")
    named = {(t.name if isinstance(t, Tool) else t): (t.function if isinstance(t, Tool) else t) for t in tools}
    return named, {t.name: t.properties for t in tools if isinstance(t, Tool) and t.keywords}
