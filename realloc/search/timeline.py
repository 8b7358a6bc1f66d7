"""Timelines of a plan, estimated (the simulator's schedule) and measured (a run's requests.jsonl), drawn alike.

One row per device, one box per call, parameter reallocation (hatched), data transfer (grey),
offload/reload and checkpoint, like realhf.txt Figure 13. Call boxes carry the call's name and its
dp/tp/pp and micro-batches; a vertical line marks where each iteration ends. Reallocations and
transfers are often far shorter than calls, so every box is at least ``MIN_WIDTH`` of the time axis
wide. Each panel has its own time axis (a run's measured seconds and the estimate's can differ several
times over, and a shared axis squeezed the shorter to a sliver); ``common_scale`` puts them on one, and the
titles say which. A legend names the colours, and a box carries its call's name (and strategy) only where the
text fits inside it. ``.svg`` and ``.png`` are drawn with matplotlib; ``.html`` is an SVG written here whose
boxes show call, strategy, iteration and times on hover.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from realloc import _C
from realloc.atomic_file import naming
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import ExecutionPlan, validate_plan
from realloc.search.turns_report import turn_boxes

SUFFIXES = (".svg", ".png", ".html")
MIN_WIDTH = 0.004  # of the time axis: a 5 ms transfer in a 10 s iteration stays visible
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")
OTHER_COLOURS = {"realloc": "#ffffff", "data": "#d3d3d3", "offload": "#add8e6", "reload": "#add8e6",
                 "save": "#f5deb3", "eval": "#c7e9c0", "tools": "#fff7bc"}
KIND_NAMES = {"realloc": "parameter reallocation", "data": "data transfer", "offload": "offload/reload",
              "save": "checkpoint", "eval": "evaluation", "tools": "environment steps (multi-turn)"}


@dataclasses.dataclass(frozen=True)
class Box:
    kind: str  # call | realloc | data | offload | reload | save | eval | tools
    label: str  # the call, or what moved
    lo: int  # device rows [lo, hi)
    hi: int
    start: float  # seconds from the panel's time zero
    end: float
    iteration: int  # counted from 1
    detail: str = ""  # a call's strategy, e.g. "dp2 tp1 pp1, 2 mb"


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    boxes: tuple[Box, ...]
    iteration_ends: tuple[tuple[int, float], ...]  # (iteration, when it ended)
    devices: tuple[str, ...]  # row names
    calls: tuple[str, ...]  # colour order
    ahead: tuple[str, ...] = ()  # calls that run ahead of training (bounded staleness): labelled with their iteration

    @property
    def span(self) -> float:
        return max([b.end for b in self.boxes] + [e for _, e in self.iteration_ends] + [1e-9])


def shown_label(panel: Panel, b: Box) -> str:
    """A box's name as drawn: a call that runs ahead (a generation under bounded staleness, which lies in an
    earlier iteration's stretch of time) or belongs to an iteration outside the panel's says which iteration."""
    first, last = (panel.iteration_ends[0][0], panel.iteration_ends[-1][0]) if panel.iteration_ends else (0, 0)
    if b.kind == "call" and (b.label in panel.ahead or not first <= b.iteration <= last):
        return f"{b.label} (it {b.iteration})"
    return b.label


def _overlapping(boxes: list[Box], iterations: range) -> tuple[list[Box], float]:
    """The boxes of ``iterations`` and those of other iterations that run during them (with run-ahead, the
    previous iteration's train step beside this one's generation), clipped to that stretch of time, which starts
    at zero; and its end. Leaving the others out drew their devices idle."""
    own = [b for b in boxes if b.iteration in iterations]
    t0 = min((b.start for b in own), default=0.0)
    t1 = max((b.end for b in own), default=0.0)
    out = [dataclasses.replace(b, start=max(b.start, t0) - t0, end=min(b.end, t1) - t0) for b in boxes
           if b.iteration in iterations or (b.end > t0 and b.start < t1)]
    return out, t1 - t0


def check_suffix(path: str | Path, option: str = "--timeline") -> Path:
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{option} {str(path)!r}: use a .svg, .png or .html file")
    return path


def strategy_text(plan: ExecutionPlan, call: str) -> str:
    p = plan.placements[call]
    return f"dp{p.dp} tp{p.tp} pp{p.pp}, {p.n_mbs} mb{', recompute' if p.recompute else ''}"


def device_names(graph: DataflowGraph) -> tuple[str, ...]:
    c = graph.spec.cluster
    return tuple(c.device_name(d) for d in range(c.n_devices))


# -- panels --------------------------------------------------------------------------------------------------
def estimate_plan(graph: DataflowGraph, plan: ExecutionPlan, cost: object | None = None) -> tuple[object, np.ndarray]:
    """The plan space holding exactly ``plan``'s placements, and its indices (for the simulator).

    Offload is not modelled here (as in the search without ``offload``): a plan that offloads is
    estimated as if its models stayed on the device. A long-tail migration is priced at the search's nearest
    grid R_t (``_tail_row``), moving its rows as the runtime will (``TailMigration.moves_kv``: the space prices both
    ways for a hand plan, ``tail_space.with_tail_rows``).
    """
    from realloc.estimator.cost import CostModel
    from realloc.search.build import PlanSpace
    from realloc.search.candidates import Option

    meshes = validate_plan(plan, graph)
    want = {c: Option(meshes[c], p.strategy, p.n_mbs, p.recompute)
            for c, p in ((c, plan.placements[c]) for c in graph.topo_order)}
    space = PlanSpace.build(graph, cost or CostModel(graph), option_filter=lambda c, o: o == want[c],
                            prune_memory=False, offload=False, pp_streams=True).with_staleness(plan.staleness)
    indices = space.fastest()
    names = space.problem.call_names
    for c, name in enumerate(names):  # the plan's long-tail migration, or none (docs/long-tail.md)
        if space.tails and any(t is not None for t in space.tails[c]):
            indices[c] = _tail_row(space, c, plan.tail.get(name))
    for k, f in enumerate(space.problem.fused):  # the plan's fused pairs (docs/fused-training.md)
        indices[space.problem.n_calls + k] = (names[f.a], names[f.b]) in plan.fused
    space.evaluate(indices)  # prices the reallocations, transfers and fused pairs the schedule needs
    return space, indices


def _tail_row(space: object, c: int, want: object) -> int:
    """Call ``c``'s candidate row with migration ``want`` (graph.tail.TailMigration, or None: none). The space
    prices R_t on a grid (estimator/tail_cost.TAIL_GRID); a hand-written R_t off the grid is priced at the nearest
    grid R_t with the same number of replicas and the nearest chunk count (or, lacking one, the nearest of any of the same kind: streaming or
    migration)."""
    rows = range(len(space.problem.candidates[c]))
    if want is None:
        return next(i for i in rows if space.tail_of(c, i) is None)
    tails = [(i, space.tail_of(c, i)) for i in rows if space.tail_of(c, i) is not None]
    # streaming and migration never stand in for each other: a stream entry on a mesh that leaves no device free
    # (no stream row, search/tail_space.py) streams to nobody and is priced as the plain call
    tails = [it for it in tails if it[1].streams_only == want.streams_only]
    if not tails:
        return next(i for i in rows if space.tail_of(c, i) is None)
    # the way the runtime moves the rows (a plan's "auto" moves the caches, graph/tail.py): its own row
    return min(tails, key=lambda it: (it[1].micro_batches != want.micro_batches, it[1].instances != want.instances,
                                      it[1].moves_kv != want.moves_kv,
                                      abs(it[1].chunks - want.chunks),
                                      abs(it[1].rows - want.rows)))[0]


def estimated_panel(space: object, indices: np.ndarray, plan: ExecutionPlan, iterations: int = 3,
                    title: str = "", skip: int = 0) -> Panel:
    """The simulator's schedule of iterations ``skip+1 .. skip+iterations``, time zero at their first start."""
    p = space.problem
    records = space.cpp.schedule(np.asarray(indices, np.int32))
    kinds = {_C.NODE_CALL: "call", _C.NODE_REALLOC: "realloc", _C.NODE_DATA: "data"}
    # A fused pair runs as one node (csrc/fused_node.h): one bar per device, named after both calls.
    on = {p.call_names[f.a]: p.call_names[f.b] for f in p.fused if f.on(p, indices)}
    fused = {a: f"{a} + {b}" for a, b in on.items()}
    boxes = []
    for kind, call, other, it, start, end, lo1, hi1, lo2, hi2 in records:
        if end <= start or kind not in kinds or (kind == _C.NODE_CALL and p.call_names[call] in on.values()):
            continue
        name = p.call_names[call]
        k = kinds[kind]
        label = (fused.get(name, name) if k == "call" else f"realloc {p.model_names[p.call_model[call]]} -> {name}"
                 if k == "realloc" else f"data -> {name}")
        detail = strategy_text(plan, name) if k == "call" else ""
        if name in fused and k == "call":
            detail += f"; fused with {on[name]} ({strategy_text(plan, on[name])}, stages in reverse order)"
        for lo, hi in [(lo1, hi1)] + ([(lo2, hi2)] if hi2 > lo2 else []):
            boxes.append(Box(k, label, lo, hi, start, end, it + 1, detail))
    boxes += turn_boxes(space.cost, plan, boxes)  # a multi-turn call's turns: its environment steps inside it
    boxes, _ = _overlapping(boxes, range(skip + 1, skip + iterations + 1))
    its = range(skip + 1, skip + iterations + 1)
    ends = tuple((t, max((b.end for b in boxes if b.iteration == t), default=0.0)) for t in its)
    spec = space.graph.spec
    ahead = tuple(sorted(space.graph.stale_calls)) if plan.staleness else ()
    return Panel(title or f"{spec.name}: estimated, iterations {its.start}..{its.stop - 1} "
                 f"({ends[-1][1] / iterations:.3f} s/it)", tuple(boxes), ends, device_names(space.graph),
                 tuple(p.call_names) + tuple(fused.values()), ahead)


