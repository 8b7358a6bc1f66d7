"""Timeline pictures (issue 22 item 16): each panel on its own time axis (or a stated common one), a legend,
and box labels that fit inside their boxes; the HTML's ticks stay inside the picture. Panels are built by hand:
a measured run 10 s long over an estimate of 2 s (what squeezed the estimate to a sliver on a shared axis)."""

from __future__ import annotations

import re

import pytest

from realloc.search.timeline import (KIND_NAMES, Box, Panel, timeline_figure, timeline_html, write_timeline)

CALLS = ("actor_gen", "ref_inf", "actor_train")
DETAIL = "dp1 tp2 pp1, 4 mb"


def _panel(title: str, scale: float) -> Panel:
    """Two iterations on two devices: a long generation, a short inference, a train step, a reallocation."""
    boxes, ends = [], []
    t = 0.0
    for it in (1, 2):
        for call, length in (("actor_gen", 2.0), ("ref_inf", 0.15), ("actor_train", 2.5)):
            boxes.append(Box("call", call, 0, 2, t * scale, (t + length) * scale, it, DETAIL))
            t += length
        boxes.append(Box("realloc", "realloc actor", 0, 2, t * scale, (t + 0.01) * scale, it))
        t += 0.01
        ends.append((it, t * scale))
    return Panel(title, tuple(boxes), tuple(ends), ("node:0", "node:1"), CALLS)


MEASURED, ESTIMATED = _panel("measured", 10.0 / 9.32), _panel("estimated", 2.0 / 9.32)


@pytest.mark.parametrize("common", [False, True])
def test_png_panels_have_their_own_axis_a_legend_and_labels_that_fit(common):
    import matplotlib.pyplot as plt

    fig = timeline_figure([MEASURED, ESTIMATED], common_scale=common)
    try:
        axes = fig.axes
        spans = [ax.get_xlim()[1] for ax in axes]
        if common:
            assert spans == pytest.approx([10.0 * 1.01, 10.0 * 1.01])
        else:  # each axis ends where its panel does, so the 2 s estimate fills its width
            assert spans == pytest.approx([10.0 * 1.01, 2.0 * 1.01])
        note = "[common time scale]" if common else "[own time axis]"
        assert all(ax.get_title().endswith(note) for ax in axes)
        legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
        assert legend == [*CALLS, KIND_NAMES["realloc"]]
        renderer = fig.canvas.get_renderer()
        labelled = 0
        for ax, panel in zip(axes, (MEASURED, ESTIMATED)):
            calls = [b for b in panel.boxes if b.kind == "call"]
            for text in ax.texts:
                if text.get_text().startswith("iteration"):
                    continue
                labelled += 1
                bb = text.get_window_extent(renderer)
                (cx, _) = ax.transData.inverted().transform(((bb.x0 + bb.x1) / 2, 0))
                box = min(calls, key=lambda b: abs((b.start + b.end) / 2 - cx))
                (x0, y0), (x1, y1) = ax.transData.transform([(box.start, box.hi), (box.end, box.lo)])
                assert text.get_text().split("\n")[0] == box.label
                assert x0 <= bb.x0 and bb.x1 <= x1 and y0 <= bb.y0 and bb.y1 <= y1, (text.get_text(), bb, x0, x1)
        # the 0.15 s inference is too narrow for its name across: upright where that fits (checked to fit above),
        # else unlabelled (its colour and the legend name it)
        upright = [t for ax in axes for t in ax.texts if t.get_text().startswith("ref_inf")]
        assert all(t.get_rotation() == 90 and t.get_text() == "ref_inf" for t in upright)
        # own axes: every long box of both panels is named, with its strategy
        assert labelled - len(upright) >= 4 if common else labelled - len(upright) == 8
    finally:
        plt.close(fig)


def _svg_panels(page: str) -> list[str]:
    return re.findall(r"<svg xmlns.*?</svg>", page, re.S)


