"""Results of bench/paper_eval.py: the strategies it compares, one CSV row per (case,
strategy), the CSV files, and what is built from them alone (``--report-only``): the
markdown tables of paper_eval.md and the sweep plots."""
from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType

STRATEGIES = ("hpp", "hpp-noseeds", "uniform", "metis", "metis-strong", "hexiscale", "hexiscale-strong",
              "typesplit")
BASELINES = STRATEGIES[2:]
HPPS = ("hpp", "hpp-noseeds")
"""HPP with its seeds (the default search) and without (``--no-seeds``)."""
SWEEPS = ("devices", "gbs", "seq")
SPEEDUP_CAP = 2.0
"""Speedups above this are drawn at the top edge of the plot with their value."""
LABELS = MappingProxyType({"devices": "devices (half 910B2, half 910B4; 8 per node)",
                           "gbs": "global batch size", "seq": "sequence length"})


@dataclass
class Row:
    """One (case, strategy) result; the CSV columns."""

    table: str
    model: str
    pair: str
    devices: int
    gbs: int
    seq: int
    strategy: str
    status: str = "ok"
    """ok | infeasible | error."""
    pred_ms: float = float("nan")
    sim_ms: float = float("nan")
    search_s: float = float("nan")
    time_limited: bool = False
    pipelines: int = 0
    stages: str = ""
    """Stage count of every pipeline, e.g. "4+4"."""
    ideal_ms: float = float("nan")
    efficiency: float = float("nan")
    seed_won: str = ""
    """hpp: the seed planner whose plan won (metis-strong, hexiscale-strong, uniform), or
    "none" when the HPP search's own plan did."""
    variant: str = ""
    """sensitivity rows: which variation of the base problem (see SENSITIVITY)."""
    note: str = ""


# ------------------------------------------------------------------------------ CSV
def write_csv(path: Path, rows: list[Row]) -> None:
    names = [f.name for f in fields(Row)]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            for k in ("pred_ms", "sim_ms", "ideal_ms"):
                d[k] = f"{d[k]:.1f}"
            d["search_s"] = f"{d['search_s']:.2f}"
            d["efficiency"] = f"{d['efficiency']:.3f}"
            w.writerow(d)


def read_csv(path: Path) -> list[Row]:
    rows = []
    with path.open() as fh:
        for d in csv.DictReader(fh):
            kw = {}
            for f in fields(Row):
                if f.name not in d:         # a CSV written before the column existed
                    continue
                v = d[f.name]
                kw[f.name] = (int(v) if f.type == "int" else float(v) if f.type == "float"
                              else v == "True" if f.type == "bool" else v)
            rows.append(Row(**kw))
    return rows


# ------------------------------------------------------------------------------ report
def _group(rows: list[Row]) -> dict[tuple, dict[str, Row]]:
    out: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        out.setdefault((r.model, r.pair, r.devices, r.gbs, r.seq), {})[r.strategy] = r
    return out


def _cell_time(r: Row | None) -> str:
    if r is None:
        return "-"
    if r.status != "ok":
        return "OOM" if r.status == "infeasible" else "error"
    return f"{r.sim_ms / 1e3:.2f} ({r.pred_ms / 1e3:.2f})" + ("*" if r.time_limited else "")


def _speedup(hpp: Row | None, base: Row | None) -> float | None:
    if hpp is None or base is None or hpp.status != "ok" or base.status != "ok":
        return None
    return base.sim_ms / hpp.sim_ms


def _case_label(key, varying: str | None) -> list[str]:
    model, pair, devices, gbs, seq = key
    if varying is None:
        return [model, pair, str(devices)]
    return [str({"devices": devices, "gbs": gbs, "seq": seq}[varying])]


def markdown_tables(table: str, rows: list[Row]) -> list[str]:
    varying = table.removeprefix("sweep_") if table.startswith("sweep_") else None
    head = ["model", "pair", "devices"] if varying is None else [varying]
    groups = _group(rows)
    lines = ["", "Iteration time, s: simulated (predicted); OOM = no plan fits; "
             "* = search hit its time limit", ""]
    lines += _md_table(head + list(STRATEGIES) + ["seed won"],
                       [_case_label(k, varying) + [_cell_time(g.get(s)) for s in STRATEGIES]
                        + [g["hpp"].seed_won if g.get("hpp") is not None and g["hpp"].seed_won else "-"]
                        for k, g in groups.items()])
    notes = [f"{r.strategy} at {', '.join(_case_label(k, varying))}: {r.note}" for k, g in groups.items()
             for r in g.values() if r.status == "ok" and r.note]
    if notes:
        lines += [""] + [f"* {n}" for n in notes]
    for hpp in HPPS:
        lines += ["", f"Speedup of {hpp} over each baseline (simulated; predicted in brackets)", ""]
        lines += _md_table(head + [f"vs {b}" for b in BASELINES], _speedup_rows(groups, hpp, varying))
    lines += ["", "Search time, s / efficiency (ideal time / simulated time)", ""]
    body = []
    for k, g in groups.items():
        body.append(_case_label(k, varying) + [
            "-" if g.get(s) is None else
            (f"{g[s].search_s:.1f} / {g[s].efficiency:.2f}" if g[s].status == "ok" else f"{g[s].search_s:.1f} / -")
            for s in STRATEGIES])
    lines += _md_table(head + list(STRATEGIES), body)
    return lines


