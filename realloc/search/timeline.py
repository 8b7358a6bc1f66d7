"""Timelines of a plan, estimated (the simulator's schedule) and measured (a run's requests.jsonl), drawn alike.

One row per device, one box per call, parameter reallocation (hatched), data transfer (grey),
offload/reload and checkpoint, like realhf.txt Figure 13. Call boxes carry the call's name and its
dp/tp/pp and micro-batches; a vertical line marks where each iteration ends. Reallocations and
transfers are often far shorter than calls, so every box is at least ``MIN_WIDTH`` of the time axis
wide. ``.svg`` and ``.png`` are drawn with matplotlib, panels stacked on one time axis; ``.html`` is
an SVG written here whose boxes show call, strategy, iteration and times on hover.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from realloc import _C
from realloc.graph.dataflow import DataflowGraph
from realloc.graph.plan import ExecutionPlan, validate_plan

SUFFIXES = (".svg", ".png", ".html")
MIN_WIDTH = 0.004  # of the time axis: a 5 ms transfer in a 10 s iteration stays visible
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")
OTHER_COLOURS = {"realloc": "#ffffff", "data": "#d3d3d3", "offload": "#add8e6", "reload": "#add8e6",
                 "save": "#f5deb3", "eval": "#c7e9c0"}
KIND_NAMES = {"realloc": "parameter reallocation", "data": "data transfer", "offload": "offload/reload",
              "save": "checkpoint", "eval": "evaluation"}


@dataclasses.dataclass(frozen=True)
class Box:
    kind: str  # call | realloc | data | offload | reload | save | eval
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

    @property
    def span(self) -> float:
        return max([b.end for b in self.boxes] + [e for _, e in self.iteration_ends] + [1e-9])


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
    return tuple(f"{c.nodes[d // c.n_devices_per_node]}:{d % c.n_devices_per_node}" for d in range(c.n_devices))


# -- panels --------------------------------------------------------------------------------------------------
def estimate_plan(graph: DataflowGraph, plan: ExecutionPlan, cost: object | None = None) -> tuple[object, np.ndarray]:
    """The plan space holding exactly ``plan``'s placements, and its indices (for the simulator).

    Offload is not modelled here (as in the search without ``offload``): a plan that offloads is
    estimated as if its models stayed on the device.
    """
    from realloc.estimator.cost import CostModel
    from realloc.search.build import PlanSpace
    from realloc.search.candidates import Option

    meshes = validate_plan(plan, graph)
    want = {c: Option(meshes[c], p.strategy, p.n_mbs, p.recompute)
            for c, p in ((c, plan.placements[c]) for c in graph.topo_order)}
    space = PlanSpace.build(graph, cost or CostModel(graph), option_filter=lambda c, o: o == want[c],
                            prune_memory=False, offload=False).with_staleness(plan.staleness)
    indices = space.fastest()
    space.evaluate(indices)  # prices the reallocations and transfers the schedule needs
    return space, indices


def estimated_panel(space: object, indices: np.ndarray, plan: ExecutionPlan, iterations: int = 3,
                    title: str = "", skip: int = 0) -> Panel:
    """The simulator's schedule of iterations ``skip+1 .. skip+iterations``, time zero at their first start."""
    p = space.problem
    records = [r for r in space.cpp.schedule(np.asarray(indices, np.int32)) if skip <= r[3] < skip + iterations]
    t0 = min((r[4] for r in records if r[5] > r[4]), default=0.0)
    kinds = {_C.NODE_CALL: "call", _C.NODE_REALLOC: "realloc", _C.NODE_DATA: "data"}
    boxes = []
    for kind, call, other, it, start, end, lo1, hi1, lo2, hi2 in records:
        if end <= start or kind not in kinds:
            continue
        name = p.call_names[call]
        k = kinds[kind]
        label = (name if k == "call" else f"realloc {p.model_names[p.call_model[call]]} -> {name}" if k == "realloc"
                 else f"data -> {name}")
        detail = strategy_text(plan, name) if k == "call" else ""
        for lo, hi in [(lo1, hi1)] + ([(lo2, hi2)] if hi2 > lo2 else []):
            boxes.append(Box(k, label, lo, hi, start - t0, end - t0, it + 1, detail))
    its = range(skip + 1, skip + iterations + 1)
    ends = tuple((t, max((b.end for b in boxes if b.iteration == t), default=0.0)) for t in its)
    spec = space.graph.spec
    return Panel(title or f"{spec.name}: estimated, iterations {its.start}..{its.stop - 1} "
                 f"({ends[-1][1] / iterations:.3f} s/it)", tuple(boxes), ends, device_names(space.graph),
                 tuple(p.call_names))


