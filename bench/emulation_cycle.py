#!/usr/bin/env python
"""CPU emulation's duty cycle, measured side by side in one process.

A rank emulated at ``emulate_speed`` s computes for c seconds of CPU time and then
sleeps until c / s has passed (``schedule.ComputeClock``).  The profile that predicts c
is measured running continuously.  This script trains the 1-rank ``1st`` plan of
bench/predictor_accuracy.py (tiny GPT, fp32, mbs 4, lbs 16) in ONE process and
alternates rounds without emulation and at ``--speed``, printing the CPU time of the
compute per step in each round: the spread of the unemulated rounds is the host's own
drift, the ratio of the emulated to the unemulated rounds is what sleeping between
calls costs in CPU time (caches and clock speed after each sleep).

    OMP_NUM_THREADS=1 python bench/emulation_cycle.py [--speed 0.25] [--rounds 3] [--steps 12]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", type=float, default=0.25, help="emulate_speed of the emulated rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind (alternating)")
    ap.add_argument("--steps", type=int, default=12, help="training steps per round (the first 2 not counted)")
    args = ap.parse_args(argv)
    if not 0 < args.speed <= 1 or args.rounds < 1 or args.steps < 3:
        print(f"error: need 0 < --speed <= 1, --rounds >= 1, --steps >= 3; got {args.speed}, {args.rounds}, "
              f"{args.steps}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("predictor_accuracy", ROOT / "bench/predictor_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from megatron.hpp.training.loop import Trainer, TrainConfig, prepare

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        bench.CONFIGS["1st"][1]().save(path)
        iters = 2 * args.rounds * args.steps
        cfg = TrainConfig(plan=path, train_iters=iters, log_interval=iters)
        _, layout, rank = prepare(cfg)
        trainer = Trainer(cfg, layout, rank)
        cpu = {0.0: [], args.speed: []}
        it = 0
        for _ in range(args.rounds):
            for speed in (0.0, args.speed):
                trainer.speed = speed
                results = [trainer.step(it + i) for i in range(args.steps)]
                it += args.steps
                ms = statistics.median(r.compute_s[0] for r in results[2:]) * 1e3 * (speed or 1.0)
                cpu[speed].append(ms)
                print(f"emulate_speed {speed:g}: compute CPU time {ms:.1f} ms per step", flush=True)
    off, on = statistics.median(cpu[0.0]), statistics.median(cpu[args.speed])
    print(f"unemulated rounds {min(cpu[0.0]):.1f}..{max(cpu[0.0]):.1f} ms (host drift), emulated at "
          f"{args.speed:g} {min(cpu[args.speed]):.1f}..{max(cpu[args.speed]):.1f} ms; median ratio "
          f"emulated / unemulated {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
