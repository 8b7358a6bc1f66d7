"""Hardware specs of a device kind, read from ``profiles/hardware/<kind>.json``.

These are the defaults a ClusterSpec takes and what the roofline cost model
uses when no measured profile table exists for a device kind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

HARDWARE_SPEC_VERSION = 1


PROFILES_ENV = "REALLOC_PROFILES"


def shipped_profiles_dir() -> Path:
    """The profiles that come with realloc: the repository's ``profiles/`` in a source checkout, the
    package's ``realloc/profiles/`` in an installed wheel (setup.py maps one onto the other)."""
    package = Path(__file__).resolve().parents[1]
    repo = package.parent
    if (repo / "pyproject.toml").is_file() and (repo / "profiles" / "hardware").is_dir():
        return repo / "profiles"
    return package / "profiles"


def profile_dirs() -> list[Path]:
    """Where profiles and hardware specs are looked up, first match wins: ``$REALLOC_PROFILES`` (set by
    ``--profiles DIR``), then the shipped profiles."""
    env = os.environ.get(PROFILES_ENV)
    shipped = shipped_profiles_dir()
    return [Path(env), shipped] if env and Path(env).resolve() != shipped.resolve() else [shipped]


def profiles_dir() -> Path:
    """The first profiles folder searched: ``$REALLOC_PROFILES`` if set, else the shipped one."""
    return profile_dirs()[0]


class HardwareSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = HARDWARE_SPEC_VERSION
    name: str
    kind: Literal["cpu", "gpu"]
    dtype: Literal["fp32", "bf16", "fp16"]
    dtypes: tuple[Literal["fp32", "bf16", "fp16"], ...] = Field(
        default=(), description="the dtypes a pool of this kind may compute in at peak_flops (ClusterSpec.dtype); "
                                "empty: `dtype` only")
    memory_bytes: int = Field(gt=0)
    usable_memory_fraction: float = Field(default=1.0, gt=0, le=1,
                                          description="share of memory_bytes that tensors can use: the rest goes to "
                                                      "the CUDA context, NCCL buffers and allocator fragmentation, "
                                                      "which the memory model (Table 2) does not count")
    peak_flops: float = Field(gt=0, description="dense matmul FLOP/s in `dtype`")
    memory_bandwidth: float = Field(gt=0, description="device memory bytes/s")
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per device, one direction")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per device, one direction")
    intra_node_latency: float = Field(ge=0, description="seconds per collective inside a node")
    inter_node_latency: float = Field(ge=0, description="seconds per collective across nodes")
    default_devices_per_node: int = Field(gt=0)
    cores_per_device: float = Field(gt=0, description="CPU cores per device (at most; see cores_per_node)")
    cores_per_node: int | None = Field(default=None, gt=0,
                                       description="CPU cores of one host, shared by its devices: a cluster of n "
                                                   "devices per node gets min(cores_per_device, cores_per_node / n) "
                                                   "each (CPU devices: one single-threaded process each)")
    compute_efficiency: float = Field(default=0.6, gt=0, le=1, description="achieved/peak FLOP/s for large matmuls")
    memory_efficiency: float = Field(default=0.7, gt=0, le=1, description="achieved/peak bytes/s for decode")
    # The fields below feed the roofline of realloc/estimator/roofline.py. Their
    # defaults make an older spec file read as "no overheads, ideal links".
    comm_efficiency: float = Field(default=1.0, gt=0, le=1,
                                   description="achieved/nominal link bandwidth of a large collective (NCCL bus "
                                               "bandwidth / NVLink or NIC bandwidth)")
    kernel_latency: float = Field(default=0.0, ge=0,
                                  description="seconds: device-side floor of one kernel when launches are free "
                                              "(CUDA-graph replay); on CPU the per-op dispatch cost")
    launch_overhead: float = Field(default=0.0, ge=0,
                                   description="seconds of host time to launch one kernel eagerly; overlaps device "
                                               "work, so it only shows when kernels are tiny (decode)")
    decode_step_overhead: float = Field(default=0.0, ge=0,
                                        description="seconds of host work per generated token per micro-batch "
                                                    "(sampling bookkeeping, stop checks) that no kernel covers")
    call_overhead: float = Field(default=0.0, ge=0,
                                 description="seconds a function call costs beyond its model work: the workers' "
                                             "handling of the request and the interface's own host work where "
                                             "no profile measured it")
    dispatch_latency: float = Field(default=0.0, ge=0,
                                    description="seconds from the end of a call (or reallocation) on its workers "
                                                "until the master has dispatched the requests that waited for it: "
                                                "reply, scheduling, request message (the planner's simulator "
                                                "delays every dependency by it)")
    host_bandwidth: float = Field(default=2.5e10, gt=0,
                                  description="bytes/s of device<->host copies (offloaded parameters)")
    notes: str = ""

    @property
    def compute_dtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.dtype, *self.dtypes)))

    @property
    def bytes_per_param(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def precision(self) -> "Precision":
        return Precision.for_dtype(self.dtype)


class Precision(BaseModel):
    """Bytes per parameter of each kind of training state, for one compute dtype.

    bf16/fp16 follow Megatron mixed precision: half-precision parameters,
    fp32 gradient buffers (``main_grad``; reduced in fp32 across DP) and fp32
    Adam state (master weights, first and second moments). fp32 keeps
    everything in fp32 and needs no master copy. A train call with
    ``TrainConfig.grad_dtype="bf16"`` keeps bf16 gradient buffers, reduced in
    bf16 (``with_grads``; Megatron's ``grad_reduce_in_fp32=False``).
    """

    model_config = ConfigDict(frozen=True)

    param: int  # one parameter in the compute dtype; also one activation element
    grad: int  # one gradient element (the DP all-reduce moves these)
    optimizer: int  # Adam state per parameter, including an fp32 master copy if any (1/dp of it per rank: memory.py)
    logits: int = 4  # logits and log-softmax are computed in fp32

    @classmethod
    def for_dtype(cls, dtype: str) -> "Precision":
        if dtype == "fp32":
            return cls(param=4, grad=4, optimizer=8)
        if dtype in ("bf16", "fp16"):
            return cls(param=2, grad=4, optimizer=12)
        raise ValueError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")

    def with_grads(self, grad_dtype: str) -> "Precision":
        """This precision with gradient buffers of ``grad_dtype`` ("fp32" or "bf16", ``TrainConfig.grad_dtype``);
        bf16 buffers exist only for half-precision parameters (the engine refuses them for fp32 models)."""
        if grad_dtype == "fp32":
            return self.model_copy(update={"grad": 4})
        if grad_dtype != "bf16":
            raise ValueError(f"grad_dtype must be fp32 or bf16, got {grad_dtype!r}")
        if self.param != 2:
            raise ValueError("grad_dtype='bf16' needs a bf16 model (the hardware spec's dtype); fp32 models keep "
                             "fp32 gradients: set grad_dtype to fp32")
        return self.model_copy(update={"grad": 2})

    @property
    def optimizer_step_bytes(self) -> int:
        """Device-memory traffic of one Adam update per parameter.

        Read grad; read+write each fp32 state tensor; write the compute-dtype
        parameter (mixed precision) or read+write it (fp32).
        """
        if self.optimizer == 8:  # fp32: param, m, v read+write, grad read
            return 2 * 4 * 3 + self.grad
        return self.grad + 2 * self.optimizer + self.param


def known_device_kinds(root: Path | None = None) -> list[str]:
    return sorted({p.stem for d in ([root] if root else profile_dirs()) for p in (d / "hardware").glob("*.json")})


def load_hardware_spec(kind: str, root: Path | None = None) -> HardwareSpec:
    paths = [d / "hardware" / f"{kind}.json" for d in ([root] if root else profile_dirs())]
    path = next((p for p in paths if p.is_file()), paths[0])
    if not path.is_file():
        raise ValueError(f"unknown device kind {kind!r}; known kinds: {', '.join(known_device_kinds(root))} "
                         f"(add {path.name} under {path.parent} to define it)")
    try:
        spec = HardwareSpec.model_validate_json(path.read_text())
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"hardware spec {path}: field {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if spec.version != HARDWARE_SPEC_VERSION:
        raise ValueError(f"hardware spec {path} has version {spec.version}; this realloc reads version "
                         f"{HARDWARE_SPEC_VERSION}")
    return spec
