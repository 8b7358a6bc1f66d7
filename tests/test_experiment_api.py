"""The @auto experiment API (realhf.txt Figure 5) and experiment loading."""

import dataclasses
import textwrap
from pathlib import Path

import pytest

from realloc.api import GENERATE, ModelFunctionCallDef, auto, experiment_spec, load_experiment
from realloc.graph.dataflow import build_graph
from realloc.overrides import load_with_overrides

# every experiment file the repository ships, so that a new one cannot go stale unnoticed
SHIPPED = sorted(str(p.relative_to(Path(__file__).resolve().parents[1]))
                 for p in (Path(__file__).resolve().parents[1] / "experiments").glob("*.py"))


@pytest.fixture(scope="module")
def arith_init(tmp_path_factory):
    """The random model of the demo's SFT stage, built outside the source tree (a second)."""
    from realloc.demo.arith_demo import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("arith"))


# Experiments that start from a checkpoint the repository builds (not ships): validated from one of the same shape.
BUILT_ELSEWHERE = {"experiments/arith_grpo.py", "experiments/arith_sft.py"}  # make demo builds their starts


@pytest.mark.parametrize("path", SHIPPED)
def test_shipped_experiments_validate(path, arith_init):
    spec = load_with_overrides(path, [f"init={arith_init}"] if path in BUILT_ELSEWHERE else [])
    graph = build_graph(spec)
    assert "actor_train" in spec.call_names or spec.call_names == ("rm_train",)  # a reward model trains alone
    if Path(path).name.startswith("ppo_"):
        assert set(spec.call_names) == {"actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train",
                                        "critic_train"}
    if "actor_gen" in spec.call_names:
        assert graph.model_type("actor_train") == graph.model_type("actor_gen")


def test_paper_settings():
    assert load_experiment("experiments/ppo_70b_7b.py").cluster.n_devices == 128
    big = load_experiment("experiments/ppo_7b_34b.py")
    assert big.cluster.n_nodes == 4 and build_graph(big).model_type("critic_inf") == "llama3-34b-critic"
    tiny = load_experiment("experiments/ppo_tiny.py")
    assert tiny.cluster.nodes == ("localhost",) and tiny.cluster.n_devices == 2 and tiny.cluster.device == "cpu"


def test_figure5_style_class_and_defaults():
    @auto(nodelist="com[01-08]", batch_size=256, n_devices_per_node=8, device="a100-80g")
    @dataclasses.dataclass
    class Experiment:
        seed: int = 1

        @property
        def rpcs(self):
            return [ModelFunctionCallDef(name="gen", model_name="actor", model_type="llama7b",
                                         interface_type=GENERATE, input_data=["prompts"], output_data=["seq"])]

    spec = experiment_spec(Experiment)
    assert spec.batch_size == 256 and spec.cluster.n_devices == 64 and spec.config.seed == 1
    assert spec.n_seqs(spec.call("gen")) == 256
    with pytest.raises(ValueError, match="has no call 'train'"):
        spec.call("train")


def test_auto_requires_a_dataclass_with_rpcs():
    with pytest.raises(ValueError, match="must decorate a dataclass"):
        @auto(nodelist="a", batch_size=1)
        class NotDataclass:
            rpcs = property(lambda self: [])
    with pytest.raises(ValueError, match="needs an `rpcs` property"):
        @auto(nodelist="a", batch_size=1)
        @dataclasses.dataclass
        class NoRpcs:
            pass
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        auto(nodelist="a", batch_size=0)


def test_duplicate_call_names():
    @auto(nodelist="a", batch_size=2)
    @dataclasses.dataclass
    class Exp:
        @property
        def rpcs(self):
            c = ModelFunctionCallDef(name="gen", model_name="actor", model_type="tiny", interface_type=GENERATE)
            return [c, c]
    with pytest.raises(ValueError, match="two calls are named 'gen'"):
        experiment_spec(Exp)


