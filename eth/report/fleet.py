"""What a plan's fleet choice says: one summary line, the throughput-cost frontier as CSV
and as a plot (``tools/search_hpp.py --pareto FILE.csv --png FILE.png``), from the record
``plan.search["fleet"]`` (:func:`eth.planner.fleet.choose_fleet`)."""
from __future__ import annotations

import csv
import io
import os
import tempfile
from pathlib import Path

from eth.fileio import atomic_write_text


def format_fleet_line(plan) -> str:
    """Devices used of those available, samples/s and cost per hour of a plan ("" when the
    plan has neither a fleet choice nor a price)."""
    fleet, pred = plan.search.get("fleet"), plan.predicted
    cost = pred.get("cost_per_hour")
    money = (f", {cost:.2f} USD/h ({pred.get('egress_per_hour', 0):.2f} egress), "
             f"{pred['usd_per_sample'] * 1e3:.4g} USD per 1000 samples") if cost is not None else ""
    if not fleet:
        return f"fleet: every device ({plan.world_size}){money}" if money else ""
    used = ", ".join(f"{n}/{fleet['available'][k]} {k}" for k, n in fleet["used"].items())
    return (f"fleet [{fleet['objective']}]: {used}; {fleet['searched']} of {fleet['candidates']} fleets searched "
            f"in {fleet['time_s']:.2f}s{money}")


def frontier(points: list[dict]) -> list[dict]:
    """The points (records with ``samples_per_s`` and ``cost_per_hour``) no other beats in
    both, by ascending cost."""
    done = sorted((p for p in points if "samples_per_s" in p), key=lambda p: (p["cost_per_hour"], -p["samples_per_s"]))
    front, fastest = [], float("-inf")
    for p in done:
        if p["samples_per_s"] > fastest:
            front.append(p)
            fastest = p["samples_per_s"]
    return front


def write_frontier(plan, csv_path, png_path=None) -> str:
    """Write every searched fleet of ``plan.search["fleet"]`` to ``csv_path`` (one row per
    plan: its devices per type and zone, samples/s, USD/h, USD per 1000 samples, whether it
    is on the frontier and the chosen one) and, with ``png_path``, the plot; returns a line
    saying what was written."""
    fleet = plan.search["fleet"]
    points = [p for p in fleet["points"] if "samples_per_s" in p]
    front = frontier(points)
    on = {id(p) for p in front}
    labels = list(fleet["available"])
    chosen = fleet["used"]
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(labels + ["samples_per_s", "cost_per_hour", "usd_per_1000_samples", "iteration_ms", "search",
                         "frontier", "chosen"])
    for p in sorted(points, key=lambda p: (p["cost_per_hour"], -p["samples_per_s"])):
        w.writerow([p["devices"].get(k, 0) for k in labels]
                   + [f"{p['samples_per_s']:.4f}", f"{p['cost_per_hour']:.4f}",
                      f"{p['cost_per_hour'] / 3.6 / p['samples_per_s']:.6f}", f"{p['iteration_ms']:.4f}",
                      "full" if p["status"] == "searched" else "screen",
                      "yes" if id(p) in on else "no", "yes" if p["devices"] == chosen else "no"])
    atomic_write_text(csv_path, out.getvalue())
    said = f"wrote {csv_path} ({len(points)} fleets, {len(on)} on the frontier)"
    if png_path:
        plot_frontier(points, front, chosen, png_path,
                      f"{plan.model.name}, gbs {plan.gbs}: fleets of {plan.cluster.name}")
        said += f" and {png_path}"
    return said


def plot_frontier(points, front, chosen, path, title: str) -> None:
    """Samples/s against USD/h, every fleet a dot, the frontier a line, the chosen one circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p["cost_per_hour"] for p in points], [p["samples_per_s"] for p in points], s=14, color="#999999",
               label="fleet", zorder=2)
    ax.plot([p["cost_per_hour"] for p in front], [p["samples_per_s"] for p in front], "-o", color="#1f77b4",
            markersize=4, label="frontier", zorder=3)
    for p in front:
        ax.annotate(" + ".join(f"{n} {k}" for k, n in p["devices"].items() if n), (p["cost_per_hour"], p["samples_per_s"]),
                    fontsize=6, xytext=(4, -8), textcoords="offset points")
    pick = [p for p in points if p["devices"] == chosen]
    if pick:
        ax.scatter([pick[0]["cost_per_hour"]], [pick[0]["samples_per_s"]], s=120, facecolors="none",
                   edgecolors="#d62728", linewidths=1.5, label="chosen", zorder=4)
    ax.set_xlabel("USD per hour")
    ax.set_ylabel("samples per second")
    ax.set_title(title, fontsize=10)
    ax.grid(color="#DDDDDD", linewidth=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
