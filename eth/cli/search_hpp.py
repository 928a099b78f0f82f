"""Offline HPP planner: cluster + model + profiles -> plan.json (``hpp-search``).

    hpp-search --model gpt3-13b --cluster examples/clusters/b2b4-64.yaml \
        --profiles profiles/ --gbs 1024 --seq 2048 -o plan.json
    python tools/search_hpp.py ...        # the same, from a checkout
"""
from __future__ import annotations

import argparse
import sys

from eth.planner.options import STRATEGIES


def parse_args(argv=None) -> argparse.Namespace:
    from eth.spec.model_source import add_model_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--cluster", required=True, help="cluster YAML file")
    p.add_argument("--profiles", help="profile JSON file or folder (without it: analytic profiles in memory "
                                      "for every device type)")
    p.add_argument("--profiles-fallback", choices=("none", "analytic"), default="none",
                   help="what a device type gets when --profiles has no entry for the model's shape: "
                        "none = an error naming the shape, analytic = roofline profiles in memory")
    p.add_argument("--gbs", "--global-batch-size", dest="gbs", type=int, required=True, help="global batch size")
    p.add_argument("--attention", choices=("unfused", "fused"),
                   help="attention op set (default: the preset's): unfused = score, softmax, attn-dropout, "
                        "context ops; fused = one fused-attention op (eth.spec.model.ModelSpec.attention)")
    p.add_argument("-o", "--output", help="write the plan JSON here (atomically)")
    p.add_argument("--strategy", default="hpp", choices=STRATEGIES,
                   help="hpp, or a baseline in the same cost model: uniform (Megatron), metis and "
                        "hexiscale (as published), metis-strong and hexiscale-strong (on HPP's balancer, "
                        "mbs search and recompute; the seeds of hpp), typesplit (TypeSplit-HPP)")
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds, 0 = none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=1.5, help="approximate-bound tolerance factor")
    p.add_argument("--no-cache", action="store_true", help="disable the pipeline configuration cache")
    p.add_argument("--no-skip", action="store_true", help="disable early skipping")
    p.add_argument("--no-order", action="store_true", help="disable variance ordering (Eq. 9)")
    p.add_argument("--no-dp", action="store_true", help="disable dynamic programming (Eq. 10)")
    p.add_argument("--no-seeds", action="store_true",
                   help="do not also evaluate the metis-strong/hexiscale-strong/uniform planners' plans")
    p.add_argument("--op-boundaries", action="store_true",
                   help="after the search, let stages start and end inside layers: move each stage "
                        "boundary op by op where that makes the plan faster (plan version 2)")
    p.add_argument("--allow-overshoot", action="store_true",
                   help="accept sum(lbs) > gbs when no exact split exists")
    p.add_argument("--max-blocks-per-type", type=int, default=8)
    p.add_argument("--max-blocks", type=int, default=16,
                   help="with T device types, at most max(2, this // T) blocks per type too (0: off)")
    p.add_argument("--type-orders", type=int, default=6,
                   help="type orders of a pipeline's stages expanded where it has more (the most promising "
                        "by their floors; 0: every order)")
    p.add_argument("--patience", type=int, default=32,
                   help="with three or more device types, stop enumerating device groups after this many "
                        "in a row did not make the best plan 0.1%% faster (0: every group)")
    p.add_argument("--max-stages", type=int, default=16)
    p.add_argument("--time-model", default="blocks", choices=("blocks", "eq5"),
                   help="the iteration-time model the plan is scored by: blocks (default: each gradient block "
                        "reduced once its slowest holder in any pipeline is done) or eq5 (the paper's Eq. 5: "
                        "each stage's own All-Reduce right after its own backward)")
    p.add_argument("--no-simulate-finalists", action="store_true",
                   help="return the best finalist by the objective instead of re-scoring those within 2%% of "
                        "it by the event simulator")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--jobs", type=int, default=usable_cpus(),
                   help="processes the search may use at once (default: the CPUs this process may "
                        "run on); the plan is the same for any value")
    f = p.add_argument_group("fleet: which of the cluster's devices to use (node counts are what is available)")
    f.add_argument("--objective", default="throughput", choices=("throughput", "cost"),
                   help="throughput: most samples/s; cost: fewest USD per sample (needs price_per_hour)")
    f.add_argument("--use-all", action="store_true", help="use every device of the cluster file")
    f.add_argument("--min-throughput", type=float, default=0.0, metavar="SAMPLES_PER_S",
                   help="the plan must reach this many samples/s (0: no constraint)")
    f.add_argument("--max-cost-per-hour", type=float, default=0.0, metavar="USD",
                   help="the plan may cost at most this, devices plus egress (0: no constraint)")
    f.add_argument("--pareto", metavar="FILE.csv",
                   help="write the throughput-cost frontier of the fleets: one row per plan with its devices")
    f.add_argument("--png", metavar="FILE.png", help="with --pareto: plot the frontier")
    add_model_args(p)
    t = p.add_argument_group("training setup (memory and Eq. 6; recorded in the plan, used by the runtime)")
    t.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="weights and activations (the optimizer keeps fp32 main weights)")
    t.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2),
                   help="1: optimizer state sharded over each gradient block's holders; 2: also gradients")
    t.add_argument("--grad-reduce", default="fp32", choices=("fp32", "bf16"),
                   help="dtype gradients are accumulated and reduced in")
    return p.parse_args(argv)


