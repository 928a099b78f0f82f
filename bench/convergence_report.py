"""Numbers and outputs of bench/convergence.py: final-window means and relative
differences, the summary printed, the same-weights line, the CSV, the PNG (full curves,
a zoomed panel of the last iterations and per-iteration differences, as the paper's
Fig. 14) and the markdown report."""
from __future__ import annotations

import csv
import io
import math
import os
import platform
import shlex
from pathlib import Path

from run_context import commit

REPO = Path(__file__).resolve().parents[1]
RUNS = ("hpp", "uniform", "one-rank")
PAPER_GAP = 0.001
"""The paper's appendix B: the loss curves of ETH and the baselines within about 0.1%."""


def format_same(same: dict, args, md: bool = False) -> str:
    k, src, losses = same["k"], same["source"], same["losses"]
    ref = losses[src]
    spread = max(abs(v - ref) / ref for v in losses.values())
    text = (f"same weights: every plan resumed from the {src} run's checkpoint after iteration {k} "
            f"for iteration {k + 1} (same batch): loss " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items())
            + f"; largest relative difference to {src} {spread:.4%}; the {src} run itself had "
            f"{same['own']:.6f} at iteration {k + 1}"
            + (" (resume exact)" if same["own"] == ref else f" (resume off by {abs(same['own'] - ref):.2e})"))
    if not md:
        return text
    verdict = (f"On the same weights and batch the plans' losses agree to {spread:.4%}: the plans read the "
               f"same data and compute the same loss, so the differences between the curves above are "
               f"rounding ({args.precision}) that differs between plans (micro-batch sizes, tp and dp "
               f"reductions) and compounds along each run's own trajectory."
               if spread < 1e-3 else
               f"On the same weights and batch the plans' losses differ by {spread:.4%}: more than rounding; "
               f"the plans do not compute the same loss.")
    return f"Same-weights check: {text[len('same weights: '):]}.\n\n{verdict}"


# ---------------------------------------------------------------- numbers
def window_mean(losses, window: int) -> float:
    tail = losses[-window:]
    return sum(tail) / len(tail)


def compare(results: dict, window: int) -> dict:
    """Final-window means, relative differences of every pair (a - b) / b, and the largest
    per-iteration relative difference inside the window."""
    means = {n: window_mean(r["losses"], window) for n, r in results.items()}
    pairs = {}
    names = [n for n in RUNS if n in results]
    for i, a in enumerate(names):
        for b in names[i + 1:]:  # (hpp, uniform), (hpp, one-rank), (uniform, one-rank)
            la, lb = results[a]["losses"][-window:], results[b]["losses"][-window:]
            va, vb = results[a].get("valid"), results[b].get("valid")
            pairs[(a, b)] = {"rel": (means[a] - means[b]) / means[b],
                             "max_iter_rel": max(abs(p - q) / q for p, q in zip(la, lb)),
                             "valid_rel": (va - vb) / vb if va is not None and vb is not None else None}
    return {"means": means, "pairs": pairs}


def steady_ms(times) -> float:
    """Mean iteration time without the first (warm-up) iteration."""
    rest = [t for t in times[1:] if math.isfinite(t)] or times
    return sum(rest) / len(rest)


def format_summary(results: dict, cmp: dict, args) -> str:
    w, n = args.window, args.iters
    rows = [f"final-window mean loss (iterations {n - w + 1}-{n}, {w} iterations)",
            f"  {'run':10s} {'ranks':>5s} {'mean loss':>10s} {'valid loss':>10s} {'iteration ms':>13s} "
            f"{'wall s':>7s}"]
    for name, r in results.items():
        valid = f"{r['valid']:10.5f}" if r.get("valid") is not None else f"{'-':>10s}"
        rows.append(f"  {name:10s} {r['world']:5d} {cmp['means'][name]:10.5f} {valid} "
                    f"{steady_ms(r['times_ms']):13.1f} {r['wall_s']:7.1f}")
    rows.append(f"relative differences of the final-window means (paper: within ~{PAPER_GAP:.1%})")
    for (a, b), d in cmp["pairs"].items():
        valid = f", validation loss {d['valid_rel']:+.3%}" if d["valid_rel"] is not None else ""
        rows.append(f"  {a} vs {b}: {d['rel']:+.3%}  (largest per-iteration difference in the window "
                    f"{d['max_iter_rel']:.3%}{valid})")
    return "\n".join(rows)


# ---------------------------------------------------------------- outputs
def write_csv(path: Path, results: dict) -> None:
    from eth.fileio import atomic_write_text

    names = list(results)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["iteration", *(f"loss_{n}" for n in names)])
    for i in range(len(results[names[0]]["losses"])):
        w.writerow([i + 1, *(f"{results[n]['losses'][i]:.6f}" for n in names)])
    atomic_write_text(path, buf.getvalue())


