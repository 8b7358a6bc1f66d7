"""The point-to-point protocol of a fused pipeline schedule: each stage group's list of operations.

A fused order (``realloc._C.FusedProblem.search``; rlhfuse.txt §5) says which passes each stage group runs
and in which order. Between two stage groups, the two models' activations and gradients cross in both
directions, in an order no single model's 1F1B pairing covers. This module turns the order into one
*program* per stage group, a list of:

- ``("recv", m, bw, mb)``: post (without waiting) the receive of the input of pass ``(m, bw, mb)``;
- ``("pass", m, bw, mb)``: wait for that receive, if the pass has one, and run the pass;
- ``("send", m, bw, mb)``: post (without waiting) the send of the pass's output;

and each group waits for its posted sends at the end. ``fused_pipeline.run_program`` executes exactly these
lists, on gloo and NCCL alike.

Why no program deadlocks, even under rendezvous semantics (a send completes only once its receive is
posted, and the operations between two groups complete one after the other, in the order posted, as NCCL
runs them on one stream per pair of ranks): the programs come from one timed run of the order (every pass
as soon as its input and its group allow; any positive pass times do). Each message gets the time its
producer ends, and between any two groups every operation is posted in the order of its message's time,
the same order on both sides: a group posts its own sends as its passes end, which is in time order, and
posts the receives due next on each link as soon as everything before them on that link is posted. So all
operations, ordered by time, form one sequence that every group's program follows, which can run to the end
(a pass's input is produced before it starts in the timed run); by induction over that sequence no group
waits forever. A message's receive is posted before the pass that needs it (its time is at most the pass's
start), and the two groups post a link's messages in the same order, so NCCL, which matches messages by
order rather than tag, pairs each send with its own receive. ``tests/test_fused_protocol.py`` checks every
program of the searched orders in a discrete-event model of rendezvous semantics.
"""

from __future__ import annotations

from typing import Sequence

Pass = tuple[int, int, int]  # (model 0/1, backward 0/1, micro-batch)
Op = tuple[str, int, int, int]  # ("recv" | "pass" | "send", model, backward, micro-batch)

# Relative pass times of the timed run that orders the messages; any positive values give a correct program.
_FORWARD_TIME, _BACKWARD_TIME = 1.0, 2.0


def stage_of(group: int, model: int, pp: int) -> int:
    """Model ``model``'s stage on stage group ``group`` (the second model runs its stages in reverse)."""
    return group if model == 0 else pp - 1 - group


def group_of(stage: int, model: int, pp: int) -> int:
    return stage if model == 0 else pp - 1 - stage


def source(group: int, p: Pass, pp: int) -> int | None:
    """The group the input of pass ``p`` on ``group`` comes from (None: the pass has no input)."""
    m, bw, _ = p
    s = stage_of(group, m, pp)
    if bw:
        return None if s == pp - 1 else group_of(s + 1, m, pp)
    return None if s == 0 else group_of(s - 1, m, pp)


def target(group: int, p: Pass, pp: int) -> int | None:
    """The group the output of pass ``p`` on ``group`` goes to (None: it stays here)."""
    m, bw, _ = p
    s = stage_of(group, m, pp)
    if bw:
        return None if s == 0 else group_of(s - 1, m, pp)
    return None if s == pp - 1 else group_of(s + 1, m, pp)


def timed_run(orders: Sequence[Sequence[Pass]]) -> list[list[float]]:
    """Each pass's end time when every group runs its order, each pass as soon as its input has arrived and
    its group's previous pass ended. ValueError when the order cannot run (a pass waits for one that waits
    for it)."""
    pp = len(orders)
    ends: list[list[float]] = [[] for _ in orders]
    done: dict[tuple[int, Pass], float] = {}
    pos = [0] * pp
    progress = True
    while progress:
        progress = False
        for k in range(pp):
            while pos[k] < len(orders[k]):
                p = tuple(orders[k][pos[k]])
                src = source(k, p, pp)
                if src is not None and (src, p) not in done:
                    break
                start = max(ends[k][-1] if ends[k] else 0.0, 0.0 if src is None else done[(src, p)])
                end = start + (_BACKWARD_TIME if p[1] else _FORWARD_TIME)
                ends[k].append(end)
                done[(k, p)] = end
                pos[k] += 1
                progress = True
    stuck = [k for k in range(pp) if pos[k] < len(orders[k])]
    if stuck:
        k = stuck[0]
        raise ValueError(f"fused order: stage group {k}'s pass {tuple(orders[k][pos[k]])} waits for an input "
                         f"that its producer's order never reaches (the order deadlocks)")
    return ends


def build_programs(orders: Sequence[Sequence[Pass]]) -> list[list[Op]]:
    """One program per stage group for the fused ``orders`` (one list of passes per stage group; the
    first model's stage k on group k). See the module docstring for why they cannot deadlock."""
    pp = len(orders)
    ends = timed_run(orders)
    # Every message, keyed by its time: (producer's end, producer group, producer's position) is unique and
    # increases along each group's order.
    links: dict[tuple[int, int], list[tuple[tuple[float, int, int], int, Pass]]] = {}
    for k, order in enumerate(orders):
        for i, raw in enumerate(order):
            p = tuple(raw)
            dst = target(k, p, pp)
            if dst is not None:
                links.setdefault((min(k, dst), max(k, dst)), []).append(((ends[k][i], k, i), k, p))
    # Per group and link: the link's messages in time order, as (sent by this group?, pass).
    queue: list[dict[int, list[tuple[bool, Pass]]]] = [{} for _ in range(pp)]
    for (a, b), msgs in links.items():
        msgs.sort()
        for me, peer in ((a, b), (b, a)):
            queue[me][peer] = [(sender == me, p) for _, sender, p in msgs]
    head = [{peer: 0 for peer in queue[k]} for k in range(pp)]
    programs: list[list[Op]] = []
    for k, order in enumerate(orders):
        prog: list[Op] = []

        def post_receives(peer: int) -> None:
            q, h = queue[k][peer], head[k]
            while h[peer] < len(q) and not q[h[peer]][0]:
                prog.append(("recv", *q[h[peer]][1]))
                h[peer] += 1

        for peer in sorted(queue[k]):
            post_receives(peer)
        for raw in order:
            p = tuple(raw)
            prog.append(("pass", *p))
            dst = target(k, p, pp)
            if dst is not None:
                q, h = queue[k][dst], head[k]
                assert q[h[dst]] == (True, p), "a group's sends follow its order"
                prog.append(("send", *p))
                h[dst] += 1
                post_receives(dst)
        assert all(head[k][peer] == len(queue[k][peer]) for peer in queue[k])
        programs.append(prog)
    return programs
