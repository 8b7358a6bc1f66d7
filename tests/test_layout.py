"""The package's layout, read from its own imports with ``ast``: no import circles, one-way rooms, small files.

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING``. A circle that only type
checkers see is still one a reader has to untangle.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "realloc"
MAX_LINES = 600
# runtime/'s rooms, lowest first: a room imports only rooms before it; the subcommands at runtime/'s top
# level may import any room (realloc/runtime/__init__.py).
RUNTIME_ROOMS = ("wire", "records", "inputs", "transfer", "persist", "control", "launch")
# algorithms/'s rooms, lowest first, the same way; its top level holds the ground every room stands on (which imports
# no room) and, above every room, the table of shipped interfaces (ALGORITHMS_TABLE, which no room imports).
ALGORITHMS_ROOMS = ("rewards", "pg", "ppo", "critic_free", "pairs")
ALGORITHMS_TABLE = ("realloc.algorithms.builtin", "realloc.algorithms.registry")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` counts ``a.b`` when that is a module)."""

    def known(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        for t in targets:
            found = known(t)
            if found is not None and found != name:
                out.add(found)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, colouring modules)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def cycle_message(cycle: list[str], root: Path = ROOT) -> str:
    modules = package_modules(root)
    return "import circle: " + " -> ".join(str(modules[m].relative_to(root.parent)) for m in cycle)


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, cycle_message(cycle)


def test_the_circle_check_finds_and_names_a_planted_circle(tmp_path):
    pkg = tmp_path / "realloc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from realloc.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("def f():\n    import realloc.a\n")
    (pkg / "d.py").write_text("from realloc import a, c\n")  # imports into a circle, but is not in it
    cycle = find_cycle(import_graph(pkg))
    assert cycle is not None and set(cycle) == {"realloc.a", "realloc.sub.b", "realloc.c"}
    message = cycle_message(cycle, pkg)
    for f in ("realloc/a.py", "realloc/sub/b.py", "realloc/c.py"):
        assert f in message
    (pkg / "c.py").write_text("def f():\n    import realloc.d\n")  # d -> a -> b -> c -> d
    assert set(find_cycle(import_graph(pkg))) == {"realloc.a", "realloc.sub.b", "realloc.c", "realloc.d"}
    (pkg / "c.py").write_text("import realloc\n")  # the package itself is no circle
    assert find_cycle(import_graph(pkg)) is None


def test_no_package_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these files (over {MAX_LINES} lines): {long}"


def test_the_estimator_imports_nothing_from_the_runtime():
    bad = {m: sorted(d for d in deps if d.startswith("realloc.runtime"))
           for m, deps in import_graph().items() if m.startswith("realloc.estimator")}
    assert not {m: d for m, d in bad.items() if d}


def test_the_algorithms_never_import_the_experiment_api():
    bad = {m: sorted(deps) for m, deps in import_graph().items()
           if m.startswith("realloc.algorithms") and "realloc.api" in deps}
    assert not bad


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["realloc", "runtime"] and parts[2] in RUNTIME_ROOMS else None


def test_runtime_rooms_import_one_way():
    assert {p.name for p in (ROOT / "runtime").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(RUNTIME_ROOMS)
    wrong = []
    for m, deps in import_graph().items():
        here = room(m)
        if m.startswith("realloc.runtime") and here is None and m != "realloc.runtime":
            assert m.endswith("_cli"), f"{m}: runtime/'s top level holds only the subcommands; put it in a room"
        if here is None:
            continue
        for d in deps:
            there = room(d)
            if there is not None and RUNTIME_ROOMS.index(there) > RUNTIME_ROOMS.index(here):
                wrong.append(f"{m} -> {d}")
            if d.startswith("realloc.runtime") and there is None and d != "realloc.runtime":
                wrong.append(f"{m} -> {d} (a subcommand)")
    assert not wrong, "runtime rooms import only the rooms below them: " + "; ".join(sorted(wrong))


@pytest.mark.parametrize("name", ["realloc.graph", "realloc.search", "realloc.estimator", "realloc.models",
                                  "realloc.algorithms", "realloc.data"])
def test_lower_packages_never_import_the_runtime(name):
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if m.startswith(name)
                 for d in deps if d.startswith("realloc.runtime"))
    assert not bad


def algorithms_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["realloc", "algorithms"] and parts[2] in ALGORITHMS_ROOMS \
        else None


def algorithms_room_errors(graph: dict[str, set[str]]) -> list[str]:
    """Imports that break algorithms/'s order: a room importing a later room or the table, the ground a room."""
    wrong = []
    for m, deps in graph.items():
        if not m.startswith("realloc.algorithms."):
            continue
        here = algorithms_room(m)
        for d in deps:
            there = algorithms_room(d)
            if here is None and there is not None and m not in ALGORITHMS_TABLE:
                wrong.append(f"{m} -> {d} (the top level below the rooms)")
            elif here is not None and d in ALGORITHMS_TABLE:
                wrong.append(f"{m} -> {d} (the table)")
            elif here is not None and there is not None and \
                    ALGORITHMS_ROOMS.index(there) > ALGORITHMS_ROOMS.index(here):
                wrong.append(f"{m} -> {d}")
    return sorted(wrong)


def test_algorithms_rooms_import_one_way():
    folders = {p.name for p in (ROOT / "algorithms").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALGORITHMS_ROOMS)
    wrong = algorithms_room_errors(import_graph())
    assert not wrong, "algorithms rooms import only the top level's ground and the rooms before them: " + \
        "; ".join(wrong)


def test_the_algorithms_room_check_names_each_wrong_way():
    graph = {
        "realloc.algorithms.rewards.a": {"realloc.algorithms.context", "realloc.algorithms.pairs.b"},  # a later room
        "realloc.algorithms.pairs.b": {"realloc.algorithms.ppo.c", "realloc.algorithms.registry"},  # the table
        "realloc.algorithms.common": {"realloc.algorithms.rewards.a"},  # the ground on a room
        "realloc.algorithms.builtin": {"realloc.algorithms.pairs.b"},  # the table may
    }
    assert algorithms_room_errors(graph) == [
        "realloc.algorithms.common -> realloc.algorithms.rewards.a (the top level below the rooms)",
        "realloc.algorithms.pairs.b -> realloc.algorithms.registry (the table)",
        "realloc.algorithms.rewards.a -> realloc.algorithms.pairs.b",
    ]


def test_the_user_apis_old_import_paths_give_the_moved_modules():
    import importlib

    import realloc.algorithms as algorithms

    for old, new in algorithms.OLD_PATHS.items():
        module = importlib.import_module(old)
        assert module is importlib.import_module(new) and module.__spec__.name == new, old
    from realloc.algorithms.ppo.ppo_config import PPOConfig
    from realloc.algorithms.ppo_config import PPOConfig as old_name
    assert old_name is PPOConfig
