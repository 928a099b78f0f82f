"""Train a GPT with an HPP plan (Megatron-style entry point).

    torchrun --nproc-per-node 4 pretrain_gpt.py --hpp-plan examples/plans/cpu-demo.json \
        --train-iters 20

Uses NCCL + CUDA when available, else gloo + CPU (see docs/RUNTIME.md).
"""
import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hpp-plan", required=True, help="plan JSON (tools/search_hpp.py output)")
    p.add_argument("--train-iters", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=None, help="cosine decay floor (default: constant lr)")
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up iterations")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip, 0 = off")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--data-path", default=None, help="byte-level text file (default: synthetic data)")
    p.add_argument("--save-params", default=None, help="rank 0 writes full parameters + losses here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from eth.errors import SpecError
    from megatron.hpp.training import TrainConfig, run

    args = parse_args(argv)
    try:
        cfg = TrainConfig(plan=args.hpp_plan, train_iters=args.train_iters, lr=args.lr,
                          min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay,
                          clip_grad=args.clip_grad, seed=args.seed, log_interval=args.log_interval,
                          data_path=args.data_path, save_params=args.save_params)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
