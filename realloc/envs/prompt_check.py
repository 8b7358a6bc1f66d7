"""The tools a run's prompts show (``DataConfig.tools``) against the tools its environments run, checked when the
graph is built (``realloc show``, ``preflight.py``): a tool the prompts offer must be one the environment runs,
the same function, called the same way (keywords or one string); chat-format environments whose prompts show no
tools get a warning line."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from realloc.tools.declared import Tool, env_tools


def _env_tools(call: str, env_args: Mapping[str, Any]) -> dict[str, str]:
    """name -> the function an environment's ``tools`` runs (built-in names as they are)."""
    from realloc.tools.builtin import BUILTIN_TOOLS

    tools, _ = env_tools(f"call {call!r}: interface_args['env_args']['tools']", env_args.get("tools", ["calculator"]))
    named = dict(tools) if isinstance(tools, Mapping) else {t: t for t in tools}
    return {n: BUILTIN_TOOLS.get(f, f) if isinstance(f, str) else f for n, f in named.items()}


def prompt_tool_lines(calls: Iterable[Any], tools: tuple[Tool, ...], chat_prompts: bool) -> list[str]:
    """Warnings to print; one ValueError for a tool the prompts show that an environment lacks or runs otherwise.
    ``calls``: the experiment's calls (``interface_args`` of a multi-turn GENERATE: ``env``, ``env_args``)."""
    lines = []
    for c in calls:
        args = c.interface_args
        if args.get("env") != "tools" or not isinstance(args.get("env_args", {}), Mapping):
            continue
        env_args = args.get("env_args", {})
        runs = _env_tools(c.name, env_args)
        _, keywords = env_tools(f"call {c.name!r}: interface_args['env_args']['tools']",
                                env_args.get("tools", ["calculator"]))
        for t in tools:
            if t.name not in runs:
                raise ValueError(f"DataConfig.tools shows the policy tool {t.name!r}, but call {c.name!r}'s "
                                 f"environment has no such tool (it has {', '.join(sorted(runs))}); give the same "
                                 f"declared tools to both (env_args['tools'] and DataConfig(tools=...))")
            if runs[t.name] != t.function:
                raise ValueError(f"DataConfig.tools shows the policy tool {t.name!r} running {t.function}, but call "
                                 f"{c.name!r}'s environment runs {runs[t.name]} under that name; give the same "
                                 f"declared tools to both (env_args['tools'] and DataConfig(tools=...))")
            if t.keywords and t.name not in keywords:  # the policy writes keywords; the environment passes one string
                raise ValueError(f"DataConfig.tools shows the policy tool {t.name!r} with its arguments "
                                 f"({', '.join(t.params) or 'none'}) as keywords, but call {c.name!r}'s environment "
                                 f"runs {t.function} as a function of one string (not declared there); give the same "
                                 f"declared tools to both (env_args['tools'] and DataConfig(tools=...))")
        if env_args.get("call_format") == "chat" and chat_prompts and not tools:
            lines.append(f"warning: call {c.name!r} reads chat tool calls, but the prompts show no tools "
                         f"({', '.join(sorted(runs))}); declare them with realloc.tools.declared.tool and pass them "
                         f"to DataConfig(tools=...) too, so the template presents them (docs/multi-turn.md)")
    return lines


def truncated_tools_line(tools: tuple[Tool, ...], n_truncated: int, side: str, prompt_len: int) -> str | None:
    """The warning of prompts cut on the left while the template writes the tools before the question (Qwen's
    system turn, Llama 3.1's first user turn): the cut takes the tools' description out of those prompts."""
    if not tools or not n_truncated or side != "left":
        return None
    return (f"warning: {n_truncated} prompt(s) longer than prompt_len={prompt_len} lost their beginning, where chat "
            f"templates write the tools ({', '.join(t.name for t in tools)}); raise prompt_len so that the policy "
            f"sees them")