def _speedup_rows(groups, hpp: str, varying) -> list[list[str]]:
    body = []
    for k, g in groups.items():
        cells = []
        for b in BASELINES:
            sim = _speedup(g.get(hpp), g.get(b))
            if sim is None:
                cells.append("OOM" if g.get(b) is not None and g[b].status == "infeasible" else "-")
            else:
                pred = g[b].pred_ms / g[hpp].pred_ms
                cells.append(f"{sim:.2f}x ({pred:.2f}x)")
        body.append(_case_label(k, varying) + cells)
    return body


def sensitivity_lines(rows: list[Row]) -> list[str]:
    """HPP's gain over each baseline under every variation (predicted; simulated in
    brackets), and which seed won."""
    by: dict[str, dict[str, Row]] = {}
    for r in rows:
        by.setdefault(r.variant, {})[r.strategy] = r
    lines = ["", "## Sensitivity: GPT-3 13B, B2/B4, 64 devices, gbs 1024, seq 2048", "",
             "Speedup of HPP (with seeds) over each baseline, predicted (simulated in "
             "brackets); HPP's own time in s; OOM = the baseline finds no plan that fits.", ""]
    body = []
    for name, g in by.items():
        h = g.get("hpp")
        cells = [name, "-" if h is None or h.status != "ok" else f"{h.pred_ms / 1e3:.2f}"]
        for b in ("hpp-noseeds",) + BASELINES:
            r = g.get(b)
            if h is None or r is None or h.status != "ok":
                cells.append("-")
            elif r.status != "ok":
                cells.append("OOM" if r.status == "infeasible" else "error")
            else:
                cells.append(f"{r.pred_ms / h.pred_ms:.2f}x ({r.sim_ms / h.sim_ms:.2f}x)")
        cells.append(h.seed_won if h is not None and h.seed_won else "-")
        body.append(cells)
    lines += _md_table(["variant", "hpp s"] + [f"vs {b}" for b in ("hpp-noseeds",) + BASELINES] + ["seed won"],
                       body)
    return lines


def table3_lines(rows: list[Row], table2: list[Row]) -> list[str]:
    """The paper's Table 3 plans next to our searches' plans for the same problem."""
    ours = {r.strategy: r for r in table2 if (r.model, r.pair, r.devices) == ("gpt3-13b", "b2b4", 64)}
    lines = ["", "## The paper's Table 3 plans (GPT-3 13B, B2/B4, 64 devices, gbs 1024) in our model", "",
             "Each configuration of the paper's appendix A is rebuilt stage by stage and evaluated "
             "with our cost model and simulator, next to the plan our own search of that strategy "
             "finds for the same problem (table2.csv).  Times in s, simulated (predicted).", ""]
    body = []
    for r in rows:
        peak = r.note.split("peak memory ")[-1].split(" x")[0]
        o = ours.get(r.strategy)
        won = o.seed_won if r.strategy == "hpp" and o is not None and o.seed_won else "-"
        body.append([r.strategy, f"{r.sim_ms / 1e3:.2f} ({r.pred_ms / 1e3:.2f})",
                     f"{peak} x" + ("" if r.status == "ok" else " (OOM)"), _cell_time(o),
                     f"{r.sim_ms / o.sim_ms:.2f}" if o is not None and o.status == "ok" else "-", won])
    for name in ("hpp-noseeds", "metis-strong", "hexiscale-strong"):   # no paper plan of their own
        if name in ours:
            body.append([name, "-", "-", _cell_time(ours[name]), "-", "-"])
    lines += _md_table(["system", "paper's plan", "peak memory / capacity", "our search's plan",
                        "paper plan / ours", "seed won"], body)
    return lines


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return out