def measured_panel(requests: Iterable[dict], plan: ExecutionPlan, graph: DataflowGraph, iterations: range,
                   title: str = "") -> Panel:
    """Boxes of requests.jsonl (one per request and participating device) of ``iterations`` (from 1)."""
    rows = [r for r in requests if r["iteration"] in iterations and r["spans"] and r["kind"] in
            ("call", "realloc", "data", "offload", "reload", "save", "eval")]
    if not rows:
        raise ValueError(f"the run recorded no requests for iterations {iterations.start}..{iterations.stop - 1}")
    t0 = min(s for r in rows for s, _ in r["spans"].values())
    boxes = []
    for r in rows:
        detail = strategy_text(plan, r["label"]) if r["kind"] == "call" and r["label"] in plan.placements else ""
        for dev, (s, e) in r["spans"].items():
            boxes.append(Box(r["kind"], r["label"], int(dev), int(dev) + 1, s - t0, e - t0, r["iteration"], detail))
    ends = tuple((t, max(b.end for b in boxes if b.iteration == t)) for t in iterations
                 if any(b.iteration == t for b in boxes))
    n = len(ends)
    per_it = (ends[-1][1] - (ends[0][1] if n > 1 else 0.0)) / max(n - 1, 1)
    return Panel(title or f"{graph.spec.name}: measured, iterations {ends[0][0]}..{ends[-1][0]} "
                 f"({per_it:.3f} s/it{' after the first' if n > 1 else ''})", tuple(boxes), ends,
                 device_names(graph), tuple(graph.topo_order))


# -- drawing -------------------------------------------------------------------------------------------------
def _colour(panel: Panel, b: Box) -> str:
    if b.kind == "call":
        return TAB10[panel.calls.index(b.label) % 10] if b.label in panel.calls else TAB10[7]
    return OTHER_COLOURS.get(b.kind, "#d3d3d3")


def _tooltip(b: Box) -> str:
    what = f"{b.label} ({b.detail})" if b.detail else b.label
    return (f"{what}\niteration {b.iteration}, {b.kind}\n{b.start:.4f} s .. {b.end:.4f} s "
            f"({(b.end - b.start) * 1e3:.1f} ms)")


def write_timeline(panels: Sequence[Panel], path: str | Path) -> Path:
    path = check_suffix(path)
    if path.suffix == ".html":
        path.write_text(timeline_html(panels))
    else:
        _draw_matplotlib(panels, path)
    return path


