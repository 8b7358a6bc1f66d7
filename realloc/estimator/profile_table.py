"""Measured layer-cost tables (``realloc profile`` output) and lookups into them.

Format (JSON, ``format = "realloc-profile"``, ``version`` = PROFILE_FORMAT_VERSION),
one file per (device kind, model architecture, dtype), holding one sub-table per tp:

    {"format": "realloc-profile", "version": 1,
     "device_kind": "cpu", "model_type": "tiny", "dtype": "fp32",
     "arch": {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 176, "n_heads": 4, "n_kv_heads": 4},
     "tp": {"1": {"ops": {"block.fwd": {"batch": [1, 2, ...], "seq": [8, 16, ...],
                                        "seconds": [[...per seq...] per batch]},
                          "block.decode": {"batch": [...], "seq": [cache lengths], "seconds": ...}, ...},
                  "optimizer": [[n_params, seconds], ...]},
            "2": {...}},
     "collectives": [{"op": "all_reduce", "n": 2, "link": "intra", "alpha": 2.1e-4, "beta": 7e-10,
                      "points": [[bytes, seconds], ...]}, ...],
     "meta": {"command": "realloc profile ...", "created": "...", "repeats": 7, ...}}

Op keys are ``<part>.<phase>`` (``opcount.Part`` x ``opcount.Phase``): the
embedding, one decoder block, the LM head and the critic head, each forward,
backward, prefill and one decode step. Times are per device per op, medians
of repeated runs after warm-up, and include the op's tensor-parallel
collectives (they run inside the megatron layers). Every layer is the same, so
the number of layers is not part of the key.

Lookups interpolate linearly between grid points and extrapolate outside the
grid along the roofline: t(q) = t(edge) + k (R(q) - R(edge)) with k the measured
slope over the roofline slope between the two outermost grid points. A
quantity affine in the roofline is therefore extrapolated exactly, and the
roofline supplies the shape (e.g. the quadratic attention term) the grid did
not cover. A tp the table lacks is scaled from the nearest measured tp by the
roofline's compute ratio, with its collectives modelled.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from pathlib import Path
from typing import Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from realloc.atomic_file import write_text_atomically
from realloc.estimator.comm import CollectiveFit, CommModel, Link
from realloc.estimator.hardware import HardwareSpec, profile_dirs
from realloc.estimator.opcount import Part, Phase
from realloc.estimator.roofline import RooflineCosts
from realloc.models.config import ModelConfig

PROFILE_FORMAT = "realloc-profile"
PROFILE_FORMAT_VERSION = 1


class ModelArch(BaseModel):
    """The per-layer shape that layer costs depend on (not the depth, not the critic head)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int | None = None  # only when not hidden_size / n_heads (``ModelConfig.explicit_head_dim``)
    qk_norm: bool | None = None  # True for Qwen3's per-head q/k norms (None: none, as every older table)
    sandwich_norms: bool | None = None  # True for Gemma 3's four norms per block (None: two, as every older table)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "ModelArch":
        return cls(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.explicit_head_dim,
                   qk_norm=cfg.qk_norm or None, sandwich_norms=cfg.sandwich_norms or None)


class OpGrid(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    batch: list[int] = Field(min_length=1)
    seq: list[int] = Field(min_length=1)
    seconds: list[list[float]]

    @model_validator(mode="after")
    def _check(self) -> "OpGrid":
        if sorted(set(self.batch)) != self.batch or sorted(set(self.seq)) != self.seq:
            raise ValueError("batch and seq must be strictly increasing")
        if len(self.seconds) != len(self.batch) or any(len(r) != len(self.seq) for r in self.seconds):
            raise ValueError(f"seconds must be a {len(self.batch)} x {len(self.seq)} grid (batch x seq)")
        if any(v <= 0 for r in self.seconds for v in r):
            raise ValueError("seconds must be positive")
        return self


class TpTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ops: dict[str, OpGrid]
    optimizer: list[tuple[int, float]] = Field(default_factory=list)  # (local parameters, seconds)


class CollectiveEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # "all_reduce_late": an 8-byte all-reduce the ranks enter at different times after computing, alpha its mean
    # seconds from the last arrival (profile_collectives.time_late_all_reduce), beta 0; tables from before lack it
    op: Literal["all_reduce", "all_gather", "broadcast", "p2p", "all_reduce_late"]
    n: int = Field(ge=2)
    link: Link
    alpha: float = Field(ge=0)
    beta: float = Field(ge=0)
    points: list[tuple[float, float]] = Field(default_factory=list)  # (bytes, seconds) medians

    def fit(self) -> CollectiveFit:
        return CollectiveFit(self.op, self.n, self.link, self.alpha, self.beta)


class ProfileTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["realloc-profile"] = PROFILE_FORMAT
    version: int = PROFILE_FORMAT_VERSION
    device_kind: str
    model_type: str
    dtype: Literal["fp32", "bf16", "fp16"]
    arch: ModelArch
    tp: dict[int, TpTable]
    collectives: list[CollectiveEntry] = Field(default_factory=list)
    meta: dict[str, object] = Field(default_factory=dict)

    def matches(self, device_kind: str, cfg: ModelConfig, dtype: str) -> bool:
        return self.device_kind == device_kind and self.arch == ModelArch.of(cfg) and self.dtype == dtype

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, self.to_json())

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> "ProfileTable":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{where}: not a realloc profile table (expected \"format\": \"{PROFILE_FORMAT}\")")
        if raw.get("version") != PROFILE_FORMAT_VERSION:
            raise ValueError(f"{where}: profile format version {raw.get('version')!r} is not supported (this realloc "
                             f"reads version {PROFILE_FORMAT_VERSION}); re-create it with `realloc profile`")
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(map(str, first["loc"]))
            raise ValueError(f"{where}: field {loc!r}: {first['msg']}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ProfileTable":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"profile file {str(path)!r} does not exist; create it with `realloc profile`")
        return cls.from_json(path.read_text(), where=str(path))


