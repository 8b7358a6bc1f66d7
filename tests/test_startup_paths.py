"""What `realloc run`'s master does before its first call without torch (docs/speed.md), against what the torch
code it replaced computed: the master's modules import neither torch nor transformers, the dataset cache it writes
with numpy holds the bytes torch's writer made and loads into the same batches, and the transfer sizes it
computes match torch's element sizes. A local run's worker 0 serving the rendezvous store is what every local
run test exercises (tests/test_runtime_*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from realloc.data import cache
from realloc.data.config import DataConfig
from realloc.data.prompts import PromptDataset
from realloc.data.records import Ragged
from realloc.data.tokenizer import Tokenizer
from realloc.runtime.transfer.row_layout import ELEMENT_SIZES, row_bytes
from realloc.runtime.wire.protocol import TensorMeta

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "experiments" / "data" / "arith_tokenizer"
TRAIN = REPO / "experiments" / "data" / "arith_train.jsonl"

# The master's path in `realloc run` up to the first call: the CLI, planning, preflight (checkpoint headers,
# tokenizer, the dataset tokenized into the cache), the search, and the Master with its schedule, evaluation and
# checkpoint parts.
MASTER_PATH = """
import sys, json
from pathlib import Path
from realloc.cli import build_parser
from realloc.runtime import run_cli
from realloc.runtime.control.master import Master
from realloc.runtime.launch.launcher import LocalLauncher
from realloc.overrides import load_with_overrides
from realloc.graph.dataflow import build_graph
from realloc.runtime.inputs.run_config import RunConfig
from realloc.runtime.inputs.preflight import preflight
import realloc.search as search
spec = load_with_overrides(sys.argv[1], ("eval.every=5",))
graph = build_graph(spec)
config = RunConfig.of(spec)
pre = preflight(spec, config, graph, cache_dir=Path(sys.argv[2]))
plan = search.search(spec, 0.2, runnable=search.RunLimits())
print(json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules,
                  "line": pre.lines[0]}))
"""


def test_master_path_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", MASTER_PATH, str(REPO / "experiments" / "arith_grpo.py"),
                          str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False and got["transformers"] is False
    assert "prompts" in got["line"]
    assert len(list(tmp_path.glob("prompts-*.safetensors"))) == 1  # tokenized once, for the workers


def _rows() -> list[list[int]]:
    return [[5, 6, 7], [1], [9, 9, 9, 9, 2], [3, 4]]


def test_cache_bytes_equal_torchs_and_load_the_same_batches(tmp_path: Path) -> None:
    rows = _rows()
    ragged = Ragged.build(rows, 16, ["f:1"] * len(rows), ["prompt"] * len(rows))
    # What the torch code wrote: int32 ids, int64 offsets (its cumulative lengths), with the same metadata.
    flat = torch.tensor([x for r in rows for x in r], dtype=torch.int32)
    offsets = torch.cumsum(torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64), 0)
    meta = {"meta": json.dumps({"k": 1})}
    save_file({"prompt.flat": flat, "prompt.offsets": offsets}, str(tmp_path / "torch.safetensors"), metadata=meta)
    cache.write(tmp_path / "numpy.safetensors", ragged.tensors("prompt"), {"k": 1})
    assert (tmp_path / "numpy.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    tensors, _ = cache.read(tmp_path / "numpy.safetensors")
    assert all(isinstance(v, np.ndarray) for v in tensors.values())
    back = Ragged.from_tensors(tensors, "prompt").to_torch()
    assert torch.equal(back.flat, flat) and torch.equal(back.offsets, offsets)
    assert [back.row(i) for i in range(len(rows))] == rows


def test_cached_and_fresh_datasets_give_the_same_batches(tmp_path: Path) -> None:
    tok = Tokenizer.load(TOKENIZER)
    fresh = PromptDataset.load(TRAIN, 8, tokenizer=tok, config=DataConfig())
    PromptDataset.load(TRAIN, 8, tokenizer=tok, config=DataConfig(), cache_dir=tmp_path)  # writes the cache
    cached = PromptDataset.load(TRAIN, 8, tokenizer=tok, config=DataConfig(), cache_dir=tmp_path)  # reads it
    assert len(list(tmp_path.iterdir())) == 1
    assert fresh.stats == cached.stats
    for t in (0, 3):
        a, b = fresh.batch(t, 32, seed=1), cached.batch(t, 32, seed=1)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    # The ids are the tokenizer's own, row by row.
    rows = fresh.batch_rows(0, 4, seed=1).tolist()
    prompts = [json.loads(line)["prompt"] for line in TRAIN.read_text().splitlines()]
    assert [fresh.prompt_tokens(r) for r in rows] == [tok.encode(prompts[r]) for r in rows]


def test_row_bytes_use_torchs_element_sizes() -> None:
    for name, size in ELEMENT_SIZES.items():
        assert torch.empty(0, dtype=getattr(torch, name)).element_size() == size, name
    metas = [TensorMeta(name="tokens", dtype="int64", shape=[12]), TensorMeta(name="logp", dtype="float32", shape=[4]),
             TensorMeta(name="mask", dtype="bool", shape=[4, 3]), TensorMeta(name="x", dtype="float8_e4m3fn", shape=[])]
    assert row_bytes(metas) == 12 * 8 + 4 * 4 + 12 * 1 + 1


def _events(folder: Path) -> list[dict]:
    from google.protobuf.json_format import MessageToDict
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (file,) = folder.glob("events.*")
    out = []
    for e in EventFileLoader(str(file)).Load():
        d = MessageToDict(e)
        d.pop("wallTime")
        out.append(d)
    return out


def test_event_writer_writes_what_torchs_summary_writer_wrote(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from realloc.runtime.records.metric_sinks import EventWriter

    for name, make in (("torch", lambda d, p: SummaryWriter(str(d), purge_step=p)),
                       ("mine", lambda d, p: EventWriter(d, purge_step=p))):
        for purge in (None, 3):
            w = make(tmp_path / f"{name}{purge}", purge)
            w.add_text("config", "    {\n      \"a\": 1\n    }", global_step=purge or 1)
            for step in (3, 4):
                w.add_scalar("train/reward", 0.25 * step, step)
                w.add_scalar("time/actor_gen", 1e-3 / step, step)
            w.flush()
            w.close()
    for purge in (None, 3):
        mine = _events(tmp_path / f"mine{purge}")
        assert len(mine) == 6 + 2 * (purge is not None)  # version, text, 4 scalars (+ the purge's two)
        assert mine == _events(tmp_path / f"torch{purge}")


def test_settle_heap_turns_on_only_a_collector_the_start_up_turned_off() -> None:
    code = ("import gc; from realloc.runtime.records.startup import settle_heap\n"
            "before = gc.get_freeze_count(); settle_heap(); untouched = gc.get_freeze_count() == before\n"
            "gc.disable(); settle_heap(); print(untouched, gc.isenabled(), gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]
