"""Streaming without migration in a run (issue 31 item 2; a ``tail`` entry with instances=0,
docs/tail-semantics.md): the generation on device 0 hands the rows finished at the split point to the inference
calls on device 1, which run on them while it decodes the rest; the run equals the unstreamed one (samples,
metrics, the whole checkpoint with optimizer state), for PPO and GRPO."""

from __future__ import annotations

import re

import pytest
from test_streaming import N_ITER, R_T, _experiment, _run, assert_inference_in_two_parts, assert_same_runs


DEVICE_0 = ("localhost:0", 1, 1, 1, 1)  # disaggregated: generation on device 0, inference on device 1


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_streamed_run_matches_the_unstreamed_run(tmp_path, algo):
    exp = _experiment(tmp_path, algo)
    streamed = _run(tmp_path, exp, "streamed", {"actor_gen": (R_T, 0)}, DEVICE_0)
    plain = _run(tmp_path, exp, "plain", {}, DEVICE_0)
    # the inference calls on device 1 ran twice per iteration: on the rows finished at the split point (the first
    # step after which at most R_T rows run), then on the rest; device 0's generation took a second request, for
    # the rows still running at the split point
    assert_inference_in_two_parts(streamed)
    second = re.findall(r"iteration \d+ call actor_gen rows", (streamed / "logs" / "worker0.log").read_text())
    assert len(second) == N_ITER
    assert_same_runs(streamed, plain)
