"""The search problem as arrays: what the C++ simulator and MCMC read (csrc/problem.h).

``SearchProblem`` is engine-neutral: ``to_cpp()`` hands it to ``realloc._C`` and
``realloc.search.reference`` evaluates it in plain Python. Building one from an
experiment (candidates and estimator costs) lives in ``realloc.search.build``.

Memory rules (the estimator's, realloc/estimator/cost.py): a model's static memory
sits on the mesh of its *home* call (its first train call, else its first call); every
call adds its dynamic memory while it runs, plus a copy of the parameters when its
layout differs from the home layout. A device's peak is its static memory plus the
largest dynamic memory of the calls that run on it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MEM_PARTS = 3  # per-device memory of a mesh's first pipeline stage, middle stages, last stage


@dataclasses.dataclass(frozen=True)
class CandidateArrays:
    """Every placement one call may take, as columns (one row per candidate)."""

    dev_lo: np.ndarray  # int32, first global device id of the mesh
    dev_hi: np.ndarray  # int32, one past the last
    stage_width: np.ndarray  # int32, devices per pipeline stage (dp * tp)
    layout: np.ndarray  # int32, (mesh, strategy) id within the model: indexes transfer-cost tables
    mesh_id: np.ndarray  # int32
    shape_class: np.ndarray  # int32, (mesh shape, strategy, n_mbs) id
    time: np.ndarray  # float64 seconds
    mem_static: np.ndarray  # int64 (n, 3) bytes per device
    mem_dynamic: np.ndarray  # int64 (n, 3)
    mem_param: np.ndarray  # int64 (n, 3)

    def __post_init__(self) -> None:
        for f, dtype in (("dev_lo", np.int32), ("dev_hi", np.int32), ("stage_width", np.int32),
                         ("layout", np.int32), ("mesh_id", np.int32), ("shape_class", np.int32),
                         ("time", np.float64), ("mem_static", np.int64), ("mem_dynamic", np.int64),
                         ("mem_param", np.int64)):
            object.__setattr__(self, f, np.ascontiguousarray(getattr(self, f), dtype=dtype))
        n = len(self.time)
        for f in ("mem_static", "mem_dynamic", "mem_param"):
            assert getattr(self, f).shape == (n, MEM_PARTS), (f, getattr(self, f).shape)

    def __len__(self) -> int:
        return len(self.time)

    def take(self, rows: np.ndarray) -> "CandidateArrays":
        return CandidateArrays(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class SearchProblem:
    n_devices: int
    device_memory: int
    call_names: tuple[str, ...]  # topological order
    call_model: tuple[int, ...]
    model_names: tuple[str, ...]
    model_home: tuple[int, ...]
    candidates: tuple[CandidateArrays, ...]
    order_edges: tuple[tuple[int, int], ...]  # inside an iteration, no transfer (parameter versions)
    carry_edges: tuple[tuple[int, int], ...]  # (u at t, v at t+1)
    data_edges: tuple[tuple[int, int], ...]  # inside an iteration, through a transfer node
    data_costs: tuple[np.ndarray, ...]  # per data edge: src layouts x dst layouts, seconds
    realloc_costs: tuple[np.ndarray, ...]  # per model: layouts x layouts, seconds
    n_iterations: int = 4
    oom_alpha: float = 100.0

    @property
    def n_calls(self) -> int:
        return len(self.call_names)

    def to_cpp(self):
        """The same problem as a finalized ``realloc._C.Problem``."""
        from realloc import _C

        p = _C.Problem(n_devices=self.n_devices, n_iterations=self.n_iterations, device_memory=self.device_memory,
                       oom_alpha=self.oom_alpha, call_model=np.asarray(self.call_model, np.int32),
                       model_home=np.asarray(self.model_home, np.int32))
        for c, k in enumerate(self.candidates):
            p.set_candidates(c, k.dev_lo, k.dev_hi, k.stage_width, k.layout, k.mesh_id, k.shape_class, k.time,
                             k.mem_static, k.mem_dynamic, k.mem_param)
        for m, table in enumerate(self.realloc_costs):
            p.set_realloc(m, np.asarray(table, np.float64))
        for (u, v), table in zip(self.data_edges, self.data_costs):
            p.add_data_edge(u, v, np.asarray(table, np.float64))
        p.set_edges(np.asarray(self.order_edges, np.int32).reshape(-1, 2),
                    np.asarray(self.carry_edges, np.int32).reshape(-1, 2))
        p.finalize()
        return p