def test_load_experiment_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_experiment(str(tmp_path / "nope.py"))
    (tmp_path / "folder.py").mkdir()
    with pytest.raises(ValueError, match="'.*folder.py' is a directory; give the experiment's .py file"):
        load_experiment(str(tmp_path / "folder.py"))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no @auto-decorated dataclass"):
        load_experiment(str(empty))
    two = tmp_path / "two.py"
    two.write_text(textwrap.dedent("""
        import dataclasses
        from realloc.api import auto, ModelFunctionCallDef, GENERATE
        def rpcs(self):
            return [ModelFunctionCallDef(name="g", model_name="a", model_type="tiny", interface_type=GENERATE)]
        @auto(nodelist="localhost", batch_size=4)
        @dataclasses.dataclass
        class A:
            rpcs = property(rpcs)
        @auto(nodelist="localhost", batch_size=8)
        @dataclasses.dataclass
        class B:
            rpcs = property(rpcs)
    """))
    with pytest.raises(ValueError, match="several experiments \\(A, B\\); pick one"):
        load_experiment(str(two))
    assert load_experiment(f"{two}:B").batch_size == 8
    with pytest.raises(ValueError, match="no @auto class 'C'"):
        load_experiment(f"{two}:C")


@pytest.mark.parametrize("body, where, what", [
    ("x = 1 / 0\n", "line 3", "ZeroDivisionError: division by zero"),
    ("import no_such_module_for_realloc\n", "line 3", "ModuleNotFoundError: No module named 'no_such_module_for_realloc'"),
    ("def broken(:\n", "syntax error at line 3", ""),
    ("import sys\nsys.exit(3)\n", "line 4", "called sys.exit(3) while being imported"),
])
def test_errors_in_the_experiment_files_own_code_name_the_file_and_line(tmp_path, body, where, what):
    """The user's mistake, reported as theirs (the CLI prints it in one line and exits 2)."""
    path = tmp_path / "exp.py"
    path.write_text("import dataclasses\nfrom realloc.api import auto\n" + body)
    with pytest.raises(ValueError) as e:
        load_experiment(str(path))
    assert str(e.value).startswith(f"experiment file {path}") and where in str(e.value) and what in str(e.value)


MINIMAL = """
import dataclasses
from realloc.api import auto, ModelFunctionCallDef, GENERATE
{head}
@auto(nodelist="localhost", batch_size={batch})
@dataclasses.dataclass
class Exp:
    @property
    def rpcs(self):
        return [ModelFunctionCallDef(name="g", model_name="a", model_type="tiny", interface_type=GENERATE)]
"""


