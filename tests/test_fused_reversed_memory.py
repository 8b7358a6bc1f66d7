"""The second model's stages in reverse order in the simulators' memory (csrc/fused_node.h stage_at,
search/reference.py stage_at): with a fused pair on, the runtime places the second model's stage k on the pair's
stage group pp - 1 - k (graph/fused.second_model_meshes), so its heavy first stage (the embedding) shares a
device with the first model's light last stage. Hand-computed on two devices; the C++ engine and the Python
reference agree on it (and on random problems: tests/test_fused_search.py)."""

from __future__ import annotations

import dataclasses

import numpy as np

from realloc.search import reference
from tests.test_fused_search import _two_calls
from tests.test_simulator import GiB


def _heavy_first_stage():
    """Both models at pp 2 on devices 0-1 (candidate 0): stage 0 holds 2 GiB static and 3 GiB while it runs, stage
    1 nothing static and 1 GiB."""
    p = _two_calls([2.0, 5.0, 5.0], [3.0, 5.0, 5.0], saving=1.0)
    cands = tuple(dataclasses.replace(k, mem_static=[2 * GiB, 0, GiB, GiB], mem_dynamic=[3 * GiB, GiB, GiB, GiB])
                  for k in p.candidates)
    return dataclasses.replace(p, candidates=cands, device_memory=6 * GiB)


def test_the_second_models_stages_are_reversed_on_a_fused_mesh():
    p = _heavy_first_stage()
    cpp = p.to_cpp()
    unfused, fused = np.array([0, 0, 0], np.int32), np.array([0, 0, 1], np.int32)
    # unfused, both stage 0s on device 0: 2 + 2 static, 3 while a call runs; device 1: 1
    mem = cpp.memory(unfused)
    assert mem["device_static"] == [4 * GiB, 0] and mem["device_peak"] == [7 * GiB, GiB]
    ev = cpp.evaluate(unfused)
    assert (ev["peak_memory"], ev["peak_device"], ev["feasible"]) == (7 * GiB, 0, False)
    # fused: the second model's stage 0 on device 1; each device 2 static + the larger of 3 and 1 dynamic
    mem = cpp.memory(fused)
    assert mem["device_static"] == [2 * GiB, 2 * GiB] and mem["device_peak"] == [5 * GiB, 5 * GiB]
    ev = cpp.evaluate(fused)
    assert (ev["peak_memory"], ev["peak_device"], ev["feasible"]) == (5 * GiB, 0, True)
    for plan in (unfused, fused):
        assert cpp.evaluate(plan) == reference.evaluate(p, plan)
        static, peak, _ = reference.device_memory(p, plan)
        assert cpp.memory(plan)["device_static"] == static and cpp.memory(plan)["device_peak"] == peak
