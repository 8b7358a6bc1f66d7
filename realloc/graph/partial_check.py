"""The plan-level check of partial rollouts (``algorithms/partial_rollout.py``, docs/partial-rollouts.md).

A response cut in iteration t is trained in iteration t + 1 at the earliest, so its first tokens are one version
older there than the plan's staleness makes them; the experiment's ``max_staleness`` must leave that room.
"""

from __future__ import annotations

from typing import Any

# the graph is dataflow.DataflowGraph, which calls these (an import of it would be a circle)


def partial_rollout_calls(graph: Any) -> list[str]:
    """The GENERATE calls whose settings turn partial rollouts on."""
    out = []
    for r in graph.calls:
        settings = graph.interfaces[r.name].settings(graph.spec.config)
        if r.interface_type.value == "generate" and getattr(settings, "partial_rollout_tokens", None) is not None:
            out.append(r.name)
    return out


def partial_rollout_error(graph: Any, staleness: int) -> str | None:
    """Why partial rollouts cannot run at plan ``staleness``; None if they can (or are off)."""
    calls = partial_rollout_calls(graph)
    if not calls:
        return None
    for c in calls:  # the worker refused these only at the first generation of a run (worker_partial.py)
        iface = graph.interfaces.get(c)
        if iface is not None and not iface.migrates_tail:
            return (f"call {c!r} has partial_rollout_tokens set, but interface {iface.name!r} generates turn by turn "
                    f"(multi-turn), so a rollout cannot be cut and carried to the next iteration; set "
                    f"partial_rollout_tokens=None")
    eta = graph.spec.max_staleness
    if staleness >= eta:
        return (f"call {calls[0]!r} has partial_rollout_tokens set, which needs max_staleness above the plan's "
                f"staleness ({staleness}): a response continued in the next iteration is trained one version older; "
                f"set @auto(max_staleness={staleness + 1}) (or --set max_staleness={staleness + 1}), or "
                f"partial_rollout_tokens=None")
    return None
