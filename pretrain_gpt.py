"""Train a GPT with an HPP plan (Megatron-style entry point).

    torchrun --nproc-per-node 4 pretrain_gpt.py --hpp-plan examples/plans/cpu-demo.json \
        --train-iters 20 --data-path megatron/hpp/corpus/english

Uses NCCL + CUDA when available, else gloo + CPU (see docs/RUNTIME.md).  A one-rank plan
also runs without torchrun (``python pretrain_gpt.py ...``).  Exit codes: 0 done,
1 stopped (NaN/Inf loss, a rank died or timed out), 2 bad input.
"""
import argparse
import os


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """argparse's error as one line, printed by rank 0 only under torchrun; exit 2."""
        from megatron.hpp.training.failures import report_error

        report_error(f"{message} (python {self.prog} --help lists the flags)")
        self.exit(2)


def parse_args(argv=None):
    from eth.spec.model_source import add_model_args
    from eth.spec.plan_flags import PARALLEL_FLAGS
    from megatron.hpp.data.datasets import DEFAULT_SPLIT

    p = _Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--hpp-plan", help="plan JSON (tools/search_hpp.py output); or --hpp-cluster")
    s = p.add_argument_group("plan at start-up, for the ranks the launcher started (instead of --hpp-plan; "
                             "docs/RUNTIME.md)")
    s.add_argument("--hpp-cluster", metavar="FLEET.yaml",
                   help="cluster YAML of the fleet's device types and links; each rank's type: HPP_DEVICE_TYPE, "
                        "the CUDA device name, or the fleet's only type.  Needs --model and --global-batch-size; "
                        "with --save the plan is kept there and used again for the same ranks")
    s.add_argument("--model", metavar="PRESET|FILE", help="the model to plan (preset, model YAML or config.json)")
    s.add_argument("--hpp-profiles", metavar="FILE|DIR", help="op profiles (default: analytic estimates)")
    s.add_argument("--hpp-time-limit", type=float, default=0.0,
                   help="seconds for the search at start-up, 0 = none (keep it under the collective timeout)")
    s.add_argument("--hpp-objective", choices=("throughput", "cost"), default=None,
                   help="let the plan leave nodes out (the fleet choice of tools/search_hpp.py --objective): their "
                        "ranks exit; default: a plan for every rank started")
    s.add_argument("--hpp-min-throughput", type=float, default=0.0, metavar="SAMPLES_PER_S",
                   help="with --hpp-objective: samples/s the plan must reach")
    s.add_argument("--hpp-max-cost-per-hour", type=float, default=0.0, metavar="USD",
                   help="with --hpp-objective: USD/h the plan may cost (the fleet file's price_per_hour)")
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="cosine decay floor (default: constant lr)")
    p.add_argument("--lr-decay-style", choices=("constant", "cosine"), default=None,
                   help="constant, or cosine from --lr to --min-lr (default: cosine when --min-lr is given)")
    p.add_argument("--warmup", "--lr-warmup-iters", dest="warmup", type=int, default=0,
                   help="linear warm-up iterations")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip, 0 = off")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=1,
                   help="rank 0 logs averages over this many iterations")
    p.add_argument("--tensorboard-dir", default=None,
                   help="also write the logged numbers here (needs the tensorboard package)")
    p.add_argument("--save-params", default=None, help="rank 0 writes full parameters + losses here")
    c = p.add_argument_group("checkpoints (any plan of the same model can resume them; docs/RUNTIME.md)")
    c.add_argument("--save", default=None, metavar="DIR", help="write checkpoints here (and at the end)")
    c.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    c.add_argument("--load", default=None, metavar="DIR",
                   help="resume from the latest complete checkpoint in DIR; DIR must hold one, unless it "
                        "is the --save folder (then nothing there yet starts fresh)")
    c.add_argument("--verify-checkpoint", action=argparse.BooleanOptionalAction, default=None,
                   help="compare every file of the checkpoint to load with its SHA-256 (one read of the "
                        "checkpoint, shared by the ranks; the default with --load); --no-verify-checkpoint "
                        "checks only sizes and the small files")
    c.add_argument("--exit-interval", type=int, default=None,
                   help="stop after an iteration divisible by this (after saving)")
    d = p.add_argument_group("data (default: synthetic sequences; docs/DATA.md)")
    d.add_argument("--data-path", nargs="+", default=None, metavar="PREFIX",
                   help="megatron-core indexed datasets (.bin/.idx prefixes from tools/preprocess_data.py): "
                        "PREFIX [PREFIX ...] or W PREFIX W PREFIX ...; the shipped English corpus is "
                        "megatron/hpp/corpus/english")
    d.add_argument("--split", default=None,
                   help=f"train,valid,test shares of each dataset's documents (default {DEFAULT_SPLIT})")
    d.add_argument("--data-cache-path", default=None,
                   help="index cache folder, shared by all nodes (default ~/.cache/hpp-eth/datasets)")
    d.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every this many iterations and after the last (default: none)")
    d.add_argument("--eval-iters", type=int, default=10, help="validation global batches per evaluation")
    f = p.add_argument_group("failures")
    f.add_argument("--max-nan-iters", type=int, default=3,
                   help="stop (exit 1) after this many consecutive iterations with a NaN/Inf loss or "
                        "gradient norm")
    f.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (torchrun, Slurm, Kubernetes send it before killing), finish the "
                        "iteration, save a checkpoint with --save and exit 0")
    f.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of collectives and p2p transfers: a dead or stuck rank ends every rank")
    g = p.add_argument_group("gradient path (default: what the plan was made for, plan.training)")
    g.add_argument("--grad-sync", default="block", choices=("block", "device", "tensor"),
                   help="block-wise All-Reduce (paper 4.3), or device-wise (padded) / tensor-wise "
                        "(one collective per tensor shard) for comparison")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000,
                   help="largest gradient bucket in elements (one collective each, launched during "
                        "the backward pass); 0 = one per fused buffer")
    g.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2),
                   help="must match the plan's; 1 shards optimizer state, 2 also gradients")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                      help="bf16 weights/activations (must match the plan)")
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                      help="fp16 with dynamic loss scaling (must match the plan)")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                      help="fp32 throughout (must match the plan)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16,
                   help="fp16: starting dynamic loss scale (torch.amp's default 2^16)")
    g.add_argument("--grad-reduce-in-bf16", dest="grad_reduce", action="store_const", const="bf16",
                   default=None, help="accumulate and reduce gradients in bf16 (must match the plan)")
    m = p.add_argument_group("decided by the plan (Megatron-LM's names; given, they must match it)")
    for dest, flag in PARALLEL_FLAGS.items():
        m.add_argument(flag, dest=dest, type=int, default=None)
    add_model_args(p, model=False, title="the plan's model (Megatron-LM's names; given, they must match it)")
    return p.parse_args(argv)


