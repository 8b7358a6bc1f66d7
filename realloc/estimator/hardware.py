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


def profiles_dir() -> Path:
    """The profiles folder: ``$REALLOC_PROFILES`` or the repository's ``profiles/``."""
    env = os.environ.get("REALLOC_PROFILES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "profiles"


class HardwareSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = HARDWARE_SPEC_VERSION
    name: str
    kind: Literal["cpu", "gpu"]
    dtype: Literal["fp32", "bf16", "fp16"]
    memory_bytes: int = Field(gt=0)
    peak_flops: float = Field(gt=0, description="dense matmul FLOP/s in `dtype`")
    memory_bandwidth: float = Field(gt=0, description="device memory bytes/s")
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per device, one direction")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per device, one direction")
    intra_node_latency: float = Field(ge=0, description="seconds per collective inside a node")
    inter_node_latency: float = Field(ge=0, description="seconds per collective across nodes")
    default_devices_per_node: int = Field(gt=0)
    cores_per_device: int = Field(gt=0)
    compute_efficiency: float = Field(default=0.6, gt=0, le=1, description="achieved/peak FLOP/s for large matmuls")
    memory_efficiency: float = Field(default=0.7, gt=0, le=1, description="achieved/peak bytes/s for decode")
    notes: str = ""

    @property
    def bytes_per_param(self) -> int:
        return 4 if self.dtype == "fp32" else 2


def known_device_kinds(root: Path | None = None) -> list[str]:
    return sorted(p.stem for p in ((root or profiles_dir()) / "hardware").glob("*.json"))


def load_hardware_spec(kind: str, root: Path | None = None) -> HardwareSpec:
    path = (root or profiles_dir()) / "hardware" / f"{kind}.json"
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