def sibling_dtype(hw: HardwareSpec, dtype: str) -> bool:
    """Whether a table of ``hw``'s kind measured in ``dtype`` prices a pool computing in ``hw.dtype`` when no table
    of that dtype exists (issue 32): another of the kind's compute dtypes (``HardwareSpec.dtypes``: each runs at
    the kind's ``peak_flops``) of the same element size, so the same FLOPs at the same rate and the same bytes at
    the same bandwidth; its times are used unscaled (bf16 and fp16 on every shipped GPU kind). A dtype of
    another size (fp32 beside bf16) is priced by the roofline until ``realloc profile --dtype`` measures it."""
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    return dtype != hw.dtype and dtype in hw.compute_dtypes and size.get(dtype) == size[hw.dtype]


def discover_profiles(device_kind: str, root: Path | None = None) -> list[ProfileTable]:
    """Every profile table under ``<profiles>/<device_kind>/``; a model profiled in an earlier folder of
    ``profile_dirs()`` (``--profiles DIR``) hides the shipped table of the same name."""
    found: dict[str, Path] = {}
    for folder in ([root] if root else profile_dirs()):
        for p in sorted((folder / device_kind).glob("*.json")):
            found.setdefault(p.name, p)
    return [ProfileTable.load(p) for _, p in sorted(found.items())]


# -- interpolation -----------------------------------------------------------

def interp_axis(points: Sequence[int], values: Sequence[float], q: float, roof: Callable[[float], float]) -> float:
    """Linear inside ``points``; outside, t(edge) + k (roof(q) - roof(edge)) with k the measured/roofline slope."""
    n = len(points)
    if n == 1:
        r0 = roof(points[0])
        return values[0] * roof(q) / r0 if r0 > 0 else values[0]
    if points[0] <= q <= points[-1]:
        i = min(max(bisect.bisect_right(points, q) - 1, 0), n - 2)
        x0, x1 = points[i], points[i + 1]
        w = (q - x0) / (x1 - x0)
        return values[i] * (1 - w) + values[i + 1] * w
    e, p = (n - 1, n - 2) if q > points[-1] else (0, 1)
    re, rp = roof(points[e]), roof(points[p])
    dv, dr = values[e] - values[p], re - rp
    k = dv / dr if dr != 0 and dv / dr > 0 else (values[e] / re if re > 0 else 0.0)
    return max(values[e] + k * (roof(q) - re), 0.0)