def plot(path: Path, results: dict, model, args) -> None:
    """Left: the whole curves; right: the last ``--window`` iterations (top) and each run's
    per-iteration relative difference to the one-rank run, or to the first run (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"hpp": ("HPP (ETH)", "-", "tab:red"), "uniform": ("Megatron uniform", "--", "tab:blue"),
              "one-rank": ("one rank", ":", "black")}
    fig = plt.figure(figsize=(12, 5.2))
    grid = fig.add_gridspec(2, 2, width_ratios=[3, 2])
    full, zoom, diff = fig.add_subplot(grid[:, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, 1])
    n, w = args.iters, args.window
    xs = list(range(1, n + 1))
    ref = "one-rank" if "one-rank" in results else next(iter(results))
    for name, r in results.items():
        label, ls, color = styles[name]
        full.plot(xs, r["losses"], ls, color=color, lw=1.0, label=label)
        zoom.plot(xs[n - w:], r["losses"][n - w:], ls, color=color, lw=1.2, label=label)
        if name != ref:
            rel = [100 * (a - b) / b for a, b in zip(r["losses"], results[ref]["losses"])]
            diff.plot(xs, rel, ls, color=color, lw=0.8, label=f"{label} vs {styles[ref][0]}")
    full.axvspan(n - w + 0.5, n + 0.5, color="0.9", zorder=0)
    full.set(xlabel="iteration", ylabel="training loss (nats/token)",
             title=f"{model.name}: {model.num_params() / 1e6:.2f}M parameters, gbs {args.gbs}, "
                   f"seq {model.seq_len}, {args.precision}")
    zoom.set(title=f"last {w} iterations", ylabel="loss")
    diff.set(xlabel="iteration", ylabel="difference (%)")
    diff.axhline(0, color="0.5", lw=0.5)
    full.legend()
    if len(results) > 1:
        diff.legend(fontsize="small")
    for ax in (full, zoom, diff):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()


def shown(path) -> str:
    """``path`` relative to the repository when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def write_md(path: Path, results, cmp, same, model, plans, args, argv, load_before, load_after) -> None:
    from eth.fileio import atomic_write_text
    from eth.report.tables import format_plan_table

    n, w = args.iters, args.window
    cmd = "python bench/convergence.py " + shlex.join(argv)
    lines = [
        "# Convergence: HPP vs Megatron-uniform vs one rank",
        "",
        "The paper's appendix B (Fig. 14) trains LLaMA-2 70B with ETH and the baselines and finds",
        f"their loss curves within about {PAPER_GAP:.1%}.  Here a small model of the same family trains",
        "on the shipped English corpus with the same global batch, data order, seed and learning-rate",
        "schedule under three plans (written by `bench/convergence.py`).",
        "",
        f"* command: `{cmd.strip()}`",
        f"* commit: {commit()}",
        f"* machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
        f"{platform.release()}; load average (1/5/15 min) {load_before} before, {load_after} after",
        f"* model: {model.name} {model.to_dict()}: {model.num_params():,} parameters",
        f"* plans: searched on {shown(args.cluster)} with profiles "
        f"{shown(args.profiles) if args.profiles else '(none: analytic ones)'}; per device type: "
        f"{next(iter(plans.values())).search.get('profiles', {})}",
        f"* training: {n} iterations, gbs {args.gbs}, {args.precision}, lr {args.lr:g} -> {args.min_lr:g} "
        f"(cosine, {args.warmup} warm-up), seed {args.seed}, data {' '.join(shown(d) for d in args.data_path)}",
        "",
        f"| run | ranks | mean loss, last {w} iterations | vs one rank | validation loss after {n} | vs one rank "
        f"| mean iteration ms | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref = cmp["means"].get("one-rank")
    vref = results["one-rank"].get("valid") if "one-rank" in results else None
    for name, r in results.items():
        rel = f"{(cmp['means'][name] - ref) / ref:+.3%}" if ref and name != "one-rank" else "-"
        v = r.get("valid")
        valid = f"{v:.5f}" if v is not None else "-"
        vrel = f"{(v - vref) / vref:+.3%}" if v is not None and vref and name != "one-rank" else "-"
        lines.append(f"| {name} | {r['world']} | {cmp['means'][name]:.5f} | {rel} | {valid} | {vrel} | "
                     f"{steady_ms(r['times_ms']):.1f} | {r['wall_s']:.0f} |")
    lines += ["", f"Relative differences of the final-window means (paper: ~{PAPER_GAP:.1%}):", ""]
    for (a, b), d in cmp["pairs"].items():
        valid = f"; validation loss {d['valid_rel']:+.3%}" if d["valid_rel"] is not None else ""
        lines.append(f"* {a} vs {b}: {d['rel']:+.3%} (largest single-iteration difference in the "
                     f"window: {d['max_iter_rel']:.3%}{valid})")
    if same:
        lines += ["", format_same(same, args, md=True)]
    out = shown(args.out)
    lines += ["", f"Curves: `{out}/convergence.png`; per-iteration losses: "
                  f"`{out}/convergence.csv`.  Iteration times are rank 0's wall clock on a "
                  "shared machine (emulated slow ranks included), not a throughput benchmark.", "",
              "Plans:", ""]
    for name, plan in plans.items():
        lines += [f"{name}:", "", "```", format_plan_table(plan).rstrip(), "```", ""]
    atomic_write_text(path, "\n".join(lines))