def _draw_matplotlib(panels: Sequence[Panel], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max(p.span for p in panels)
    heights = [min(12.0, 1.2 + 0.28 * len(p.devices)) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, sum(heights) + 0.6), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, panel in zip(axes[:, 0], panels):
        draw_panel(ax, panel, span)
    axes[0, 0].legend(handles=legend_handles(panels), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    axes[-1, 0].set_xlim(0, span * 1.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_panel(ax: object, panel: Panel, span: float) -> None:
    """One panel on a matplotlib axis whose time axis covers ``span`` seconds."""
    n_dev = len(panel.devices)
    for b in panel.boxes:
        width = max(b.end - b.start, MIN_WIDTH * span)
        ax.barh(b.lo, width, left=b.start, height=b.hi - b.lo, align="edge", color=_colour(panel, b),
                hatch="////" if b.kind == "realloc" else None, edgecolor="black",
                linewidth=0.4 if b.kind == "call" else 0.3)
        if b.kind == "call" and b.end - b.start > 0.05 * span and b.hi - b.lo >= max(1, n_dev // 16):
            text = f"{b.label}\n{b.detail}" if b.detail else b.label
            ax.text((b.start + b.end) / 2, (b.lo + b.hi) / 2, text, ha="center", va="center", fontsize=6,
                    clip_on=True)
    for t, e in panel.iteration_ends:
        ax.axvline(e, color="black", linewidth=1.0)
        ax.text(e, -0.02 * n_dev, f"iteration {t}", ha="right", va="bottom", fontsize=7)
    ax.set_ylim(n_dev, -0.12 * n_dev)
    step = max(1, n_dev // 32)
    ax.set_yticks([d + 0.5 for d in range(0, n_dev, step)])
    ax.set_yticklabels(panel.devices[::step], fontsize=7)
    ax.set_title(panel.title, fontsize=9)


def legend_handles(panels: Sequence[Panel]) -> list:
    from matplotlib.patches import Patch

    calls = list(dict.fromkeys(c for p in panels for c in p.calls))
    kinds = sorted({b.kind for p in panels for b in p.boxes if b.kind not in ("call", "reload")})
    handles = [Patch(facecolor=TAB10[i % 10], edgecolor="black", label=c) for i, c in enumerate(calls)]
    return handles + [Patch(facecolor=OTHER_COLOURS[k], hatch="////" if k == "realloc" else None, edgecolor="black",
                            label=KIND_NAMES.get(k, k)) for k in kinds]


def timeline_html(panels: Sequence[Panel], width: int = 1200) -> str:
    """A page with one SVG per panel on a shared time axis; hovering a box shows what it was."""
    span = max(p.span for p in panels) * 1.01
    left, row, top = 150, 18, 28
    plot_w = width - left - 10
    x = lambda t: left + plot_w * t / span  # noqa: E731 - seconds to pixels
    parts = []
    for panel in panels:
        n_dev = len(panel.devices)
        height = top + row * n_dev + 24
        svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'font-family="sans-serif" font-size="11">']
        for d, name in enumerate(panel.devices):
            svg.append(f'<text x="{left - 6}" y="{top + row * d + 13}" text-anchor="end">{html.escape(name)}</text>')
        for b in panel.boxes:
            w = max(plot_w * (b.end - b.start) / span, plot_w * MIN_WIDTH)
            y, h = top + row * b.lo, row * (b.hi - b.lo)
            fill = _colour(panel, b)
            style = ' stroke-dasharray="2,1"' if b.kind == "realloc" else ""
            svg.append(f'<g><title>{html.escape(_tooltip(b))}</title><rect x="{x(b.start):.1f}" y="{y}" '
                       f'width="{w:.1f}" height="{h}" fill="{fill}" stroke="black" stroke-width="0.5"{style}/>')
            if b.kind == "call" and w > 70:
                svg.append(f'<text x="{x(b.start) + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle" '
                           f'pointer-events="none">{html.escape(b.label)}</text>')
            svg.append("</g>")
        for t, e in panel.iteration_ends:
            svg.append(f'<line x1="{x(e):.1f}" x2="{x(e):.1f}" y1="{top - 6}" y2="{top + row * n_dev}" '
                       f'stroke="black"/><text x="{x(e) - 3:.1f}" y="{top - 9}" text-anchor="end">'
                       f'iteration {t}</text>')
        axis_y = top + row * n_dev + 16
        for k in range(6):
            t = span * k / 5
            svg.append(f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{t:.2f} s</text>')
        svg.append("</svg>")
        parts.append(f"<h3>{html.escape(panel.title)}</h3>\n" + "\n".join(svg))
    title = html.escape(panels[0].title)
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head><body>\n"
            f"<p>Hover over a box for its call, strategy, iteration and times.</p>\n" + "\n".join(parts)
            + "\n</body></html>\n")