def _main(argv=None) -> int:
    args = parse_args(argv)
    from eth.cli.common import check_output_file
    from eth.spec.cluster import load_cluster
    from eth.spec.model_source import model_from_args
    from eth.planner.job import plan_job
    from eth.planner.options import SearchOptions
    from eth.spec.precision import TrainSetup
    from eth.report.fleet import format_fleet_line
    from eth.report.tables import format_plan_table, format_search_line

    from eth.errors import SpecError
    from eth.planner.fleet import FleetOptions

    if args.png and not args.pareto:
        raise SpecError("--png draws the frontier of --pareto FILE.csv; give --pareto too")
    for flag, path in (("-o", args.output), ("--pareto", args.pareto), ("--png", args.png)):
        if path:   # before the search, so that its result is not lost
            check_output_file(path, flag)
    model = model_from_args(args, attention=args.attention)
    cluster = load_cluster(args.cluster)
    fleet = FleetOptions(args.objective, args.use_all, args.min_throughput, args.max_cost_per_hour,
                         pareto=bool(args.pareto))
    if args.use_all and args.pareto:
        raise SpecError("--pareto compares fleets of the cluster; it cannot be given with --use-all")
    options = SearchOptions(gbs=args.gbs, strategy=args.strategy, cache=not args.no_cache,
                            skip=not args.no_skip, order=not args.no_order, dp=not args.no_dp,
                            seeds=not args.no_seeds,
                            alpha=args.alpha, time_limit=args.time_limit, seed=args.seed,
                            max_blocks_per_type=args.max_blocks_per_type, max_blocks=args.max_blocks,
                            type_orders=args.type_orders, patience=args.patience,
                            max_stages=args.max_stages, allow_overshoot=args.allow_overshoot,
                            op_boundaries=args.op_boundaries, objective=args.time_model,
                            simulate_finalists=not args.no_simulate_finalists,
                            progress=not args.no_progress, jobs=args.jobs,
                            setup=TrainSetup(args.precision, args.zero_stage, args.grad_reduce))
    plan = plan_job(model, cluster, args.profiles, options, args.profiles_fallback, fleet=fleet)
    added = plan.search.get("analytic_profiles")
    if added:  # said after the search so that an error stays a single line
        print(f"note: analytic profiles (roofline estimates) for {model.name} on "
              f"{', '.join(added)}", file=sys.stderr)
    print(format_plan_table(plan))
    print(format_search_line(plan))
    fleet_line = format_fleet_line(plan)
    if fleet_line:
        print(fleet_line)
    if args.pareto:
        from eth.report.fleet import write_frontier

        print(write_frontier(plan, args.pareto, args.png))
    mixed = plan.search.get("mixed_type_best")
    if mixed:  # faithful Metis: a layout the plan format cannot hold (one device type per stage)
        print(f"note: a Metis layout with mixed-type stages is predicted {mixed['iteration_ms']:.1f} ms "
              f"(plan.search.mixed_type_best); the plan holds the best single-type layout")
    print("(headings and abbreviations: tools/show_plan.py --legend, or hpp-show --legend)")
    if args.output:
        plan.save(args.output)
        print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    """The CLI; bad input or an infeasible problem: ``error: ...`` on stderr, exit 2."""
    from eth.cli.common import run_main
    return run_main(_main, argv)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