def plan_flags(args) -> dict:
    """The flags the plan decides, as given ({argparse dest: value})."""
    from eth.spec.model_source import overrides_of
    from eth.spec.plan_flags import PARALLEL_FLAGS

    return {**{d: getattr(args, d) for d in PARALLEL_FLAGS if getattr(args, d) is not None}, **overrides_of(args)}


def plan_request(args):
    """The startup_plan.PlanRequest of --hpp-cluster (None with --hpp-plan); checks the
    fleet file, the model and the profiles path (SpecError) before any process group."""
    from eth.errors import SpecError

    if (args.hpp_plan is None) == (args.hpp_cluster is None):
        raise SpecError("give --hpp-plan PLAN.json (a plan made by tools/search_hpp.py) or --hpp-cluster "
                        "FLEET.yaml (plan at start-up), not " + ("both" if args.hpp_plan else "neither"))
    if args.hpp_cluster is None:
        for flag, value in (("--model", args.model), ("--hpp-profiles", args.hpp_profiles),
                            ("--hpp-objective", args.hpp_objective)):
            if value is not None:
                raise SpecError(f"{flag} {value} is read with --hpp-cluster only (the plan names its model "
                                f"and devices and was searched with its profiles)")
        return None
    from eth.spec.cluster import load_cluster
    from eth.spec.model_source import apply_overrides, load_model, overrides_of
    from megatron.hpp.training.startup_plan import PlanRequest

    if args.model is None or args.global_batch_size is None:
        raise SpecError("--hpp-cluster plans at start-up: give --model and --global-batch-size")
    if args.global_batch_size <= 0:
        raise SpecError(f"--global-batch-size must be positive, got {args.global_batch_size}")
    if not 0 <= args.hpp_time_limit < float("inf"):   # NaN fails both
        raise SpecError(f"--hpp-time-limit must be a number of seconds >= 0 (0: none), got {args.hpp_time_limit}")
    if args.hpp_profiles is not None and not os.path.exists(args.hpp_profiles):
        raise SpecError(f"--hpp-profiles {args.hpp_profiles} does not exist")
    for flag, value in (("--hpp-min-throughput", args.hpp_min_throughput),
                        ("--hpp-max-cost-per-hour", args.hpp_max_cost_per_hour)):
        if value and args.hpp_objective is None:
            raise SpecError(f"{flag} constrains the fleet choice: give --hpp-objective throughput|cost too")
    fleet = load_cluster(args.hpp_cluster)
    if args.hpp_objective is not None:
        from eth.planner.fleet import FleetOptions

        FleetOptions(args.hpp_objective, min_throughput=args.hpp_min_throughput,
                     max_cost_per_hour=args.hpp_max_cost_per_hour).check(fleet)
    overrides = overrides_of(args)
    apply_overrides(load_model(args.model, overrides.get("seq_length")), overrides)
    return PlanRequest(args.hpp_cluster, args.model, args.global_batch_size, overrides, args.hpp_profiles,
                       args.precision or "bf16", args.zero_stage or 0, args.grad_reduce or "fp32",
                       args.hpp_time_limit, args.hpp_objective or "", args.hpp_min_throughput,
                       args.hpp_max_cost_per_hour)


