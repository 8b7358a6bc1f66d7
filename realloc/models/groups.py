"""Process groups owned by one model instance, and a cache that creates them once.

A model instance lives on a device mesh (global ranks ``device_ids``) under a
``ParallelStrategy``. Its groups follow Megatron's rank order (tp fastest, then
dp, then pp; ``ParallelStrategy.coords``):

- tp group: the ``tp`` ranks of one (dp, pp) coordinate,
- dp group: the ``dp`` ranks of one (tp, pp) coordinate,
- pp group: the ``pp`` ranks of one (dp, tp) coordinate, in stage order,
- embedding group: first and last stage of one (dp, tp) coordinate, only when
  embeddings are tied and pp > 1 (the last stage keeps a replica in sync),
- KV replica group: the ``kv_replicas`` consecutive tp ranks that hold the same
  KV head, only when tp exceeds the model's KV heads (their k/v gradients are summed),
- mesh group: every rank of the mesh.

``torch.distributed.new_group`` is collective over the whole default group:
every process must create every group, in the same order, even groups it is not
a member of. :class:`ProcessGroupCache` makes that deterministic: callers name
layouts, the cache derives the rank sets, sorts the missing ones and creates
them. Each process owns one cache (e.g. the model worker), and every process
must make the same sequence of ``ensure_layouts`` calls. A group with a given
rank set is created once and shared by every layout that needs it; that is
safe because one process issues its collectives one at a time, in program
order, like every other member.

Nothing here touches megatron's global ``parallel_state``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Sequence

from realloc.strategy import ParallelStrategy

if TYPE_CHECKING:  # torch in the methods that build groups: the master reads ModelLayout without it
    import torch.distributed as dist

    from realloc.cluster import DeviceMesh
    from realloc.models.config import ModelConfig

RankSet = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """Where a model lives: global ranks of its mesh (in mesh order) and its strategy."""

    device_ids: tuple[int, ...]
    strategy: ParallelStrategy
    tie_embeddings: bool = False
    kv_replicas: int = 1  # tp ranks sharing one KV head (ModelConfig.kv_replicas)

    def __post_init__(self) -> None:
        ids = tuple(int(i) for i in self.device_ids)
        object.__setattr__(self, "device_ids", ids)
        if len(ids) != self.strategy.world_size:
            raise ValueError(f"layout: {len(ids)} device ids {ids} cannot hold strategy {self.strategy} "
                             f"(needs dp*tp*pp = {self.strategy.world_size} devices)")
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"layout: device ids {ids} must be distinct non-negative global ranks")
        if self.kv_replicas < 1 or self.strategy.tp % self.kv_replicas:
            raise ValueError(f"layout: kv_replicas={self.kv_replicas} must divide tp={self.strategy.tp}")

    @classmethod
    def from_mesh(cls, mesh: "DeviceMesh", strategy: ParallelStrategy, tie_embeddings: bool = False) -> "ModelLayout":
        """The layout of a model placed on a ``cluster.DeviceMesh`` (global ranks = its device ids)."""
        return cls(tuple(mesh.device_ids), strategy, tie_embeddings)

    @classmethod
    def for_model(cls, cfg: "ModelConfig", devices: "DeviceMesh | Sequence[int]",
                  strategy: ParallelStrategy) -> "ModelLayout":
        """The layout of ``cfg`` on a mesh (or global ranks): the groups depend on the model's tied
        embeddings and on how many tp ranks share a KV head."""
        ids = devices.device_ids if hasattr(devices, "device_ids") else devices
        return cls(tuple(ids), strategy, cfg.tie_embeddings, cfg.kv_replicas(strategy.tp))

    def kv_replica_ranks(self, dp_rank: int, tp_rank: int, pp_rank: int) -> RankSet:
        """Global ranks holding the same KV head as (dp_rank, tp_rank, pp_rank), in tp order."""
        first = tp_rank - tp_rank % self.kv_replicas
        return tuple(self.global_rank(dp_rank, t, pp_rank) for t in range(first, first + self.kv_replicas))

    def global_rank(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        return self.device_ids[self.strategy.rank(dp_rank, tp_rank, pp_rank)]

    def coords_of(self, global_rank: int) -> tuple[int, int, int] | None:
        """(dp_rank, tp_rank, pp_rank) of a global rank, or None if it is outside the mesh."""
        if global_rank not in self.device_ids:
            return None
        return self.strategy.coords(self.device_ids.index(global_rank))

    def tp_ranks(self, dp_rank: int, pp_rank: int) -> RankSet:
        return tuple(self.global_rank(dp_rank, t, pp_rank) for t in range(self.strategy.tp))

    def dp_ranks(self, tp_rank: int, pp_rank: int) -> RankSet:
        return tuple(self.global_rank(d, tp_rank, pp_rank) for d in range(self.strategy.dp))

    def pp_ranks(self, dp_rank: int, tp_rank: int) -> RankSet:
        return tuple(self.global_rank(dp_rank, tp_rank, p) for p in range(self.strategy.pp))

    def rank_sets(self) -> list[RankSet]:
        """Every group this layout needs, as sorted rank tuples (new_group sorts ranks too)."""
        s = self.strategy
        sets: list[RankSet] = [tuple(sorted(self.device_ids))]
        for p in range(s.pp):
            for d in range(s.dp):
                sets.append(tuple(sorted(self.tp_ranks(d, p))))
                if self.kv_replicas > 1:
                    for t in range(0, s.tp, self.kv_replicas):
                        sets.append(tuple(sorted(self.kv_replica_ranks(d, t, p))))
            for t in range(s.tp):
                sets.append(tuple(sorted(self.dp_ranks(t, p))))
        for d in range(s.dp):
            for t in range(s.tp):
                sets.append(tuple(sorted(self.pp_ranks(d, t))))
                if self.tie_embeddings and s.pp > 1:
                    pr = self.pp_ranks(d, t)
                    sets.append(tuple(sorted((pr[0], pr[-1]))))
        return sets


@dataclasses.dataclass(frozen=True)
class ModelParallelGroups:
    """The groups and coordinates of one process inside one model's layout."""

    layout: ModelLayout
    global_rank: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    mesh_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None
    kv_replica_group: dist.ProcessGroup | None  # None unless tp exceeds the KV heads
    tp_ranks: RankSet  # global ranks, in tp order
    dp_ranks: RankSet  # global ranks, in dp order
    pp_ranks: RankSet  # global ranks, in stage order

    @property
    def strategy(self) -> ParallelStrategy:
        return self.layout.strategy

    @property
    def tp(self) -> int:
        return self.layout.strategy.tp

    @property
    def dp(self) -> int:
        return self.layout.strategy.dp

    @property
    def pp(self) -> int:
        return self.layout.strategy.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_ranks[-1]


