"""benchmarks/fresh_profile.py: a benchmark's models profiled now, on a small grid around its shapes, into a
``--profiles`` folder (issue 33: estimates at the machine's current speed; docs/fused-training.md).

The grid is enough for bench_fused_train's estimates: the shipped ``small`` table cut down to the grid's points
gives the same serial and fused estimates as the whole table (every lookup interpolates inside the grid)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import fresh_profile  # noqa: E402

from realloc.api import load_experiment  # noqa: E402
from realloc.estimator.cost import CostModel  # noqa: E402
from realloc.estimator.hardware import PROFILES_ENV, shipped_profiles_dir  # noqa: E402
from realloc.estimator.profile_table import ProfileTable, discover_profiles  # noqa: E402
from realloc.graph.dataflow import build_graph  # noqa: E402


@pytest.mark.parametrize("rows,seq", [(4, 32), (5, 30), (1, 8), (16, 200)])
def test_the_grid_brackets_the_shapes(rows, seq):
    grid = fresh_profile.grid_around(rows, seq)
    batch = [int(x) for x in grid["batch-sizes"].split(",")]
    lens = [int(x) for x in grid["seq-lens"].split(",")]
    assert batch[0] <= rows <= batch[-1] and lens[0] <= seq <= lens[-1] and min(lens) >= 8
    assert len(batch) <= 3 and len(lens) <= 3


def _cut(table: ProfileTable, grid: dict[str, str]) -> ProfileTable:
    """``table`` with only the points a profile on ``grid`` measures (decode: its cache lengths)."""
    raw = table.model_dump()
    keep_b = {int(x) for x in grid["batch-sizes"].split(",")}
    for sub in raw["tp"].values():
        for key, g in sub["ops"].items():
            want = {int(x) for x in grid["ctx-lens" if key.endswith("decode") else "seq-lens"].split(",")}
            bi = [i for i, b in enumerate(g["batch"]) if b in keep_b]
            si = [j for j, s in enumerate(g["seq"]) if s in want]
            if key.startswith("interface.") or not si:  # fixed axes (generated tokens; flat ops)
                si = list(range(len(g["seq"])))
            g["seconds"] = [[g["seconds"][i][j] for j in si] for i in bi]
            g["batch"], g["seq"] = [g["batch"][i] for i in bi], [g["seq"][j] for j in si]
    return ProfileTable.model_validate(raw)


def test_bench_fused_trains_estimates_read_only_the_grids_points():
    import bench_fused_train as bench

    spec = load_experiment(str(REPO / "experiments/ppo_small.py"))
    graph = build_graph(spec)
    rows = spec.batch_size // graph.call(bench.PAIR[0]).n_minibatches // 4
    full = ProfileTable.load(shipped_profiles_dir() / "cpu" / "small.json")
    cut = _cut(full, fresh_profile.grid_around(rows, spec.seq_len))
    assert len(cut.tp[1].ops["block.fwd"].batch) < len(full.tp[1].ops["block.fwd"].batch)
    others = [t for t in discover_profiles("cpu", shipped_profiles_dir()) if t.model_type != "small"]
    ps = bench.plans(graph, spec.cluster.nodes[0], 4)
    a = bench.estimates(CostModel(graph, [full, *others]), graph, ps, 4)[0]
    b = bench.estimates(CostModel(graph, [cut, *others]), graph, ps, 4)[0]
    assert a.keys() == b.keys() == {"serial 1F1B", "fused"}
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-9)


def test_profile_models_writes_a_profiles_folder_the_estimator_reads(tmp_path, monkeypatch):
    seen = []

    def fake_cli(argv):  # realloc profile itself is tested elsewhere (tests/test_profile*.py); here, its options
        seen.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        table = ProfileTable.load(shipped_profiles_dir() / "cpu" / "small.json")
        table.model_copy(update={"meta": {**table.meta, "created": "2099-01-01T00:00:00+00:00"}}).save(out)
        return 0

    monkeypatch.setattr(fresh_profile.cli, "main", fake_cli)
    monkeypatch.setenv(PROFILES_ENV, "")  # so that monkeypatch removes it again after the test: delenv of an
    monkeypatch.delenv(PROFILES_ENV)  # unset variable records nothing to undo, and use() below leaked it
    graph = build_graph(load_experiment(str(REPO / "experiments/ppo_small.py")))
    assert fresh_profile.model_types(graph) == ["small"]  # the critic shares the actor's table
    folder = fresh_profile.profile_models(fresh_profile.model_types(graph), tmp_path / "p", rows=4, seq=32)
    argv = seen[0]
    assert argv[:3] == ["profile", "--model", "small"] and argv[argv.index("--batch-sizes") + 1] == "2,4,8"
    assert argv[argv.index("--seq-lens") + 1] == "16,32,64" and argv[argv.index("--tp") + 1] == "1"
    hardware = "hardware/cpu.json"
    assert (folder / hardware).read_text() == (shipped_profiles_dir() / hardware).read_text()
    fresh_profile.use(folder)  # sets the variable monkeypatch removes after the test (delenv above)
    small = next(t for t in CostModel(graph).profiles if t.model_type == "small")
    assert small.meta["created"].startswith("2099")
    assert "small taken 2099-01-01T00:00" in fresh_profile.profile_note(CostModel(graph))
