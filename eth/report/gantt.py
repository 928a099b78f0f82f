"""Gantt chart of a simulated iteration (matplotlib Agg canvas, imported lazily).

One row per stage (top to bottom: pipeline 0 stage 0, 1, ..., pipeline 1 ...), labelled
``P<i> S<j> <device>x<count> r<ranks>``.  The main band shows what the stage's devices
do: forward, recompute, backward, All-Reduce and optimizer in distinct colours on a
light grey idle background; a thin lane under it shows the stage's outgoing p2p
transfers (activations forward, gradients backward), which run on the link and overlap
compute.  Forward/backward bars wide enough to hold text carry their micro-batch index.
"""
from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

COLORS = MappingProxyType({
    "forward": "#4C72B0",
    "recompute": "#8172B2",
    "backward": "#55A868",
    "comm": "#DD8452",
    "allreduce": "#C44E52",
    "optimizer": "#937860",
    "idle": "#E6E6E6",
})
LEGEND = MappingProxyType({
    "forward": "forward", "recompute": "recompute", "backward": "backward",
    "comm": "p2p transfer (link, >= 1 px)", "allreduce": "gradient All-Reduce",
    "optimizer": "optimizer step", "idle": "idle",
})
BAND = 0.68      # height of the main band of a row
LANE = 0.14      # height of the p2p lane under it
WIDTH_IN = 14    # figure width, inches
DPI = 110


def plot_gantt(result, path, labels: dict[tuple[int, int], str] | None = None,
               title: str | None = None) -> Path:
    """Draw ``result`` (:class:`eth.report.simulate.SimResult`) to the PNG ``path``.

    ``labels`` maps (pipeline, stage) to a row label (default "P<i> S<j>");
    ``title`` defaults to the iteration time.
    """
    from matplotlib.figure import Figure      # no pyplot: no global figure state, Agg canvas
    from matplotlib.patches import Patch

    rows = [(s.pipeline, s.stage) for row in result.stages for s in row]
    y_of = {key: y for y, key in enumerate(rows)}
    span = max(result.iteration_ms, 1e-9)
    row_in = max(0.18, min(0.55, 24 / len(rows)))      # inches per row; large plans shrink rows
    fig_h = 1.6 + row_in * len(rows)
    fig = Figure(figsize=(WIDTH_IN, fig_h), dpi=DPI)
    ax = fig.subplots()
    pixel_ms = span / (WIDTH_IN * DPI * 0.85)           # ~ms per pixel of the time axis

    for key, y in y_of.items():
        ax.broken_barh([(0, span)], (y - BAND / 2, BAND), facecolors=COLORS["idle"], zorder=1)
    by_kind: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in result.events:
        by_kind.setdefault((e.kind, y_of[(e.pipeline, e.stage)]), []).append((e.start_ms, e.duration_ms))
    for (kind, y), bars in by_kind.items():
        if kind == "comm":
            # transfers are often far shorter than a pixel: draw them at least 1 px wide
            bars = [(start, max(width, pixel_ms)) for start, width in bars]
            ax.broken_barh(bars, (y + BAND / 2 + 0.02, LANE), facecolors=COLORS[kind], zorder=2)
        else:
            # white separators between consecutive bars only where bars are several px wide
            narrow = sorted(width for _, width in bars)[len(bars) // 2] < 4 * pixel_ms
            ax.broken_barh(bars, (y - BAND / 2, BAND), facecolors=COLORS[kind],
                           edgecolor="white", linewidth=0 if narrow else 0.4, zorder=2)

    # micro-batch numbers where a bar is wide enough (about 1.3% of the axis per digit)
    for e in result.events:
        if e.kind in ("forward", "backward") and e.microbatch is not None:
            if e.duration_ms >= span * 0.013 * len(str(e.microbatch)):
                ax.text(e.start_ms + e.duration_ms / 2, y_of[(e.pipeline, e.stage)], str(e.microbatch),
                        ha="center", va="center", fontsize=7, color="white", zorder=3)

    # separate pipelines
    for y, (key, nxt) in enumerate(zip(rows, rows[1:])):
        if key[0] != nxt[0]:
            ax.axhline(y + 0.5 + LANE / 2, color="#555555", linewidth=0.8, zorder=0)
    ax.axvline(result.iteration_ms, color="black", linestyle="--", linewidth=0.8, zorder=3)

    labels = labels or {}
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([labels.get(key, f"P{key[0]} S{key[1]}") for key in rows],
                       fontsize=9 if row_in >= 0.3 else 6)
    ax.set_ylim(len(rows) - 0.5 + LANE, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#BBBBBB", linewidth=0.4, zorder=0)
    ax.set_axisbelow(True)
    ax.set_title(title or f"Simulated iteration: {result.iteration_ms:.2f} ms", fontsize=11)
    handles = [Patch(facecolor=COLORS[k], label=LEGEND[k]) for k in LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig_h, 1, 1))   # keep ~0.35 inch at the bottom for the legend
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