class ProcessGroupCache:
    """Creates each process group once per rank set; one instance per process.

    ``ensure_layouts`` and ``ensure_rank_sets`` are collective over the default
    group: every process calls them with the same arguments in the same order.
    """

    def __init__(self, backend: str | None = None, check_consistency: bool = True) -> None:
        self._backend = backend
        self._check = check_consistency
        self._groups: dict[RankSet, dist.ProcessGroup] = {}

    def __contains__(self, ranks: Sequence[int]) -> bool:
        return tuple(sorted(ranks)) in self._groups

    def get(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self._groups:
            raise KeyError(f"process group {key} was not created; call ensure_layouts/ensure_rank_sets on every "
                           f"process first")
        return self._groups[key]

    def ensure_rank_sets(self, rank_sets: Iterable[Sequence[int]]) -> int:
        """Create the groups of ``rank_sets`` not created yet; returns how many were created. Collective."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_process_group before building groups")
        world = dist.get_world_size()
        wanted = set()
        for rs in rank_sets:
            key = tuple(sorted(int(r) for r in rs))
            if not key or key[-1] >= world or key[0] < 0:
                raise ValueError(f"process group ranks {key} fall outside the world of {world} processes")
            wanted.add(key)
        missing = sorted(k for k in wanted if k not in self._groups)
        if self._check and world > 1:
            # A process that skips or reorders a new_group call deadlocks the
            # world; comparing a digest first turns that into an error.
            digest = torch.tensor([len(missing), hash(tuple(missing)) & 0x7FFFFFFF], dtype=torch.int64)
            lo, hi = digest.clone(), digest.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            if not torch.equal(lo, hi):
                raise RuntimeError("processes disagree on which process groups to create; every process must call "
                                   "ensure_layouts with the same layouts in the same order")
        for key in missing:
            self._groups[key] = dist.new_group(list(key), backend=self._backend)
        return len(missing)

    def ensure_layouts(self, layouts: Iterable[ModelLayout]) -> int:
        """Create every group the given layouts need. Collective; see the class docstring."""
        sets: list[RankSet] = []
        for layout in layouts:
            sets.extend(layout.rank_sets())
        return self.ensure_rank_sets(sets)

    def model_groups(self, layout: ModelLayout, global_rank: int | None = None) -> ModelParallelGroups:
        """This process's groups in ``layout``. The layout's groups must already exist (``ensure_layouts``)."""
        import torch.distributed as dist

        rank = dist.get_rank() if global_rank is None else global_rank
        coords = layout.coords_of(rank)
        if coords is None:
            raise ValueError(f"global rank {rank} is not part of layout {layout.device_ids}; build the model only "
                             f"on the mesh's ranks")
        d, t, p = coords
        tp_ranks, dp_ranks, pp_ranks = layout.tp_ranks(d, p), layout.dp_ranks(t, p), layout.pp_ranks(d, t)
        emb = None
        if layout.tie_embeddings and layout.strategy.pp > 1 and p in (0, layout.strategy.pp - 1):
            emb = self.get((pp_ranks[0], pp_ranks[-1]))
        kv = self.get(layout.kv_replica_ranks(d, t, p)) if layout.kv_replicas > 1 else None
        return ModelParallelGroups(
            layout=layout, global_rank=rank, dp_rank=d, tp_rank=t, pp_rank=p,
            tp_group=self.get(tp_ranks), dp_group=self.get(dp_ranks), pp_group=self.get(pp_ranks),
            mesh_group=self.get(layout.device_ids), embedding_group=emb, kv_replica_group=kv,
            tp_ranks=tp_ranks, dp_ranks=dp_ranks, pp_ranks=pp_ranks,
        )
