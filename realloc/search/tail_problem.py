"""Long-tail migration in the search problem's arrays (issue 31 item 3; rlhfuse.txt §4, inter-stage fusion).

A generation call whose lengths vary may migrate its tail (``graph/tail.py``). In the search problem that is
one more choice in the call's candidates: ``TailColumns`` says, per candidate, whether it migrates (the index
of its R_t in the grid, or -1), how many devices from the mesh's start keep decoding the tail (m dp replicas
x tp; only single-stage meshes migrate) and the seconds of migration + phase 2. Such a candidate's ``time`` is
phase 1 alone: the mesh runs phase 1, then its first ``width`` devices run the tail while the others are free.

A consumer of a migrating call (``TailSplit``, one per data edge the builder marks: never a train call) whose
mesh shares no device with the tail devices runs in two parts: part 1 on the rows finished at the migration
point, part 2 on the tail rows after the generation ends; the data transfer splits the same way (``share1``,
``share2`` of its pair cost, by rows). Both simulators (``search/reference.py`` with ``tail_reference.py``,
and ``csrc/tail.cpp``) read these arrays; docs/long-tail.md explains the rules.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TailColumns:
    """Per candidate of one generation call: its migration, if any."""

    grid: np.ndarray  # int32: index of R_t in the grid, -1: no migration
    width: np.ndarray  # int32: devices of the tail replicas (m * tp) from dev_lo; 0 without migration
    time: np.ndarray  # float64: migration + phase 2 seconds (the candidate's time is phase 1); 0 without
    # float64: chunked streaming (estimator/chunk_cost.py): seconds from the first split point to the last; empty: none
    lead: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        for f, dtype in (("grid", np.int32), ("width", np.int32), ("time", np.float64), ("lead", np.float64)):
            object.__setattr__(self, f, np.ascontiguousarray(getattr(self, f), dtype=dtype))
        assert self.lead.size in (0, self.grid.size)


@dataclasses.dataclass(frozen=True)
class TailSplit:
    """A consumer that may run in two parts: data edge ``edge`` (producer: a call with TailColumns)."""

    edge: int
    part1: np.ndarray  # float64 [consumer candidates, grid]: part 1 seconds (rows finished at the migration point)
    part2: np.ndarray  # float64 [consumer candidates, grid]: part 2 seconds (the tail rows)
    share1: np.ndarray  # float64 [grid]: the transfer's share before the migration point ((n - R_t) / n)
    share2: np.ndarray  # float64 [grid]: after the generation ends (R_t / n)
    # chunked streaming (estimator/chunk_cost.py): [consumer candidates, grid, j] the work on chunks j+1.. of the
    # chunks before the last split point, [grid, j] the share of the producer's lead (TailColumns.lead) between
    # split j+1 and the last; part 1 is max(part1, max_j(work - lead * share)) (``part1_of``)
    chunk_work: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0, 0)))
    chunk_share: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 0)))

    def __post_init__(self) -> None:
        for f in ("part1", "part2", "share1", "share2", "chunk_work", "chunk_share"):
            object.__setattr__(self, f, np.ascontiguousarray(getattr(self, f), dtype=np.float64))
        assert self.part1.ndim == 2 and self.part1.shape == self.part2.shape
        assert self.share1.shape == self.share2.shape == (self.part1.shape[1],)
        assert self.chunk_work.ndim == 3 and self.chunk_share.ndim == 2

    def part1_of(self, cand: int, g: int, lead: float) -> float:
        """Part 1 seconds of consumer candidate ``cand`` at grid index ``g`` when the producer's lead is ``lead``
        (the C++ side: ``chunk_part1`` in csrc/tail.cpp, the same operations in the same order)."""
        out = float(self.part1[cand, g])
        if self.chunk_work.size:
            for j in range(self.chunk_work.shape[2]):
                out = max(out, float(self.chunk_work[cand, g, j]) - lead * float(self.chunk_share[g, j]))
        return out


def tail_to_cpp(problem, cpp) -> None:
    """Hand a SearchProblem's tail arrays to a ``realloc._C.Problem`` (before ``finalize``)."""
    from realloc import _C

    for k, (call, cols) in enumerate(problem.tail_columns):
        cpp.set_tail_call(call, cols.grid, cols.width, cols.time)
        if cols.lead.size:
            _C.set_tail_lead(cpp, k, cols.lead)
    for k, s in enumerate(problem.tail_splits):
        cpp.add_tail_split(s.edge, s.part1, s.part2, s.share1, s.share2)
        if s.chunk_work.size:
            _C.set_split_chunks(cpp, k, s.chunk_work, s.chunk_share)
