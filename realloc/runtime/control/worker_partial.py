"""A worker's partial rollouts: the rows each generation call carries between iterations, handed to the call
through its context, saved with a checkpoint and loaded on resume (``algorithms/partial_rollout.py``).

Every rank of a generation replica computes the same rows, so each keeps its own copy and only the replica's
first rank (tp 0, pp 0) writes them: ``partial/<call>/<first slot>-<end>.json`` in the checkpoint, the carry after
the checkpoint's last iteration (generation may already have run ahead of it). A resumed run reads every file
of its call and keeps the slots it is given, so the generation's dp degree may change on resume.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from realloc.algorithms.common import actor_generate
from realloc.algorithms.context import CallContext
from realloc.algorithms.partial_rollout import PartialRollouts
from realloc.calls import InterfaceType
from realloc.runtime.persist import checkpoint

log = logging.getLogger("realloc.worker")
PARTIAL_DIR = "partial"


class PartialStore:
    def __init__(self, max_staleness: int, plan_staleness: int, resume: Path | None = None,
                 verify: bool = True) -> None:
        self.bound, self.plan_staleness = max_staleness, plan_staleness
        self.states: dict[str, PartialRollouts] = {}
        self.writes: dict[str, tuple[bool, range]] = {}  # call -> (this rank writes its rows, its slots)
        self.loaded: dict[str, list[str]] = {}  # call -> the checkpoint's texts, until its first call
        if resume is not None:
            self.load(resume, verify)

    def attach(self, ctx: CallContext, fn: Callable[..., Any], handle: Any, evaluating: bool) -> None:
        """Give a training generation call with ``partial_rollout_tokens`` its carried rows and the version of
        the parameters it samples with (``handle``: the worker's ModelHandle of the call's layout)."""
        cut = getattr(ctx.config, "partial_rollout_tokens", None)
        if cut is None or evaluating or ctx.greedy or ctx.call.interface_type is not InterfaceType.GENERATE:
            return
        assert handle is not None
        name = ctx.call.name
        if fn is not actor_generate:
            raise ValueError(f"call {name!r}: partial_rollout_tokens works with the built-in generation "
                             f"(common.actor_generate), not {getattr(fn, '__name__', fn)!r}; set it to None")
        state = self.states.get(name)
        if state is None:
            state = self.states[name] = PartialRollouts(cut, self.bound)
            for text in self.loaded.pop(name, []):
                state.load(text)
            state.carry = {s: r for s, r in state.carry.items() if s in ctx.ids}
        elif any(s not in ctx.ids for s in state.carry):
            raise RuntimeError(f"call {name!r}: carried rows are outside this rank's slots {ctx.ids}")
        # A synchronous plan's generation of iteration t reads the parameters after t train steps; a layout of its
        # own is not told the version then (only snapshots carry it), so it is the iteration.
        state.version = handle.version if self.plan_staleness else ctx.iteration
        ctx.partial = state
        _, tp_rank, pp_rank = handle.coords
        self.writes[name] = (tp_rank == 0 and pp_rank == 0, ctx.ids)

    def save(self, ckpt: Path, iteration: int) -> None:
        for name, state in self.states.items():
            writer, ids = self.writes[name]
            if writer:
                path = ckpt / PARTIAL_DIR / name / f"{ids.start}-{ids.stop}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                checkpoint.write_file_durably(path, state.dump(iteration, ids).encode())

    def load(self, ckpt: Path, verify: bool) -> None:
        root = ckpt / PARTIAL_DIR
        for path in sorted(root.glob("*/*.json")) if root.is_dir() else []:
            if verify:
                checkpoint.verify_file(ckpt, path)
            self.loaded.setdefault(path.parent.name, []).append(path.read_text())