def measured_panel(requests: Iterable[dict], plan: ExecutionPlan, graph: DataflowGraph, iterations: range,
                   title: str = "") -> Panel:
    """Boxes of requests.jsonl (one per request and participating device) of ``iterations`` (from 1), and those of
    neighbouring iterations that ran meanwhile (``_overlapping``)."""
    near = range(iterations.start - 2 - plan.staleness, iterations.stop + 2 + plan.staleness)
    rows = [r for r in requests if r["iteration"] in near and r["spans"] and r["kind"] in
            ("call", "realloc", "data", "offload", "reload", "save", "eval")]
    if not any(r["iteration"] in iterations for r in rows):
        raise ValueError(f"the run recorded no requests for iterations {iterations.start}..{iterations.stop - 1}")
    boxes = []
    for r in rows:
        detail = strategy_text(plan, r["label"]) if r["kind"] == "call" and r["label"] in plan.placements else ""
        for dev, (s, e) in r["spans"].items():
            boxes.append(Box(r["kind"], r["label"], int(dev), int(dev) + 1, s, e, r["iteration"], detail))
    boxes, _ = _overlapping(boxes, iterations)
    ends = tuple((t, max(b.end for b in boxes if b.iteration == t)) for t in iterations
                 if any(b.iteration == t for b in boxes))
    n = len(ends)
    per_it = (ends[-1][1] - (ends[0][1] if n > 1 else 0.0)) / max(n - 1, 1)
    ahead = tuple(sorted(graph.stale_calls)) if plan.staleness else ()
    return Panel(title or f"{graph.spec.name}: measured, iterations {ends[0][0]}..{ends[-1][0]} "
                 f"({per_it:.3f} s/it{' after the first' if n > 1 else ''})", tuple(boxes), ends,
                 device_names(graph), tuple(graph.topo_order), ahead)


