"""The per-call shortcuts of docs/speed.md give the results of the paths they skip, bit for bit: inference at tp 1
without megatron's autograd Function (``llama.project``) against the same layers run through megatron with autograd
on; and ``realloc search`` without a time stops once converged and says after how long."""

from __future__ import annotations

import argparse

import pytest
import torch

from model_helpers import build_model, tiny_hf_model
from mp_pool import GlooPool
from realloc.search.engine import converged


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with GlooPool(1, tmp_path_factory.mktemp("gloo")) as p:
        yield p


def _shortcut_vs_megatron(ctx, hf_path: str, cache: bool) -> tuple[bool, bool]:
    """Logits of the whole stage and of one cached decode step, without autograd (the shortcut) and with it
    (megatron's layers and the RMSNorm Function): (equal bit for bit, the megatron path was taken)."""
    from realloc.models.hf_io import model_config_from_hf
    from realloc.models.llama import cache_mask

    cfg = model_config_from_hf(hf_path)
    model = build_model(ctx, cfg, 1, 1, 1, hf_path=hf_path)
    stage = model.stage
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (3, 7), generator=g)
    pos = torch.arange(7).expand(3, 7)
    valid = torch.ones(3, 7, dtype=torch.bool)
    outs = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            if cache:
                caches = stage.new_kv_caches(3, 8)
                stage(ids, pos, cache_mask(valid, 0, 7), caches, 0)
                step = torch.ones(3, 8, dtype=torch.bool)
                out = stage(ids[:, -1:], pos[:, -1:] + 1, cache_mask(step, 7, 1), caches, 7)
            else:
                out = stage(ids, pos, None)
        outs.append(out)
    return torch.equal(outs[0], outs[1].detach()), outs[1].requires_grad


@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("cache", [False, True])
def test_inference_without_autograd_equals_megatrons_layers_bit_for_bit(pool, tmp_path_factory, family, tie, cache):
    path = tmp_path_factory.mktemp(f"hf_{family}")
    tiny_hf_model(path, seed=3, family=family, tie=tie, layers=2)  # qwen2: q/k/v biases; tie: the head's weight=
    (same, megatron_ran), = pool.run(_shortcut_vs_megatron, str(path), cache)
    assert megatron_ran and same


def _search_args(**kw) -> argparse.Namespace:
    from realloc.cli import build_parser

    return build_parser().parse_args(["search", "experiments/arith_grpo.py",
                                      *[x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]])


def test_search_without_a_time_stops_once_converged_and_says_after_how_long(capsys, monkeypatch):
    from pathlib import Path

    from realloc.search import search_cli

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    reports = []
    real = search_cli.print_report
    monkeypatch.setattr(search_cli, "print_report", lambda r, n: (reports.append(r), real(r, n)))
    assert search_cli.main(_search_args()) == 0
    out = capsys.readouterr().out
    s = reports[0].stats
    assert converged(s.evals, s.evals_to_best) and s.seconds < search_cli.DEFAULT_TIME
    assert f"search: converged after {s.seconds:.1f} s (the best plan, found after {s.evals_to_best:,} plans" in out
    # a given time is searched in full, and the line is not printed
    assert search_cli.main(_search_args(search_time=0.3)) == 0
    out = capsys.readouterr().out
    assert "converged" not in out and reports[1].stats.seconds >= 0.3