def main(argv=None) -> int:
    from megatron.hpp.training.failures import checking_input

    with checking_input():   # torchrun's SIGTERM while the ranks check: exit 2 (failures.py)
        cfg = config(argv)
    if cfg is None:
        return 2
    from megatron.hpp.training.loop import run

    return run(cfg)


def config(argv=None):
    """The run's TrainConfig from the command line; None after a one-line error."""
    from eth.errors import SpecError
    from megatron.hpp.data.datasets import DEFAULT_SPLIT
    from megatron.hpp.training.failures import report_error
    from megatron.hpp.training.loop import TrainConfig, check_outputs

    args = parse_args(argv)
    try:
        if args.data_path is None:
            for flag, value in (("--split", args.split), ("--data-cache-path", args.data_cache_path)):
                if value is not None:
                    raise SpecError(f"{flag} {value} without --data-path: synthetic data has no documents "
                                    f"to split or index (give --data-path PREFIX, or drop {flag})")
        if args.lr_decay_style == "cosine" and args.min_lr is None:
            args.min_lr = 0.0
        if args.lr_decay_style == "constant" and args.min_lr is not None:
            raise SpecError(f"--lr-decay-style constant with --min-lr {args.min_lr}: give one of them")
        cfg = TrainConfig(plan=args.hpp_plan, startup=plan_request(args), train_iters=args.train_iters, lr=args.lr,
                          min_lr=args.min_lr, plan_flags=plan_flags(args), warmup=args.warmup, weight_decay=args.weight_decay,
                          clip_grad=args.clip_grad, seed=args.seed, log_interval=args.log_interval,
                          data_path=args.data_path, split=args.split or DEFAULT_SPLIT,
                          data_cache_path=args.data_cache_path, save_params=args.save_params,
                          save=args.save, save_interval=args.save_interval, load=args.load,
                          verify_checkpoint=(args.load is not None if args.verify_checkpoint is None
                                             else args.verify_checkpoint),
                          exit_interval=args.exit_interval,
                          max_nan_iters=args.max_nan_iters, exit_signal_handler=args.exit_signal_handler,
                          distributed_timeout_minutes=args.distributed_timeout_minutes,
                          tensorboard_dir=args.tensorboard_dir,
                          grad_sync=args.grad_sync, bucket_numel=args.ddp_bucket_size,
                          precision=args.precision, zero_stage=args.zero_stage,
                          grad_reduce=args.grad_reduce, initial_loss_scale=args.initial_loss_scale,
                          eval_interval=args.eval_interval, eval_iters=args.eval_iters)
        check_outputs(cfg)   # before a plan at start-up writes into --save
    except SpecError as exc:
        report_error(str(exc))   # every rank finds it; rank 0 prints it
        return None
    return cfg


if __name__ == "__main__":
    from megatron.hpp.rank_exit import exit_rank

    exit_rank(main())   # no interpreter exit to race gloo's threads (rank_exit.py)