def interp_grid(grid: OpGrid, b: float, s: float, roof: Callable[[float, float], float]) -> float:
    """Bilinear inside the grid, roofline-extrapolated outside (first along batch, then along seq)."""
    rows = [interp_axis(grid.batch, [grid.seconds[i][j] for i in range(len(grid.batch))], b,
                        lambda x, y=y: roof(x, y)) for j, y in enumerate(grid.seq)]
    return interp_axis(grid.seq, rows, s, lambda y: roof(b, y))


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) of seconds = alpha + beta * x, both clamped at 0."""
    if not points:
        raise ValueError("no points to fit")
    if len(points) == 1:
        x, y = points[0]
        return 0.0, y / x if x else 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    beta = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    beta = max(beta, 0.0)
    return max(my - beta * mx, 0.0), beta


class ProfiledCosts:
    """Layer op costs of one model from a measured table, falling back to the roofline where it has no data."""

    source = "profile"

    def __init__(self, table: ProfileTable, cfg: ModelConfig, roofline: RooflineCosts, comm: CommModel) -> None:
        self.table, self.cfg, self.roofline, self.comm = table, cfg, roofline, comm
        # profiles measure full models; a LoRA model's backward skips the frozen weights' gradients (_lora_ratio)
        self._full = None if cfg.lora is None else RooflineCosts(dataclasses.replace(cfg, lora=None), roofline.hw,
                                                                 comm, roofline.eager_decode)
        self._opt = {tp: fit_line(t.optimizer) for tp, t in table.tp.items() if t.optimizer}

    def decode_grid(self, tp: int) -> tuple[int, ...]:
        sub = self.table.tp.get(tp)
        grid = sub.ops.get(f"{Part.BLOCK.value}.{Phase.DECODE.value}") if sub else None
        return tuple(grid.seq) if grid else ()

    def _measured(self, key: str, part: Part, phase: Phase, tp: int, b: int, s: int) -> float | None:
        sub = self.table.tp.get(tp)
        grid = sub.ops.get(key) if sub else None
        if grid is None:
            return None

        def roof(x: float, y: float) -> float:
            c, m = self.roofline.op(part, phase, tp, max(int(round(x)), 1), max(int(round(y)), 1))
            return c + m

        return interp_grid(grid, b, s, roof)

    def op(self, part: Part, phase: Phase, tp: int, b: int, s: int) -> tuple[float, float]:
        key = f"{part.value}.{phase.value}"
        r_comp, r_comm = self.roofline.op(part, phase, tp, b, s)
        # the measured model's roofline splits a measurement into compute and collectives: the full model's for
        # a LoRA model, whose backward then keeps the LoRA share of that compute (_lora_ratio)
        lora = self._full is not None and phase is Phase.BWD
        measured_roof = self._full if lora else self.roofline
        measured = self._measured(key, part, phase, tp, b, s)
        if measured is not None:
            if not lora:
                comm = min(r_comm, measured)
                return measured - comm, comm
            comp = measured - min(measured_roof.op(part, phase, tp, b, s)[1], measured)
            return comp * self._lora_ratio(part, phase, tp, b, s), r_comm
        t0 = self._nearest_tp(key, tp)
        if t0 is None:
            return r_comp, r_comm
        # nearest measured tp: its compute (collectives removed), scaled by the roofline's compute ratio
        m0 = self._measured(key, part, phase, t0, b, s)
        c0, x0 = measured_roof.op(part, phase, t0, b, s)
        comp0 = max(m0 - min(x0, m0), 0.0)
        m_comp = measured_roof.op(part, phase, tp, b, s)[0]
        comp = comp0 * m_comp / c0 if c0 > 0 else comp0
        return (comp * self._lora_ratio(part, phase, tp, b, s) if lora else comp), r_comm

    def _lora_ratio(self, part: Part, phase: Phase, tp: int, b: int, s: int) -> float:
        """What a measured (full-model) backward computes for a LoRA model, relatively: the roofline's compute
        of the LoRA op over the full one's (a LoRA backward has no weight-gradient GEMMs)."""
        assert self._full is not None
        full = self._full.op(part, phase, tp, b, s)[0]
        return self.roofline.op(part, phase, tp, b, s)[0] / full if full > 0 else 1.0

    def _nearest_tp(self, key: str, tp: int) -> int | None:
        """The profiled tp closest to ``tp`` (the smaller on a tie) whose table has ``key``, or None."""
        have = [t for t, sub in self.table.tp.items() if key in sub.ops]
        return min(have, key=lambda t: (abs(t - tp), t)) if have else None

    def engine(self, key: str, tp: int, b: int, s: int) -> float | None:
        """A measured engine overhead at (b, s), linear in tokens outside the grid; the nearest tp's if
        ``tp`` was not profiled; None if the table has none."""
        t0 = self._nearest_tp(key, tp)
        if t0 is None:
            return None
        grid = self.table.tp[t0].ops[key]
        if grid.seq == [1]:  # depends on the batch only
            return interp_grid(grid, b, 1, lambda x, y: x)
        return interp_grid(grid, b, s, lambda x, y: x * y)

    def interface(self, key: str, tp: int, gen_len: int) -> float | None:
        """A measured interface overhead (``profiler.INTERFACE_KEYS``) of a call whose sequences have
        ``gen_len`` generated tokens, linear beyond the measured lengths; the nearest tp's if ``tp`` was
        not profiled; None if the table has none."""
        t0 = self._nearest_tp(key, tp)
        if t0 is None:
            return None
        grid = self.table.tp[t0].ops[key]
        return interp_axis(grid.seq, grid.seconds[0], gen_len, lambda y: y)

    def optimizer(self, n_params: int) -> float:
        if not self._opt:
            return self.roofline.optimizer(n_params)
        # the Adam step does not depend on tp except through n_params; any tp's fit applies
        alpha, beta = self._opt[min(self._opt)]
        return alpha + beta * n_params