def summary_lines(rows: list[Row]) -> list[str]:
    """Ranges of the HPP speedup per baseline and pair (the paper's headline numbers)."""
    lines = ["| pair | hpp | " + " | ".join(f"vs {b}" for b in BASELINES) + " |",
             "|---|---|" + "|".join("---" for _ in BASELINES) + "|"]
    groups = _group(rows)
    for pair in sorted({k[1] for k in groups}):
        for hpp in HPPS:
            cells = []
            for b in BASELINES:
                sp = [s for k, g in groups.items() if k[1] == pair
                      for s in [_speedup(g.get(hpp), g.get(b))] if s is not None]
                oom = sum(1 for k, g in groups.items() if k[1] == pair and g.get(b) is not None
                          and g[b].status == "infeasible")
                text = f"{min(sp):.2f}-{max(sp):.2f}x" if sp else "-"
                cells.append(text + (f" ({oom} OOM)" if oom else ""))
            lines.append(f"| {pair} | {hpp} | " + " | ".join(cells) + " |")
    return lines


def agreement_lines(tables: dict[str, list[Row]]) -> list[str]:
    """How far the plans' objective (pred_ms) is from their simulated iteration (sim_ms),
    |pred / sim - 1| over every table's plans: all strategies, and HPP's alone; and per
    case of the searched tables, whether HPP's plan simulates at least as fast as every
    strong baseline's."""
    rows = [r for rs in tables.values() for r in rs if r.status == "ok" and r.sim_ms > 0]
    lines = ["", "## The objective against the simulator", "",
             "|pred_ms / sim_ms - 1| over the plans of every table above (pred_ms: the objective "
             "the plans were scored by; sim_ms: the event simulator):", "",
             "| plans | count | median | p90 | max |", "|---|---|---|---|---|"]
    for label, keep in (("all strategies", lambda r: True), ("hpp", lambda r: r.strategy == "hpp"),
                        ("hpp-noseeds", lambda r: r.strategy == "hpp-noseeds")):
        gaps = sorted(abs(r.pred_ms / r.sim_ms - 1) for r in rows if keep(r))
        if gaps:
            lines.append(f"| {label} | {len(gaps)} | {gaps[len(gaps) // 2]:.2%} | "
                         f"{gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]:.2%} | {gaps[-1]:.2%} |")
    slower = []
    for name, rs in tables.items():
        if name in ("table3", "sensitivity"):     # the paper's plans; variants of one case
            continue
        for key, g in _group([r for r in rs if r.status == "ok"]).items():
            for hpp in HPPS:
                for b in ("metis-strong", "hexiscale-strong"):
                    if hpp in g and b in g and g[hpp].sim_ms > g[b].sim_ms * (1 + 1e-6):
                        slower.append(f"{' '.join(map(str, key))}: {hpp} {g[hpp].sim_ms:.1f} ms > "
                                      f"{b} {g[b].sim_ms:.1f} ms")
    lines += ["", f"Cases where HPP's plan simulates slower than a strong baseline's: {len(slower)}"]
    lines += [f"- {s}" for s in slower]
    return lines


def write_report(out: Path) -> None:
    names = ("table2", "table3", "sensitivity", "many_types", *(f"sweep_{sweep}" for sweep in SWEEPS))
    tables = {name: read_csv(out / f"{name}.csv") for name in names if (out / f"{name}.csv").exists()}
    runs = (out / "runs.txt").read_text().splitlines() if (out / "runs.txt").exists() else []
    md = ["# Paper evaluation: HPP vs baselines in one cost model", "",
          "Produced by bench/paper_eval.py; the runs that wrote the CSVs in this folder "
          "(runs.txt: command, per-search time limit, what it wrote, analytic profiles it generated):", ""]
    md += [f"    {line}" for line in runs]
    md += ["", "Predicted: the cost model's objective, gradient blocks (each block of gradients "
           "reduced once its slowest holder in any pipeline has finished its backward, for as long as "
           "its slowest holder's transfer; eth.cost.equations.synced_end_times), plus each "
           "stage's optimizer step; simulated: the event simulator (eth.report.simulate).",
           "", "Analytic (roofline) profiles from profiles/ "
          "(ProfileDB.ensure for other sequence lengths); times are predictions of this "
          "repository's cost model and simulator, not measurements.",
          "", "Efficiency = ideal time / simulated time; ideal time = sum over all ops of "
          "eth.spec.model.op_shapes FLOPs x 3 (forward + backward, no recompute) x gbs / "
          "(sum over devices of peak TFLOPS x GEMM_EFFICIENCY 0.6)."]
    if "table2" in tables:
        md += ["", "## Table 2 models and scales (gbs 1024, seq 2048)", "",
               "HPP speedup range per device pair (simulated iteration time):", ""]
        md += summary_lines(tables["table2"])
        md += markdown_tables("table2", tables["table2"])
    if "many_types" in tables:
        md += ["", "## Many device types (gbs 1024, seq 2048)", "",
               "Clusters examples/clusters/mixed<T>-<N>.yaml (examples/make_clusters.py MIXES): "
               "T device types, N devices, 8 per node.  HPP speedup range per cluster "
               "(simulated iteration time):", ""]
        md += summary_lines(tables["many_types"])
        md += markdown_tables("many_types", tables["many_types"])
    if "table3" in tables:
        md += table3_lines(tables["table3"], tables.get("table2", []))
    if "sensitivity" in tables:
        md += sensitivity_lines(tables["sensitivity"])
    if tables:
        md += agreement_lines(tables)
    for sweep in SWEEPS:
        name = f"sweep_{sweep}"
        if name in tables:
            r0 = tables[name][0]
            fixed = {k: v for k, v in (("devices", r0.devices), ("gbs", r0.gbs), ("seq", r0.seq)) if k != sweep}
            md += ["", f"## Sweep: {LABELS[sweep]} ({r0.model}, {r0.pair}, "
                   + ", ".join(f"{k} {v}" for k, v in fixed.items()) + ")", "",
                   f"Plot: {name}.png"]
            md += markdown_tables(name, tables[name])
    (out / "paper_eval.md").write_text("\n".join(md) + "\n")
    for sweep in SWEEPS:
        name = f"sweep_{sweep}"
        if name in tables:
            plot_sweep(tables[name], sweep, out / f"{name}.png")


