"""`realloc profile --clock cpu` and `--model <HF checkpoint directory>` (issue 31: calibrating the estimator on a
shared CPU, benchmarks/bench_eos_lengths.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from realloc.cli import build_parser
from realloc.estimator.profile_cli import build_job, profiled_config
from realloc.estimator.profile_table import ModelArch
from realloc.estimator.profiler import timed
from realloc.models.config import get_model_config

ARITH = str(Path(__file__).resolve().parents[1] / "experiments/data/arith_sft")


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["profile", *argv])


def test_an_hf_checkpoint_is_profiled_with_its_own_shape():
    cfg = profiled_config(ARITH)
    assert cfg.vocab_size == 32 and ModelArch.of(cfg) != ModelArch.of(get_model_config("tiny"))
    job = build_job(parse("--model", ARITH, "--clock", "cpu", "--batch-sizes", "1,256"))
    assert job.clock == "cpu" and job.grid.batch == (1, 256) and max(job.grid.seq) <= cfg.max_position_embeddings


def test_the_cpu_clock_is_for_one_cpu_process():
    assert build_job(parse("--model", "tiny")).clock == "wall"
    with pytest.raises(ValueError, match="--clock cpu .* use it with --device cpu --tp 1"):
        build_job(parse("--model", "tiny", "--tp", "1,2", "--clock", "cpu"))


def test_cpu_time_leaves_out_a_sleep_that_wall_time_counts():
    wall = timed(lambda: time.sleep(0.02), None, 0, 3)
    cpu = timed(lambda: time.sleep(0.02), None, 0, 3, clock=time.process_time)
    assert wall >= 0.02 > 0.01 > cpu
