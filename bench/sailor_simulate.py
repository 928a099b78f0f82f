"""Our fleet choice's plans scored by Sailor's own simulator, next to Sailor's plans.

Reads bench/sailor_fleet.py's results (our plan of each trace row in Sailor's plan format,
where that format can hold it: one pipeline, one dp for all stages) and runs them through
Sailor's simulator (``sailor/Planner/simulations/runtime_simulator.py`` ``Simulator``,
as Sailor's artifact sets it up: OPT-350's training config, ``llm_info.json``,
``profiles_tmp.json``, fp32): iterations/s, USD per iteration (its compute prices at its
default zone plus its egress) and whether the plan fits its memory model.  Run it in
Sailor's Python environment (its requirements), with a checkout whose folder is named
``sailor`` (Sailor's code reads ``<parent>/sailor/sailor/providers/...``):

    PYTHONPATH=CHECKOUT:. python bench/sailor_simulate.py --sailor CHECKOUT [--update-results]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run_context import ROOT, add_output_args, commit, loadavg, write_results  # noqa: E402

SIM = "sailor/Planner/simulations"
PRICE_ZONE = "europe-west4-a"
"""The zone Sailor's simulate_plan prices GPUs at (its default, never changed for Sailor)."""


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| scenario, row | it/s in Sailor's simulator: Sailor's plan, ours | USD/it: Sailor's plan, ours "
             "| ours fits Sailor's memory model |",
             "|---|---|---|---|"]
    for r in rows:
        if "not_written" in r:
            lines.append(f"| {r['scenario']} {r['row']} | {r['sailor_it_s']:.3f}, - | {r['sailor_usd_per_it']:.4f}, - "
                         f"| not in Sailor's format: {r['not_written']} |")
        else:
            lines.append(f"| {r['scenario']} {r['row']} | {r['sailor_it_s']:.3f}, **{r['it_s']:.3f}** | "
                         f"{r['sailor_usd_per_it']:.4f}, **{r['usd_per_it']:.4f}** | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", required=True, type=Path, help="a checkout of eth-easl/sailor, in a folder named sailor")
    ap.add_argument("--fleet", type=Path, default=ROOT / "bench" / "results" / "sailor_fleet.json",
                    help="bench/sailor_fleet.py's results")
    add_output_args(ap, "sailor_simulate.json and sailor_simulate.md")
    args = ap.parse_args(argv)
    from sailor.Planner.simulations.constants import GPU_PRICES
    from sailor.Planner.simulations.runtime_simulator import Simulator

    sim_dir = args.sailor / SIM
    training = json.loads((sim_dir / "configs" / "training_config_opt_350.json").read_text())
    llm_info = json.loads((args.sailor / "sailor" / "Planner" / "llm_info.json").read_text())
    profiles = json.loads((sim_dir / "profiles_tmp.json").read_text())
    zone = json.loads((sim_dir / "configs" / "basic_cluster_config.json").read_text())["zone"]
    simulator = Simulator(str(args.sailor.resolve().parent), training, llm_info, False, profiles, zone=zone)
    rows = []
    for r in json.loads(args.fleet.read_text())["rows"]:
        out = {"scenario": r["scenario"], "row": r["row"], "sailor_it_s": r["sailor"]["sim_it_s"],
               "sailor_usd_per_it": r["sailor"]["sim_usd_per_it"]}
        plan = r["ours"].get("sailor_plan")
        if plan is None:
            out["not_written"] = r["ours"].get("sailor_plan_not_written", "no plan")
        else:
            seconds, comm_usd, _ = simulator.simulate_iteration_time(plan)
            per_s = sum(n * GPU_PRICES[gpu][PRICE_ZONE] / 3600 for gpu, n in plan["used_gpus"].items())
            out |= {"it_s": 1 / seconds, "usd_per_it": per_s * seconds + comm_usd,
                    "fits": bool(simulator.check_config_fits(plan))}
        rows.append(out)
        print(markdown(rows[-1:], "").strip().splitlines()[-1], flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (f"    {when}  PYTHONPATH=CHECKOUT:. python bench/sailor_simulate.py --sailor CHECKOUT  "
              f"# commit {commit()}, load {loadavg()}")
    write_results(args, "sailor_simulate", rows, header, markdown,
                  "(`PYTHONPATH=CHECKOUT:. python bench/sailor_simulate.py --sailor CHECKOUT --update-results`; "
                  "the run's date, commit and load: bench/results/sailor_simulate.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
