"""The README and docs/: the README's first lines and size, every link between the pages, and the quickstart's
commands run as written."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from realloc import cli
from realloc.graph.plan import ExecutionPlan

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Pages the index links to that other branches of this round add; a link to one is allowed to dangle until they
# are merged (then empty this).
ARRIVING: set[str] = set()  # docs pages a branch in flight links before they land


def headings(text: str) -> list[str]:
    """The page's headings, outside code blocks."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.*)", line)):
            out.append(m.group(1))
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(text: str) -> list[str]:
    """The targets of the page's markdown links, outside code blocks and code spans."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def test_the_readme_starts_with_the_two_commands_and_stays_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert lines[:4] == ["# realloc", "",
                         "- Main job (a real tiny RLHF run on the local CPU cluster): `make demo`",
                         "- Tests: `make test`"]
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_every_link_between_the_pages_resolves():
    broken = []
    for page in PAGES:
        for target in links(page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, frag = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not file.exists():
                if file.name not in ARRIVING:
                    broken.append(f"{where} no such file")
                continue
            if frag and file.suffix == ".md" and frag not in {anchor(h) for h in headings(file.read_text())}:
                broken.append(f"{where} no heading with that anchor in {file.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_docs_index_links_every_page():
    index = set(links((REPO / "docs/README.md").read_text()))
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md" and p.name not in index]
    assert not missing, f"docs/README.md does not link {missing}"
    readme = set(links((REPO / "README.md").read_text()))
    assert "docs/README.md" in readme and "docs/performance.md" in readme


def quickstart() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Quickstart"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_quickstart_runs_as_written(tmp_path, monkeypatch):
    commands = quickstart()
    assert [c[:2] for c in commands] == [["realloc", "show"], ["realloc", "search"], ["realloc", "run"],
                                         ["realloc", "trace"], ["realloc", "export"]]
    (tmp_path / "experiments").symlink_to(REPO / "experiments")  # the commands name the repository's files
    monkeypatch.chdir(tmp_path)
    for cmd in commands:
        if cmd[1] == "run":  # the master in its own process, as a user runs it (workers are its children)
            r = subprocess.run([sys.executable, "-m", "realloc", *cmd[1:]], capture_output=True, text=True,
                               timeout=600, env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
            assert r.returncode == 0, f"{shlex.join(cmd)}\n{r.stdout}\n{r.stderr}"
        else:
            assert cli.main(cmd[1:]) == 0, shlex.join(cmd)
    plan = ExecutionPlan.load(tmp_path / "plan.json")
    assert plan.experiment == "TinyGRPO" and {"actor_gen", "actor_train"} <= set(plan.placements)
    metrics = [json.loads(x) for x in (tmp_path / "runs/grpo_tiny/metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4]
    for page in ("plan.html", "trace.html"):
        assert "<html" in (tmp_path / page).read_text().lower(), page
    config = json.loads((tmp_path / "grpo_tiny_actor/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert list((tmp_path / "grpo_tiny_actor").glob("*.safetensors"))
