"""The fused schedule's point-to-point protocol (models/fused_protocol.py) is deadlock-free under rendezvous
semantics, for every order the schedule search produces.

The checker below is a discrete-event model of the strictest semantics a backend may have, NCCL's: each rank
posts its operations in program order without waiting; between two stage groups every posted operation, both
directions together, completes in the order posted (one stream per pair of ranks), and a send completes only
together with the receive at the head of the peer's queue, which must be the same message (NCCL pairs by order,
not tag); a pass waits until its own receive completed. It runs the very programs ``run_fused`` executes
(``build_programs``) and finds a deadlock as no group able to move while some have operations left. The
protocol before this one (receive right before each pass) deadlocks under it, which shows the checker can fail.
"""

from __future__ import annotations

import random

import pytest

from realloc import _C
from realloc.models.fused_protocol import Op, build_programs, source, target


def rendezvous_run(programs: list[list[Op]]) -> None:
    """Run ``programs`` (one per stage group) under rendezvous semantics; AssertionError on a deadlock, a
    mismatched message or a pass whose receive was never posted."""
    pp = len(programs)
    pc = [0] * pp
    queue: dict[tuple[int, int], list[tuple[str, tuple[int, int, int]]]] = {}
    received: list[set] = [set() for _ in range(pp)]
    posted: list[set] = [set() for _ in range(pp)]
    while True:
        moved = False
        for k, prog in enumerate(programs):
            while pc[k] < len(prog):
                kind, *rest = prog[pc[k]]
                p = tuple(rest)
                if kind == "pass":
                    if source(k, p, pp) is not None and p not in received[k]:
                        assert p in posted[k], f"group {k} runs pass {p} before posting its receive"
                        break
                else:
                    peer = source(k, p, pp) if kind == "recv" else target(k, p, pp)
                    assert peer is not None, f"group {k}: {kind} of pass {p}, which has no such message"
                    queue.setdefault((k, peer), []).append((kind, p))
                    if kind == "recv":
                        posted[k].add(p)
                pc[k] += 1
                moved = True
        for (a, b), qa in queue.items():
            qb = queue.get((b, a), [])
            while qa and qb and qa[0][0] != qb[0][0]:  # a send meets a receive at the heads of both queues
                assert qa[0][1] == qb[0][1], f"groups {a}, {b}: {qa[0]} meets {qb[0]} (NCCL would pair them)"
                kind, p = qa.pop(0)
                qb.pop(0)
                received[a if kind == "recv" else b].add(p)
                moved = True
        if all(pc[k] == len(programs[k]) for k in range(pp)) and not any(queue.values()):
            return
        assert moved, f"deadlock: groups at {[programs[k][pc[k]] if pc[k] < len(programs[k]) else 'end' for k in range(pp)]}"


def receive_before_each_pass(orders) -> list[list[Op]]:
    """The protocol before fused_protocol: each pass receives its input right before it runs."""
    pp = len(orders)
    progs = []
    for k, order in enumerate(orders):
        prog = []
        for p in map(tuple, order):
            prog += [("recv", *p)] if source(k, p, pp) is not None else []
            prog.append(("pass", *p))
            prog += [("send", *p)] if target(k, p, pp) is not None else []
        progs.append(prog)
    return progs


def _orders(pp: int, ma: int, mb: int, seed: int) -> list:
    """The orders the schedule search and its starts give for one setting, with random stage times."""
    rng = random.Random(seed)
    fa = [rng.uniform(0.5, 2.0) for _ in range(pp)]
    fb = [rng.uniform(0.3, 1.5) for _ in range(pp)]
    prob = _C.FusedProblem(pp, pp, ma, fa, [2 * x for x in fa], [1.0] * pp, pp, mb, fb, [2 * x for x in fb],
                           [1.0] * pp)
    out = [prob.greedy(), prob.greedy(primary=1), prob.serial_1f1b()]
    for cap in (float("inf"), 1.3 * prob.search(iterations=0, memory_iterations=0, restarts=1)["serial"]["peak"]):
        out.append(prob.search(iterations=400, memory_iterations=100, restarts=1, seed=seed, memory_cap=cap)["order"])
    return out


