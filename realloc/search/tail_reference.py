"""The Python reference of long-tail migration in the plan simulator (``search/tail_problem.py``; the C++ side is
``csrc/tail.cpp``). ``reference._build_nodes`` asks this module for the extra nodes and their costs.

Per iteration, a call with TailColumns gets a TAIL node after its call node: the call node runs phase 1 on its
whole mesh and keeps its first ``width`` devices (``hold``) until the TAIL node, which occupies no device of its
own, has run migration + phase 2. Every edge out of the call leaves from the TAIL node, except the part-1
transfers. A consumer with a TailSplit gets a PART_DATA node (the transfer of the rows finished at the
migration point, on the consumer's mesh, after the call node) and a PART node (part 1, on the consumer's mesh);
all of the consumer's other inputs come before PART, and its call node (part 2) waits for PART and for the
transfer of the tail rows. Nodes of a choice not taken cost 0 and pass through, as free transfers do.
"""

from __future__ import annotations

from typing import Sequence

TAIL, PART_DATA, PART = 3, 4, 5


class TailView:
    """What a plan chooses for the tail: per call its grid index (-1: none) and which consumers split."""

    def __init__(self, p, plan: Sequence[int]) -> None:
        self.p, self.plan = p, plan
        self.columns = dict(p.tail_columns)
        self.split_of = {p.data_edges[s.edge][1]: s for s in p.tail_splits}  # consumer -> split

    def grid(self, c: int) -> int:
        cols = self.columns.get(c)
        return -1 if cols is None else int(cols.grid[int(self.plan[c])])

    def tail_devices(self, g: int) -> frozenset[int]:
        """The devices that decode the tail of call ``g`` (empty when it does not migrate)."""
        if self.grid(g) < 0:
            return frozenset()
        lo = int(self.p.candidates[g].dev_lo[int(self.plan[g])])
        return frozenset(range(lo, lo + int(self.columns[g].width[int(self.plan[g])])))

    def lead(self, g: int) -> float:
        """Seconds between the first and the last split point of call ``g``'s chunked streaming (0: none)."""
        cols = self.columns.get(g)
        return float(cols.lead[int(self.plan[g])]) if cols is not None and cols.lead.size else 0.0

    def part1(self, c: int) -> float:
        """Part 1 seconds of split consumer ``c`` under the plan (``TailSplit.part1_of``)."""
        s, g, grid = self.split(c)
        return s.part1_of(int(self.plan[c]), grid, self.lead(g))

    def tail_time(self, g: int) -> float:
        return float(self.columns[g].time[int(self.plan[g])]) if self.grid(g) >= 0 else 0.0

    def split(self, c: int):
        """(split, producer, grid index) if consumer ``c`` runs in two parts under the plan, else None."""
        s = self.split_of.get(c)
        if s is None:
            return None
        g = self.p.data_edges[s.edge][0]
        k = self.p.candidates[c]
        mesh = frozenset(range(int(k.dev_lo[int(self.plan[c])]), int(k.dev_hi[int(self.plan[c])])))
        if self.grid(g) < 0 or mesh & self.tail_devices(g):
            return None
        return s, g, self.grid(g)


def rewire(nodes: list, index: dict, p, K: int) -> None:
    """Move the edges as the module docstring says (after reference._build_nodes linked the plain graph)."""

    def unlink(a: int, b: int) -> None:
        nodes[a].children.remove(b)
        nodes[b].parents.remove(a)

    def link(a: int, b: int) -> None:
        if b not in nodes[a].children:
            nodes[a].children.append(b)
            nodes[b].parents.append(a)

    calls = [c for c, _ in p.tail_columns]
    for t in range(K):
        for g in calls:
            gc, tg = index["call", g, t], index["tail", g, t]
            for u in list(nodes[gc].children):
                unlink(gc, u)
                link(tg, u)
            link(gc, tg)
    for t in range(K):
        for s in p.tail_splits:
            g, c = p.data_edges[s.edge]
            cc, d = index["call", c, t], index["data", s.edge, t]
            d1, c1 = index["part_data", c, t], index["part", c, t]
            for u in list(nodes[cc].parents):
                if u != d:
                    unlink(u, cc)
                    link(u, c1)
            link(index["call", g, t], d1)
            link(d1, c1)
            link(c1, cc)