def plot_sweep(rows: list[Row], sweep: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    groups = _group(rows)
    keys = sorted(groups, key=lambda k: {"devices": k[2], "gbs": k[3], "seq": k[4]}[sweep])
    xs = [{"devices": k[2], "gbs": k[3], "seq": k[4]}[sweep] for k in keys]
    colors = dict(zip(STRATEGIES, ("tab:red", "tab:orange", "tab:gray", "tab:blue", "tab:cyan", "tab:green",
                                   "tab:olive", "tab:purple")))
    markers = dict(zip(STRATEGIES, ("o", "o", "s", "^", "^", "D", "D", "v")))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for s in STRATEGIES:
        pts = [(x, groups[k][s].sim_ms / 1e3) for x, k in zip(xs, keys)
               if s in groups[k] and groups[k][s].status == "ok"]
        if pts:
            ax1.plot(*zip(*pts), marker=markers[s], color=colors[s], label=s,
                     lw=2.2 if s == "hpp" else 1.2, zorder=4 if s == "hpp" else 3, alpha=0.9,
                     ls="--" if s.endswith(("-strong", "-noseeds")) else "-")
        bad = [x for x, k in zip(xs, keys) if s in groups[k] and groups[k][s].status != "ok"]
        if bad:
            ax1.scatter(bad, [0.0] * len(bad), marker="x", s=70, color=colors[s], transform=ax1.get_xaxis_transform(),
                        clip_on=False, zorder=5, label=f"{s}: OOM/infeasible")
    ax1.set_yscale("log")
    ax1.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax1.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax1.set_ylabel("simulated iteration time (s, log)")
    ax1.set_title("iteration time (x on the axis = no plan fits)")
    cap, clipped = SPEEDUP_CAP, False
    for s in BASELINES:
        pts = [(x, sp) for x, k in zip(xs, keys) for sp in [_speedup(groups[k].get("hpp"), groups[k].get(s))]
               if sp is not None]
        if pts:
            ax2.plot([x for x, _ in pts], [min(y, cap) for _, y in pts], marker=markers[s], color=colors[s],
                     label=f"HPP vs {s}", ls="--" if s.endswith("-strong") else "-")
            for x, y in pts:
                if y > cap:       # off the scale: drawn at the cap with its value
                    clipped = True
                    ax2.annotate(f"{y:.1f}x", (x, cap), textcoords="offset points", xytext=(0, 6),
                                 ha="center", fontsize=7, color=colors[s])
    if clipped:
        ax2.set_ylim(top=cap + 0.12)
    ax2.axhline(1.0, color="black", lw=0.8, ls="--")
    ax2.set_ylabel("speedup of HPP (simulated)")
    ax2.set_title(f"HPP speedup over each baseline (> {SPEEDUP_CAP:g}x: clipped, labelled)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs], rotation=45 if len(xs) > 6 else 0)
        ax.minorticks_off()
        ax.set_xlabel(LABELS[sweep])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    r0 = rows[0]
    fixed = ", ".join(f"{k} {v}" for k, v in (("devices", r0.devices), ("gbs", r0.gbs), ("seq", r0.seq))
                      if k != sweep)
    fig.suptitle(f"GPT-3 13B on 910B2/910B4 ({fixed}); analytic profiles, eth cost model + simulator")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
