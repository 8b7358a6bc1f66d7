"""The HTML timeline in a real headless browser (Chromium from the distribution's packages; `.ci/run` installs it
where it can, this test installs nothing and is skipped, saying why, without it): every box's element carries its
call and strategy (attributes and tooltip) as the panel built by hand says, every call box shows a label, and each
label, measured by the browser's own text layout, lies inside its box."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from realloc.search.timeline import Box, Panel, timeline_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run "
                                "installs it where it can)")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")

# Each box's element, its label's lines and bounding box, and its rectangle, as the browser laid them out.
MEASURE = """<script>
const out = [];
for (const g of document.querySelectorAll("g.box")) {
  const r = g.querySelector("rect").getBBox(), t = g.querySelector("text.label");
  const b = t ? t.getBBox() : null;
  out.push({call: g.dataset.call, strategy: g.dataset.strategy, iteration: g.dataset.iteration,
            kind: g.dataset.kind, title: g.querySelector("title").textContent,
            lines: t ? [...t.querySelectorAll("tspan")].map(s => s.textContent) : [],
            rect: [r.x, r.y, r.width, r.height], label: b ? [b.x, b.y, b.width, b.height] : null});
}
const pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def _panel() -> Panel:
    """Run-ahead generations (their labels name their iteration): a wide two-device one (room for name and
    strategy), a narrow one (its name cut short, its iteration kept); a one-device train step (one line), a narrow
    inference (its name cut short), a call 9 px wide (its number) and a reallocation 2 px wide (a tooltip only)."""
    boxes = (Box("call", "actor_gen", 0, 2, 0.0, 4.0, 1, "dp1 tp2 pp1, 4 mb"),
             Box("call", "ref_inf", 0, 1, 4.0, 4.3, 1, "dp1 tp1 pp1, 1 mb"),
             Box("call", "rew_inf", 1, 2, 4.0, 4.08, 1, "dp1 tp1 pp1, 1 mb"),
             Box("realloc", "realloc actor -> actor_train", 0, 2, 4.3, 4.32, 1),
             Box("call", "actor_gen", 0, 1, 4.4, 5.4, 2, "dp1 tp2 pp1, 4 mb"),
             Box("call", "actor_train", 0, 1, 5.5, 9.0, 1, "dp2 tp1 pp1, 2 mb, recompute"),
             Box("call", "actor_train", 1, 2, 4.32, 9.0, 1, "dp2 tp1 pp1, 2 mb, recompute"))
    return Panel("estimated", boxes, ((1, 9.0),), ("node:0", "node:1"), ("actor_gen", "ref_inf", "rew_inf",
                                                                           "actor_train"), ahead=("actor_gen",))


def test_every_box_carries_its_call_and_strategy_and_labels_fit_in_chromium(tmp_path):
    panel = _panel()
    page = timeline_html([panel], width=1200).replace("</body>", MEASURE + "</body>")
    path = tmp_path / "t.html"
    path.write_text(page)
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                        path.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="measured">(.*?)</pre>', r.stdout, re.S)
    assert m, (r.returncode, r.stderr[-2000:])
    measured = json.loads(m.group(1).replace("&quot;", '"').replace("&gt;", ">").replace("&lt;", "<")
                          .replace("&amp;", "&"))
    assert len(measured) == len(panel.boxes)
    for box, got in zip(panel.boxes, measured):
        assert (got["call"], got["strategy"], got["kind"], got["iteration"]) == (box.label, box.detail, box.kind,
                                                                                   str(box.iteration))
        assert box.label in got["title"] and box.detail in got["title"]
        if box.kind == "call":
            assert got["lines"], box  # every call box has a label, the narrowest included
        if got["label"] is not None:
            x, y, w, h = got["rect"]
            lx, ly, lw, lh = got["label"]
            assert x <= lx and lx + lw <= x + w and y <= ly and ly + lh <= y + h, (got["lines"], got["rect"],
                                                                                   got["label"])
    by_call = {(g["call"], g["iteration"]): g["lines"] for g in measured}
    assert by_call["actor_gen", "1"] == ["actor_gen (it 1)", "dp1 tp2 pp1, 4 mb"]  # two rows high: name, strategy
    assert by_call["actor_gen", "2"] == ["actor_g… (it 2)"]  # 1 s wide: the name cut, the iteration kept
    assert by_call["actor_train", "1"] == ["actor_train · dp2 tp1 pp1, 2 mb, recompute"]  # one row: on one line
    by_call = {g["call"]: g["lines"] for g in measured}
    assert by_call["ref_inf"][0].endswith("…") and "ref_inf".startswith(by_call["ref_inf"][0][:-1])
    assert by_call["rew_inf"] == ["3"]  # its number in the legend
    assert "3 rew_inf" in page
