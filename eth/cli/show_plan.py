"""Show a plan as a Table-3-style text view, simulate it, optionally draw a Gantt chart.

    python tools/show_plan.py plan.json          # or: hpp-show plan.json
    python tools/show_plan.py plan.json --png out.png
    python tools/show_plan.py plan.json --profiles profiles/ --optimizer-passes 3
    python tools/show_plan.py --legend           # what the headings and abbreviations mean
    python tools/show_plan.py --history ckpt     # the plans made at start-up in a --save folder

The plan's stored predictions (fwd/bwd ms, memory GB) are printed as they are; when
the plan has none they are filled in from the cost model (marked as such).  Profiles:
``--profiles``, else the ones the plan was searched with (``search.profiles_path``, or
the same file in this checkout: ``search.profiles_checkout_path``; one line and exit 2
when neither exists), else, for a plan that records none, the checkout's ``profiles/``;
when the kind of profile used
for a device type differs from the one the plan records (``search.profiles``: measured,
aceso-csv, analytic), one line says so and by how much the simulated iteration differs
from the plan's prediction.  The
simulated iteration comes from eth/report/simulate.py (event-driven 1F1B, block-wise
All-Reduce, optimizer step); see docs/SIMULATOR.md.  Exit code 2 on bad input.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from eth.cli.common import CHECKOUT, check_output_file, run_main
from eth.cost.model import CostModel
from eth.errors import SpecError
from eth.spec.plan import load_plan
from eth.profiles.db import ProfileDB
from eth.report.fleet import format_fleet_line
from eth.report.tables import format_legend, format_plan_table, format_sim_summary, stage_label
from eth.report.simulate import simulate

# the checkout's shipped profiles (absent in a wheel install: analytic ones are generated)
DEFAULT_PROFILES = CHECKOUT / "profiles"


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("plan", nargs="?", help="plan JSON written by tools/search_hpp.py")
    ap.add_argument("--legend", action="store_true",
                    help="explain the table's headings and abbreviations (alone: only the legend)")
    ap.add_argument("--png", metavar="OUT", help="write a Gantt chart of the simulated iteration")
    ap.add_argument("--profiles", default=None,
                    help=f"profile file or folder (default: {DEFAULT_PROFILES} if present; "
                         "analytic entries fill what is missing)")
    ap.add_argument("--optimizer-passes", type=float, default=CostModel.optimizer_passes,
                    help="without a measured optimizer time: memory passes of the optimizer step over the "
                         "rank's model-state bytes")
    ap.add_argument("--history", metavar="DIR",
                    help="the plans made at start-up in this --save folder (pretrain_gpt.py --hpp-cluster): one "
                         "line per start, what joined and left; show one with its file in DIR/hpp-plans/")
    args = ap.parse_args(argv)
    if args.history is not None:
        from eth.spec.plan_history import format_history
        if args.plan is not None:
            raise SpecError("give a plan JSON file or --history DIR, not both")
        print(format_history(args.history))
        return 0
    if args.plan is None:
        if args.legend:
            print(format_legend())
            return 0
        raise SpecError("give a plan JSON file (or --legend)")
    if args.optimizer_passes < 0:
        raise SpecError(f"--optimizer-passes must be >= 0, got {args.optimizer_passes}")
    if args.png:
        if Path(args.png).suffix.lower() != ".png":
            raise SpecError(f"--png {args.png}: the chart is a PNG image; give a file name ending in .png")
        check_output_file(args.png, "--png")

    plan = load_plan(args.plan)
    recorded_path = recorded_profiles(plan)
    if args.profiles:
        where = args.profiles
    elif recorded_path is not None and not Path(recorded_path).exists():
        raise SpecError(f"the plan was searched with the profiles {recorded_path} (plan.search), "
                        f"which do not exist here: pass --profiles PATH")
    elif recorded_path is not None:
        where = recorded_path
    elif DEFAULT_PROFILES.is_dir() and any(DEFAULT_PROFILES.glob("*.json")):
        where = str(DEFAULT_PROFILES)
    else:
        where = None
    profiles = ProfileDB.load(where) if where else ProfileDB()
    analytic = profiles.ensure(plan.model, plan.cluster.types.values())
    cost_model = CostModel(plan.model, plan.cluster, profiles, plan.training,
                           optimizer_passes=args.optimizer_passes)

    filled = not any(s.predicted for p in plan.pipelines for s in p.stages)
    if filled:
        cost_model.annotate(plan)  # in memory only; the file is not rewritten
    print(format_plan_table(plan))
    if filled:
        print("  (no predictions stored in the plan: fwd/bwd/memory computed now by the cost model)")
    if analytic:
        print(f"  (analytic roofline profiles generated for: {', '.join(analytic)})")
    if where and where == recorded_path and not args.profiles:
        print(f"  (profiles: {where}, the ones the plan was searched with)")
    fleet = format_fleet_line(plan)
    if fleet:
        print(fleet)
    print()
    result = simulate(plan, cost_model)
    print(format_sim_summary(plan, result))
    note = profile_mismatch(plan, profiles, analytic, where, result.iteration_ms)
    if note:
        print(note)

    if args.png:
        from eth.report.gantt import plot_gantt
        labels = {(s.pipeline, s.stage): stage_label(plan, s.pipeline, s.stage)
                  for row in result.stages for s in row}
        title = (f"{plan.model.name} on {plan.cluster.name}, gbs {plan.gbs}: "
                 f"simulated iteration {result.iteration_ms:.2f} ms")
        if "iteration_ms" in plan.predicted:
            title += f" (Eq. 5: {plan.predicted['iteration_ms']:.2f} ms)"
        try:
            out = plot_gantt(result, args.png, labels, title)
        except OSError as exc:
            raise SpecError(f"cannot write {args.png}: {exc}") from None
        print(f"\nGantt chart written to {out}")
    if args.legend:
        print()
        print(format_legend())
    return 0


def recorded_profiles(plan) -> str | None:
    """The profiles the plan was searched with: ``search.profiles_path`` where it exists,
    else the file ``search.profiles_checkout_path`` names in this checkout (a plan made
    in a clone records only that), else the recorded path (None: none recorded)."""
    path, in_checkout = plan.search.get("profiles_path"), plan.search.get("profiles_checkout_path")
    here = CHECKOUT / in_checkout if isinstance(in_checkout, str) else None
    if isinstance(path, str) and (Path(path).exists() or here is None or not here.exists()):
        return path
    return None if here is None else str(here)


def _kinds(sources: dict) -> dict:
    """{device type: first word of the source} ("analytic (generated ...)" -> "analytic")."""
    return {t: str(src).split()[0] if str(src).split() else "" for t, src in sources.items()}


def profile_mismatch(plan, profiles, analytic, where, simulated_ms: float) -> str | None:
    """One line when a device type is scored with another kind of profile than the plan
    records (``plan.search["profiles"]``), else None."""
    recorded = plan.search.get("profiles")
    if not isinstance(recorded, dict) or not recorded:
        return None
    used = {t: "analytic" if t in analytic else profiles.get(t).source for t in recorded
            if t in plan.cluster.types}
    want = _kinds({t: recorded[t] for t in used})
    if _kinds(used) == want:
        return None
    fmt = lambda d: ", ".join(f"{t}: {k}" for t, k in sorted(d.items()))
    path = recorded_profiles(plan)
    made = f"{fmt(want)}" + (f" from {path}" + ("" if Path(path).exists() else ", not found")
                              if path and path != where else "")
    line = (f"note: the plan was searched with {made}; scored here with {fmt(_kinds(used))}"
            f" ({where or 'generated'}; give --profiles to choose)")
    predicted = plan.predicted.get("iteration_ms")
    if isinstance(predicted, (int, float)) and predicted > 0:
        line += (f": simulated {simulated_ms:.2f} ms vs the plan's predicted {predicted:.2f} ms "
                 f"({100 * (simulated_ms / predicted - 1):+.1f}%)")
    return line


def main(argv=None) -> int:
    """The CLI (``hpp-show``); bad input: ``error: ...`` on stderr, exit 2."""
    return run_main(_main, argv)