SETTINGS = [(pp, ma, mb) for pp in (2, 3, 4, 6) for ma, mb in ((1, 1), (1, 3), (2, 2), (4, 4), (3, 8), (8, 5))]


@pytest.mark.parametrize("pp,ma,mb", SETTINGS)
def test_every_searched_order_runs_without_deadlock_under_rendezvous(pp, ma, mb):
    for order in _orders(pp, ma, mb, seed=pp * 100 + ma * 10 + mb):
        programs = build_programs(order)
        # every pass once, in its group's order
        assert [[tuple(op[1:]) for op in prog if op[0] == "pass"] for prog in programs] == \
            [[tuple(p) for p in stage] for stage in order]
        rendezvous_run(programs)


def test_the_checker_finds_the_deadlock_of_receiving_right_before_each_pass():
    deadlocked = 0
    for pp, ma, mb in SETTINGS:
        for order in _orders(pp, ma, mb, seed=pp * 100 + ma * 10 + mb):
            try:
                rendezvous_run(receive_before_each_pass(order))
            except AssertionError as e:
                assert "deadlock" in str(e)
                deadlocked += 1
    assert deadlocked > 0


def test_an_order_that_cannot_run_is_refused():
    # group 0 waits for the critic's activation before sending the actor's; group 1 the other way round
    order = [[(1, 0, 0), (0, 0, 0), (0, 1, 0), (1, 1, 0)], [(0, 0, 0), (1, 0, 0), (1, 1, 0), (0, 1, 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        build_programs(order)


class _Work:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("group", [0, 1, 2])
def test_the_runtime_posts_its_program_in_order(monkeypatch, group):
    """``run_fused`` issues exactly its group's program: each receive and send, in the program's order, to the
    program's peer with the model's tag (one process; torch.distributed's isend/irecv recorded)."""
    from types import SimpleNamespace

    import torch

    from realloc.models import fused_pipeline
    from realloc.models.fused_pipeline import FusedPart

    pp, n_mbs = 3, (3, 2)
    order = _orders(pp, *n_mbs, seed=7)[-1]
    issued = []
    monkeypatch.setattr(fused_pipeline.dist, "irecv",
                        lambda buf, src, group, tag: issued.append(("recv", src, tag)) or _Work())
    monkeypatch.setattr(fused_pipeline.dist, "isend",
                        lambda t, dst, group, tag: issued.append(("send", dst, tag)) or _Work())
    parts = []
    for m in (0, 1):
        stage = group if m == 0 else pp - 1 - group
        ranks = list(range(pp)) if m == 0 else list(reversed(range(pp)))  # this group is rank ``group``
        groups = SimpleNamespace(pp_group=None, pp=pp, pp_rank=stage, is_first_stage=stage == 0,
                                 is_last_stage=stage == pp - 1, prev_stage_rank=ranks[stage - 1] if stage else None,
                                 next_stage_rank=ranks[stage + 1] if stage < pp - 1 else None)
        link = SimpleNamespace(groups=groups, dtype=torch.float32, device=torch.device("cpu"),
                               forward_tag=11 + 100 * m, backward_tag=12 + 100 * m)
        w = torch.nn.Parameter(torch.ones(2))

        def step(mb, x, w=w, last=stage == pp - 1):
            out = (torch.ones(2) if x is None else x) * w
            return out.sum() if last else out

        parts.append(FusedPart(link, n_mbs[m], step, lambda mb: (2,)))
    fused_pipeline.run_fused(order, parts)
    expected = []
    for kind, m, bw, mb in build_programs(order)[group]:
        if kind != "pass":
            peer = source(group, (m, bw, mb), pp) if kind == "recv" else target(group, (m, bw, mb), pp)
            expected.append((kind, peer, (12 if bw else 11) + 100 * m))
    assert issued == expected and len(issued) > 0
