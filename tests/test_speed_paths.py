"""The per-call shortcuts of docs/speed.md give the results of the paths they skip, bit for bit: megatron's linear
layers at tp 1 without their per-call Python (``tp1_linear.project``), inference and training, against the same
layers' own calls; and ``realloc search`` without a time stops once converged and says after how long."""

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


def _megatron_layers(stage) -> list:
    """A no-op forward hook on every megatron linear layer: ``project`` then takes the layer's own call (as for
    LoRA's hooks), so the same model runs once through the shortcut and once through megatron."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return [m.register_forward_hook(lambda *a: None) for m in stage.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _shortcut_vs_megatron(ctx, hf_path: str) -> dict[str, bool]:
    """Logits of the whole stage and of one cached decode step without autograd, and the loss and every gradient
    of a train-style forward and backward, through the shortcut and through megatron's layers: equal bit for bit?"""
    from realloc.models.hf_io import model_config_from_hf
    from realloc.models.llama import cache_mask

    cfg = model_config_from_hf(hf_path)
    model = build_model(ctx, cfg, 1, 1, 1, hf_path=hf_path)
    stage = model.stage
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (3, 7), generator=g)
    pos = torch.arange(7).expand(3, 7)
    valid = torch.ones(3, 7, dtype=torch.bool)

    def run() -> dict[str, torch.Tensor]:
        out = {}
        with torch.no_grad():
            out["logits"] = stage(ids, pos, None)
            caches = stage.new_kv_caches(3, 8)
            stage(ids, pos, cache_mask(valid, 0, 7), caches, 0)
            out["decode"] = stage(ids[:, -1:], pos[:, -1:] + 1, cache_mask(torch.ones(3, 8, dtype=torch.bool), 7, 1),
                                  caches, 7)
        stage.zero_grad(set_to_none=True)
        logp = torch.log_softmax(stage(ids, pos, None)[:, :-1, :cfg.vocab_size].float(), -1)
        loss = -logp.gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        out["loss"] = loss.detach()
        out.update({n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None})
        return out

    fast = run()
    hooks = _megatron_layers(stage)
    slow = run()
    for h in hooks:
        h.remove()
    assert fast.keys() == slow.keys() and len(fast) > 3
    return {k: torch.equal(fast[k], slow[k]) for k in fast}


@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen2", False)])
def test_the_tp1_shortcut_equals_megatrons_layers_bit_for_bit(pool, tmp_path_factory, family, tie):
    """Inference (whole sequences and a cached decode step) and a forward and backward with autograd, on a tied
    LLaMA (the head's ``weight=``) and a Qwen2 (q/k/v biases)."""
    path = tmp_path_factory.mktemp(f"hf_{family}")
    tiny_hf_model(path, seed=3, family=family, tie=tie, layers=2)
    (same,) = pool.run(_shortcut_vs_megatron, str(path))
    assert all(same.values()), [k for k, v in same.items() if not v]


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


def test_an_early_started_worker_imports_its_preload_first_and_skips_a_missing_name(monkeypatch):
    import io
    import json
    import sys

    from realloc.runtime.records.startup import ARGS_FROM_STDIN, WORKER_PRELOAD, worker_argv

    assert "torch._dynamo" in WORKER_PRELOAD
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(["--rank", "0"]) + "\n"))
    assert worker_argv([ARGS_FROM_STDIN], preload=("no_such_module_here", "colorsys")) == ["--rank", "0"]
    assert "colorsys" in sys.modules
    monkeypatch.delitem(sys.modules, "colorsys")
    assert worker_argv(["--rank", "1"], preload=("colorsys",)) == ["--rank", "1"]  # given arguments: no preload
    assert "colorsys" not in sys.modules


def test_a_worker_whose_arguments_already_arrived_skips_the_preload(monkeypatch):
    import json
    import os
    import sys

    from realloc.runtime.records.startup import ARGS_FROM_STDIN, worker_argv

    r, w = os.pipe()
    os.write(w, (json.dumps(["--rank", "2"]) + "\n").encode())
    os.close(w)
    with os.fdopen(r) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        monkeypatch.delitem(sys.modules, "colorsys", raising=False)
        assert worker_argv([ARGS_FROM_STDIN], preload=("colorsys",)) == ["--rank", "2"]
    assert "colorsys" not in sys.modules  # the master was first: setup imports what it needs itself
