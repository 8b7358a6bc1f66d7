"""3D-parallel strategies and their enumeration for one call on one mesh.

Rank order inside a mesh follows Megatron: tp fastest, then dp, then pp, so a
tp group is a run of consecutive devices and never leaves a node when tp
divides the per-node width of the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from realloc.models.config import ModelConfig, tp_error


@dataclasses.dataclass(frozen=True, order=True)
class ParallelStrategy:
    dp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelStrategy.{field} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        """Mesh-local rank of a (dp, tp, pp) coordinate."""
        assert 0 <= dp_rank < self.dp and 0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of a mesh-local rank."""
        assert 0 <= rank < self.world_size
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return dp_rank, tp_rank, pp_rank

    def __str__(self) -> str:
        return f"dp{self.dp}·tp{self.tp}·pp{self.pp}"


def even_ranges(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``range(n)`` into ``parts`` contiguous [lo, hi) ranges whose sizes differ by at most one.

    Earlier ranges take the remainder. Pipeline stages, dp shares of a batch and
    micro-batches all split this way, so they agree on boundaries everywhere.
    """
    assert parts >= 1
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategy_error(model: ModelConfig, strategy: ParallelStrategy, devices_per_node_in_mesh: int) -> str | None:
    """Why ``strategy`` cannot hold ``model`` on a mesh, or None if it can."""
    err = tp_error(model, strategy.tp)
    if err:
        return err
    if devices_per_node_in_mesh % strategy.tp:
        return f"tp={strategy.tp} must divide the {devices_per_node_in_mesh} devices the mesh uses per node"
    if strategy.pp > model.n_layers:
        return f"pp={strategy.pp} exceeds the {model.n_layers} layers of {model.name}"
    return None


def micro_batch_options(n_seqs: int, dp: int, max_n_mbs: int = 64) -> list[int]:
    """Micro-batch counts m (powers of two) such that each dp rank's share splits into m equal parts."""
    if n_seqs % dp:
        return []
    per_rank = n_seqs // dp
    out, m = [], 1
    while m <= min(per_rank, max_n_mbs):
        if per_rank % m == 0:
            out.append(m)
        m *= 2
    return out


def enumerate_strategies(model: ModelConfig, world_size: int, devices_per_node_in_mesh: int,
                         n_seqs: int) -> Iterator[ParallelStrategy]:
    """Every valid (dp, tp, pp) of ``world_size`` devices for a call over ``n_seqs`` sequences.

    ``n_seqs`` is the number of sequences processed in one optimizer step (a PPO
    mini-batch) or one inference/generation call; dp must divide it.
    """
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            dp = world_size // (tp * pp)
            s = ParallelStrategy(dp, tp, pp)
            if strategy_error(model, s, devices_per_node_in_mesh) is None and n_seqs % dp == 0:
                yield s