@pytest.mark.parametrize("common", [False, True])
def test_html_has_a_legend_per_panel_axes_and_ticks_inside_the_picture(common):
    page = timeline_html([MEASURED, ESTIMATED], width=1200, common_scale=common)
    for name in (*[f"{i} {c}" for i, c in enumerate(CALLS, start=1)], KIND_NAMES["realloc"]):
        assert f"</svg> {name}</span>" in page.split("<h3>")[0], name  # the legend (calls numbered), above the panels
    ends = []
    for svg in _svg_panels(page):
        ticks = [(float(x), anchor, float(v)) for x, anchor, v in
                 re.findall(r'<text x="([\d.]+)" y="\d+" text-anchor="(\w+)">([\d.]+) s</text>', svg)]
        assert ticks[0][2] == 0 and ticks[0][1] == "start"
        x, anchor, _ = ticks[-1]
        assert anchor == "end" or x + 30 <= 1200  # the last tick's label is not cut off at the right edge
        ends.append(ticks[-1][2])
        # every label fits inside its box (6.6 px a character of the 11 px font; a real browser's widths:
        # test_timeline_browser.py)
        for w, h, spans in re.findall(r'width="([\d.]+)" height="(\d+)" fill="#\w+" stroke="black" '
                                      r'stroke-width="0.5"/><text class="label"[^>]*>(.*?)</text>', svg):
            lines = re.findall(r"<tspan [^>]*>([^<]+)</tspan>", spans)
            assert max(map(len, lines)) * 6.6 + 8 <= float(w) and len(lines) * 13 + 4 <= int(h), (lines, w)
    if common:
        assert ends[0] == ends[1]
    else:
        assert ends[0] >= 10 and ends[1] == pytest.approx(2.0)  # the estimate's own axis ends near its 2 s
    labels = re.findall(r'<tspan [^>]*>([^<]+)</tspan>', page)
    assert "actor_gen" in labels and DETAIL in labels  # two rows high: name and strategy on two lines
    # the narrow inference box gets its name cut short, or its number in the legend
    assert any(x in labels for x in ("2", *(f"ref_inf"[:k] + "…" for k in range(2, 6))))


def test_write_timeline_png_and_html(tmp_path):
    png = write_timeline([MEASURED, ESTIMATED], tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[own time axis]" in write_timeline([MEASURED, ESTIMATED], tmp_path / "t.html").read_text()


def test_a_tall_narrow_box_gets_its_name_upright():
    """16 devices and a call 2% of the time axis wide: its name does not fit across, but it does upright."""
    devices = tuple(f"n{d // 8}:{d % 8}" for d in range(16))
    boxes = (Box("call", "actor_gen", 0, 16, 0.0, 9.8, 1, DETAIL), Box("call", "ref_inf", 0, 16, 9.8, 10.0, 1))
    panel = Panel("tall", boxes, ((1, 10.0),), devices, CALLS)
    import matplotlib.pyplot as plt

    fig = timeline_figure([panel])
    try:
        texts = {t.get_text().split("\n")[0]: t for t in fig.axes[0].texts}
        assert texts["ref_inf"].get_rotation() == 90 and texts["actor_gen"].get_rotation() == 0
        bb = texts["ref_inf"].get_window_extent(fig.canvas.get_renderer())
        (x0, _), (x1, _) = fig.axes[0].transData.transform([(9.8, 0), (10.0, 0)])
        assert x0 <= bb.x0 and bb.x1 <= x1
    finally:
        plt.close(fig)


def test_a_panel_shows_what_other_iterations_run_meanwhile_and_says_which_iteration_runs_ahead():
    """Run-ahead (staleness 1): iteration 2's generation runs during iteration 1's train step. The panel of
    iteration 2 alone used to leave that train step out, drawing device 1 idle; now it is drawn (clipped to the
    panel's time), and boxes of other iterations, and every generation running ahead, name their iteration."""
    from realloc.search.timeline import _overlapping, shown_label

    boxes = [Box("call", "actor_gen", 0, 1, 0.0, 1.0, 1), Box("call", "actor_train", 1, 2, 1.0, 3.0, 1),
             Box("call", "actor_gen", 0, 1, 1.0, 2.0, 2), Box("call", "actor_train", 1, 2, 3.0, 5.0, 2),
             Box("call", "actor_gen", 0, 1, 3.0, 4.0, 3), Box("call", "actor_train", 1, 2, 5.0, 7.0, 3)]
    shown, span = _overlapping(boxes, range(2, 3))
    assert span == 4.0
    assert [(b.label, b.iteration, b.start, b.end) for b in shown] == [
        ("actor_train", 1, 0.0, 2.0), ("actor_gen", 2, 0.0, 1.0), ("actor_train", 2, 2.0, 4.0), ("actor_gen", 3, 2.0, 3.0)]
    panel = Panel("p", tuple(shown), ((2, 4.0),), ("d:0", "d:1"), ("actor_gen", "actor_train"), ahead=("actor_gen",))
    assert [shown_label(panel, b) for b in shown] == ["actor_train (it 1)", "actor_gen (it 2)", "actor_train",
                                                      "actor_gen (it 3)"]
