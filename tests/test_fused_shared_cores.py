"""Fused train pairs on clusters whose devices share CPU cores (csrc/shared_cores.cpp, search/reference.py): the
event-driven simulation runs a fused pair as one node, as the other simulation does (csrc/fused_node.h). The
C++ engine against the Python reference on random shared-core problems with random fused pairs, a hand-computed
fused node slowed by its host, and the space offering the pair on such a cluster."""

from __future__ import annotations

import dataclasses

import numpy as np

from realloc import _C
from realloc.search import reference
from tests.test_fused_search import _two_calls, fused_plan, with_fused_pair
from tests.test_simulator import assert_agrees, random_problem


def test_cpp_matches_python_reference_on_shared_cores_with_fused_pairs():
    rng = np.random.default_rng(3333)
    trials = n_on = n_together = n_stretched = 0
    while trials < 150:
        base = random_problem(rng)
        if not base.shares_cores:
            continue
        p = with_fused_pair(rng, base)
        if p is None:
            continue
        p = dataclasses.replace(p, cores_per_node=base.cores_per_node)  # with_fused_pair leaves no sharing
        trials += 1
        cpp = p.to_cpp()
        for _ in range(3):
            plan = fused_plan(rng, p)
            _, sched = assert_agrees(cpp, p, plan, trials)
            f = p.fused[0]
            if f.on(p, plan):
                n_on += 1
                calls = {(r[1], r[3]): (r[4], r[5]) for r in sched if r[0] == _C.NODE_CALL}
                n_together += all(calls[f.a, t] == calls[f.b, t] for t in range(p.n_iterations))
                nodes = reference._build_nodes(p, plan)
                n_stretched += any(r["end"] - r["start"] > nd.cost + 1e-12 and nd.joint >= 0
                                   for r, nd in zip(reference.schedule(p, plan), nodes))
    # fused nodes happen often, end both calls together, and are sometimes slowed by their host
    assert n_on > 150 and n_together == n_on and n_stretched > 10


def test_a_fused_node_on_an_oversubscribed_host_hand_computed():
    # two devices on one host with one core: a node on both runs at half speed
    p = dataclasses.replace(_two_calls([2.0, 5.0, 5.0], [3.0, 5.0, 5.0], saving=1.0), devices_per_node=2,
                            cores_per_node=1.0)
    assert p.shares_cores
    cpp = p.to_cpp()
    serial, fused = (cpp.evaluate(np.array(x, np.int32)) for x in ([0, 0, 0], [0, 0, 1]))
    assert serial["time"] == 10.0 and fused["time"] == 8.0  # (2 + 3) and (2 + 3 - 1) seconds of work, at rate 1/2
    assert fused == reference.evaluate(p, [0, 0, 1]) and serial == reference.evaluate(p, [0, 0, 0])


def test_the_space_offers_fused_pairs_on_a_cluster_sharing_cores():
    from realloc.api import load_experiment
    from realloc.estimator.cost import CostModel
    from realloc.graph.dataflow import build_graph
    from realloc.search.build import PlanSpace

    spec = load_experiment("experiments/ppo_small.py")
    # 4 devices on the host's 2 cores (ClusterSpec.from_nodelist's split)
    spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, n_devices_per_node=4,
                                                                 cores_per_device=0.5))
    graph = build_graph(spec)
    space = PlanSpace.build(graph, CostModel(graph))
    assert space.problem.shares_cores and len(space.problem.fused) == 1