def test_an_experiment_imports_modules_next_to_it_wherever_realloc_starts(tmp_path, monkeypatch):
    """Workers load the experiment through load_with_overrides too, from the run's own working directory."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # restored after the test
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_sizes_for_realloc_test.py").write_text("BATCH = 12\n")
    exp = folder / "exp.py"
    exp.write_text(MINIMAL.format(head="from my_sizes_for_realloc_test import BATCH", batch="BATCH"))
    monkeypatch.chdir(tmp_path)  # not the experiment's folder
    assert load_with_overrides(str(exp)).batch_size == 12
    assert load_with_overrides(f"{exp}:Exp", ["batch_size=16"]).batch_size == 16


def test_an_error_in_a_helper_module_is_blamed_on_the_helper(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    (tmp_path / "broken_helper_for_realloc_test.py").write_text("X = 1\ndef f(:\n")
    (tmp_path / "failing_helper_for_realloc_test.py").write_text("X = 1\nY = 1 / 0\n")
    exp = tmp_path / "exp.py"
    exp.write_text(MINIMAL.format(head="import broken_helper_for_realloc_test", batch=4))
    with pytest.raises(ValueError) as e:
        load_experiment(str(exp))
    helper = tmp_path / "broken_helper_for_realloc_test.py"
    assert str(e.value) == (f"experiment file {exp}: importing it failed: syntax error in {helper}, line 2: "
                            f"invalid syntax")
    exp.write_text(MINIMAL.format(head="import failing_helper_for_realloc_test", batch=4))
    with pytest.raises(ValueError) as e:
        load_experiment(str(exp))
    assert str(e.value) == (f"experiment file {exp}, line 4: importing it raised ZeroDivisionError: division by zero "
                            f"(in {tmp_path / 'failing_helper_for_realloc_test.py'}, line 2)")


def test_module_form_errors_are_the_users(tmp_path, monkeypatch, capsys):
    from realloc.cli import main

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "badexp_for_realloc_test.py").write_text("import dataclasses\ndef f(:\n")
    assert main(["show", "badexp_for_realloc_test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["realloc show: error: experiment module badexp_for_realloc_test: syntax error at line 2: "
                   "invalid syntax"]
    (tmp_path / "needs_missing_for_realloc_test.py").write_text("import no_such_module_for_realloc\n")
    with pytest.raises(ValueError, match="experiment module needs_missing_for_realloc_test, line 1: importing it "
                                         "raised ModuleNotFoundError"):
        load_experiment("needs_missing_for_realloc_test")
    with pytest.raises(ValueError, match="no file or module of that name"):
        load_experiment("no_such_experiment_module_for_realloc")
def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_loading_showing_and_planning_the_arithmetic_experiments_writes_nothing(capsys):
    """They used to build the tokenizer or the initial checkpoint into experiments/data/arith/ when loaded: now the
    tokenizer and the SFT checkpoint are shipped, and the initial checkpoint, which the repository builds, is named,
    not built, with how to build it."""
    from realloc.cli import main

    repo = Path(__file__).resolve().parents[1]
    before = _tree(repo / "experiments")
    for name in ("sft_tiny", "dpo_tiny"):
        assert main(["show", f"experiments/{name}.py"]) == 0
        assert main(["search", f"experiments/{name}.py", "--dry-run", "--evals", "200", "--threads", "1"]) == 0
    for name, stage in (("arith_sft", "init"), ("arith_grpo", "sft --out experiments/data/arith_sft")):
        spec = load_experiment(f"experiments/{name}.py")
        hint = spec.models["actor"].build_hint
        assert f"`python -m realloc.demo.arith_demo {stage}`" in hint, hint
        if not Path(spec.models["actor"].path).is_dir():  # not built here yet: one line that says how
            assert main(["show", f"experiments/{name}.py"]) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and err.strip().endswith(hint), err
    assert main(["show", "experiments/arith_grpo.py"]) == 0  # its start checkpoint is shipped
    assert _tree(repo / "experiments") == before


def test_a_missing_checkpoint_says_how_to_build_it(tmp_path):
    from realloc.api import HFModel
    from realloc.demo import arith_demo

    @auto(nodelist="localhost", n_devices_per_node=1, batch_size=4, dataset_keys=["sft"])
    @dataclasses.dataclass
    class Exp:
        @property
        def models(self):
            return {"actor": HFModel(str(tmp_path / "missing"), build_hint="build it with `make it`")}

        @property
        def rpcs(self):
            from realloc.algorithms.pairs.dpo import sft_rpcs

            return sft_rpcs()

    with pytest.raises(ValueError) as e:
        build_graph(experiment_spec(Exp))
    missing = tmp_path / "missing"
    assert str(e.value) == f"model 'actor': checkpoint directory {missing} does not exist; build it with `make it`"
    # The stages that the shipped experiments' hints name exist.
    assert [arith_demo.parser().parse_args([s]).stage for s in ("init", "sft")] == ["init", "sft"]


def test_show_checks_an_overridden_start_checkpoint(arith_init, capsys):
    """`realloc show --set init=DIR` validates the experiment as `realloc run --set init=DIR` would run it."""
    from realloc.cli import main

    assert main(["show", "experiments/arith_grpo.py", "--set", f"init={arith_init}", "--set", "batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint actor: {arith_init}" in out and "batch 4 prompts x 8 responses = 32 sequences" in out
    assert main(["show", "experiments/arith_grpo.py", "--set", "init=/nonexistent/sft"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "realloc show: error: model 'actor': checkpoint directory /nonexistent/sft does not exist", err