# -- drawing -------------------------------------------------------------------------------------------------
def _colour(panel: Panel, b: Box) -> str:
    if b.kind == "call":
        return TAB10[panel.calls.index(b.label) % 10] if b.label in panel.calls else TAB10[7]
    return OTHER_COLOURS.get(b.kind, "#d3d3d3")


def _tooltip(b: Box) -> str:
    what = f"{b.label} ({b.detail})" if b.detail else b.label
    return (f"{what}\niteration {b.iteration}, {b.kind}\n{b.start:.4f} s .. {b.end:.4f} s "
            f"({(b.end - b.start) * 1e3:.1f} ms)")


def write_timeline(panels: Sequence[Panel], path: str | Path, common_scale: bool = False) -> Path:
    """Draw ``panels`` stacked, each on its own time axis unless ``common_scale``."""
    path = check_suffix(path)
    with naming(path):  # a full disk's failed write names no file
        if path.suffix == ".html":
            path.write_text(timeline_html(panels, common_scale=common_scale))
        else:
            _draw_matplotlib(panels, path, common_scale)
    return path


def _axis_note(panels: Sequence[Panel], common_scale: bool) -> str:
    if len(panels) < 2:
        return ""
    return "  [common time scale]" if common_scale else "  [own time axis]"


def _draw_matplotlib(panels: Sequence[Panel], path: Path, common_scale: bool = False) -> None:
    import matplotlib.pyplot as plt

    fig = timeline_figure(panels, common_scale)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline_figure(panels: Sequence[Panel], common_scale: bool = False) -> object:
    """The matplotlib figure of ``panels`` (at 110 dpi, as saved), one axis per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common = max(p.span for p in panels)
    heights = [min(12.0, 1.4 + 0.28 * len(p.devices)) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, sum(heights) + 0.8), sharex=common_scale, squeeze=False,
                             gridspec_kw={"height_ratios": heights}, dpi=110)
    note = _axis_note(panels, common_scale)
    for ax, panel in zip(axes[:, 0], panels):
        span = common if common_scale else panel.span
        draw_panel(ax, panel, span, title=panel.title + note)
        ax.set_xlim(0, span * 1.01)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, labelbottom=True)
    axes[0, 0].legend(handles=legend_handles(panels), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax, panel in zip(axes[:, 0], panels):
        _label_boxes(ax, panel, renderer)
    return fig


def draw_panel(ax: object, panel: Panel, span: float, title: str | None = None) -> None:
    """One panel's boxes on a matplotlib axis whose time axis covers ``span`` seconds (labels: ``_label_boxes``,
    once the figure's layout fixes how wide a second is)."""
    n_dev = len(panel.devices)
    for b in panel.boxes:
        width = max(b.end - b.start, MIN_WIDTH * span)
        ax.barh(b.lo, width, left=b.start, height=b.hi - b.lo, align="edge", color=_colour(panel, b),
                hatch="////" if b.kind == "realloc" else None, edgecolor="black",
                linewidth=0.4 if b.kind == "call" else 0.3)
    for t, e in panel.iteration_ends:
        ax.axvline(e, color="black", linewidth=1.0)
        ax.text(e, -0.02 * n_dev, f"iteration {t}", ha="right", va="bottom", fontsize=7)
    ax.set_ylim(n_dev, -(0.3 + 0.02 * n_dev))  # room above the rows for the "iteration N" labels
    step = max(1, n_dev // 32)
    ax.set_yticks([d + 0.5 for d in range(0, n_dev, step)])
    ax.set_yticklabels(panel.devices[::step], fontsize=7)
    ax.set_title(panel.title if title is None else title, fontsize=9)


LABEL_FONT = 6  # points
LABEL_PAD = 4  # pixels kept free on each side of a label


def _label_boxes(ax: object, panel: Panel, renderer: object) -> None:
    """Name each call box with the longest text that fits inside it: name and strategy on two lines, the name
    alone, the name upright in a tall narrow box, or nothing (the colour and the legend still say which call)."""
    from matplotlib.font_manager import FontProperties

    prop = FontProperties(size=LABEL_FONT)
    to_px = ax.transData.transform
    for b in panel.boxes:
        if b.kind != "call":
            continue
        (x0, y0), (x1, y1) = to_px((b.start, b.lo)), to_px((b.end, b.hi))
        room_w, room_h = abs(x1 - x0) - 2 * LABEL_PAD, abs(y1 - y0) - 2
        name = shown_label(panel, b)
        for lines in ([name, b.detail] if b.detail else None, [name]):
            if not lines:
                continue
            sizes = [renderer.get_text_width_height_descent(line, prop, ismath=False) for line in lines]
            w = max(s[0] for s in sizes)
            h = sum(s[1] for s in sizes) * 1.25
            if w <= room_w and h <= room_h:
                ax.text((b.start + b.end) / 2, (b.lo + b.hi) / 2, "\n".join(lines), ha="center", va="center",
                        fontsize=LABEL_FONT, clip_on=True)
                break
            if len(lines) == 1 and h <= room_w and w <= room_h:  # a narrow, tall box: the name upright
                ax.text((b.start + b.end) / 2, (b.lo + b.hi) / 2, lines[0], ha="center", va="center",
                        fontsize=LABEL_FONT, rotation=90, clip_on=True)
                break


def legend_handles(panels: Sequence[Panel]) -> list:
    from matplotlib.patches import Patch

    return [Patch(facecolor=colour, hatch="////" if hatched else None, edgecolor="black", label=name)
            for name, colour, hatched in legend_entries(panels)]


def legend_entries(panels: Sequence[Panel]) -> list[tuple[str, str, bool]]:
    """(name, colour, hatched) of every call and every other kind of box the panels draw."""
    calls = list(dict.fromkeys(c for p in panels for c in p.calls))
    kinds = sorted({b.kind for p in panels for b in p.boxes if b.kind not in ("call", "reload")})
    return ([(c, TAB10[i % 10], False) for i, c in enumerate(calls)]
            + [(KIND_NAMES.get(k, k), OTHER_COLOURS[k], k == "realloc") for k in kinds])


HTML_CHAR_PX = 6.6  # width of a character of the 11 px sans-serif labels, generously
HTML_LINE_PX = 13  # a line of those labels


def html_label(b: Box, name: str, width: float, height: float, calls: Sequence[str]) -> list[str]:
    """The lines a box of ``width`` x ``height`` px shows: the longest of the call's ``name`` and strategy on two lines,
    on one, the name alone, the name cut short ("actor_t…", keeping a run-ahead box's "(it 5)", else "it 5"), or
    the call's number in the legend; a reallocation or
    transfer its text or a cut of it. Nothing where not even that fits (the tooltip still says what it was)."""
    def fits(lines: list[str], pad: float = 8) -> bool:
        return max(map(len, lines)) * HTML_CHAR_PX + pad <= width and len(lines) * HTML_LINE_PX + 4 <= height

    options = [[name, b.detail], [f"{name} · {b.detail}"]] if b.detail else []
    base, sep, rest = name.partition(" (it ")  # a run-ahead box keeps its iteration when its name is cut
    suffix = sep + rest
    options += [[name]] + [[base[:k] + "…" + suffix] for k in range(len(base) - 2, 1, -1)]
    if suffix:
        options.append([f"it {b.iteration}"])
    got = next((lines for lines in options if fits(lines)), [])
    if not got and b.kind == "call" and b.label in calls:  # a number needs no margin to be read
        number = [str(calls.index(b.label) + 1)]
        got = number if fits(number, pad=2) else []
    return got


def _nice_step(span: float, n: int = 6) -> float:
    """A tick step of 1, 2 or 5 times a power of ten giving about ``n`` ticks over ``span``."""
    import math

    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _numbered(entries: list[tuple[str, str, bool]], calls: list[str]) -> list[tuple[str, str, bool]]:
    """The legend with each call's number, the label of its boxes too narrow for a name."""
    return [(f"{calls.index(n) + 1} {n}" if n in calls else n, c, h) for n, c, h in entries]


def timeline_html(panels: Sequence[Panel], width: int = 1200, common_scale: bool = False) -> str:
    """A page with a legend and one SVG per panel, each on its own time axis unless ``common_scale``; hovering a
    box shows what it was. Each box is a ``<g class="box">`` carrying its call, strategy, iteration and kind as
    ``data-`` attributes and a tooltip, and the longest label that fits (``html_label``)."""
    common = max(p.span for p in panels) * 1.01
    left, right, row, top = 150, 30, 18, 28
    plot_w = width - left - right
    note = _axis_note(panels, common_scale)
    calls = list(dict.fromkeys(c for p in panels for c in p.calls))  # numbered as in the legend
    dashed = ' stroke-dasharray="2,1"'
    legend = " ".join(
        f'<span style="white-space:nowrap;margin-right:14px"><svg width="14" height="12"><rect x="0.5" y="0.5" '
        f'width="13" height="11" fill="{colour}" stroke="black" stroke-width="0.5"{dashed if hatched else ""}/>'
        f'</svg> {html.escape(name)}</span>' for name, colour, hatched in _numbered(legend_entries(panels), calls))
    parts = [f'<p style="font-family:sans-serif;font-size:12px">{legend}</p>']
    for panel in panels:
        span = common if common_scale else panel.span * 1.01
        x = lambda t, span=span: left + plot_w * t / span  # noqa: E731 - seconds to pixels
        n_dev = len(panel.devices)
        height = top + row * n_dev + 30
        svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'font-family="sans-serif" font-size="11">']
        for d, name in enumerate(panel.devices):
            svg.append(f'<text x="{left - 6}" y="{top + row * d + 13}" text-anchor="end">{html.escape(name)}</text>')
        for b in panel.boxes:
            w = max(plot_w * (b.end - b.start) / span, plot_w * MIN_WIDTH)
            y, h = top + row * b.lo, row * (b.hi - b.lo)
            fill = _colour(panel, b)
            style = ' stroke-dasharray="2,1"' if b.kind == "realloc" else ""
            svg.append(f'<g class="box" data-kind="{b.kind}" data-call="{html.escape(b.label)}" '
                       f'data-strategy="{html.escape(b.detail)}" data-iteration="{b.iteration}">'
                       f'<title>{html.escape(_tooltip(b))}</title><rect x="{x(b.start):.1f}" y="{y}" '
                       f'width="{w:.1f}" height="{h}" fill="{fill}" stroke="black" stroke-width="0.5"{style}/>')
            lines = html_label(b, shown_label(panel, b), w, h, calls)
            if lines:
                cx, first = x(b.start) + w / 2, y + h / 2 + 4 - HTML_LINE_PX * (len(lines) - 1) / 2
                spans = "".join(f'<tspan x="{cx:.1f}" y="{first + HTML_LINE_PX * i:.1f}">{html.escape(line)}</tspan>'
                                for i, line in enumerate(lines))
                svg.append(f'<text class="label" text-anchor="middle" pointer-events="none">{spans}</text>')
            svg.append("</g>")
        for t, e in panel.iteration_ends:
            svg.append(f'<line x1="{x(e):.1f}" x2="{x(e):.1f}" y1="{top - 6}" y2="{top + row * n_dev}" '
                       f'stroke="black"/><text x="{x(e) - 3:.1f}" y="{top - 9}" text-anchor="end">'
                       f'iteration {t}</text>')
        axis_y = top + row * n_dev + 16
        step = _nice_step(span)
        ticks = [k * step for k in range(int(span / step + 1e-9) + 1)]
        for t in ticks:  # anchored so that the first and last labels stay inside the picture
            anchor = "start" if t == 0 else "end" if x(t) + 30 > width else "middle"
            svg.append(f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{top + row * n_dev}" y2="{top + row * n_dev + 4}" '
                       f'stroke="black"/><text x="{x(t):.1f}" y="{axis_y}" text-anchor="{anchor}">{t:g} s</text>')
        svg.append(f'<text x="{left + plot_w / 2:.1f}" y="{axis_y + 13}" text-anchor="middle">seconds</text>')
        svg.append("</svg>")
        parts.append(f"<h3>{html.escape(panel.title + note)}</h3>\n" + "\n".join(svg))
    title = html.escape(panels[0].title)
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head><body>\n"
            f"<p>Hover over a box for its call, strategy, iteration and times.</p>\n" + "\n".join(parts)
            + "\n</body></html>\n")
