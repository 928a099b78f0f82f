#!/usr/bin/env python
"""Block-wise vs device-wise vs tensor-wise gradient synchronisation (paper Fig. 10b).

    python bench/grad_sync.py                      # gloo runs of two plans, side by side
    python bench/grad_sync.py --count-only PLAN    # from the plan's topology alone, any size

Gloo mode trains each plan (``small`` GPT, fp32, ZeRO 0) with every strategy in the
same processes and prints, per strategy and as ratios against block-wise: collectives
per rank, bytes each rank sends (ring algorithms: an all-reduce of B bytes over N
ranks sends 2 B (N - 1) / N), gradient-buffer memory per rank and its excess over
the rank's own gradients (padding), the time of the reduction alone (every buffer
reduced once, median over repeats, slowest rank), and the iteration time.

Count-only mode builds ``eth.layout.blocks.GradLayout`` of a plan file for each strategy
(no processes, no torch) and prints the same counts plus the alpha-beta time of the
collectives run one after another on each rank's slowest link; then the model-state
bytes per rank under ZeRO 0/1/2 in bf16 (``eth.cost.sync.rank_state_bytes``) and the
cost model's largest stage memory (activations included) against capacity.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
STRATEGIES = ("block", "device", "tensor")


# ---------------------------------------------------------------- counting
def sent_bytes(ranks, nbytes, zero: int) -> float:
    """Bytes one participant sends in the collective(s) of a buffer (ring algorithms)."""
    n = len(ranks)
    return (2 if zero == 0 else 1) * nbytes * (n - 1) / n


def count_layout(plan, strategy: str, setup, bucket_numel: int) -> dict:
    """Per-rank collectives, sent bytes, gradient-buffer bytes and alpha-beta time."""
    from eth.layout.blocks import GradLayout
    from eth.profiles.db import collective_ms
    from eth.cost.sync import rank_state_bytes

    layout = GradLayout(plan, strategy, bucket_numel)
    own = {r: v["weights"] // setup.weight_bytes * setup.grad_bytes
           for r, v in rank_state_bytes(plan, setup).items()}
    g, w = setup.grad_bytes, setup.weight_bytes
    rows = {r: {"collectives": 0, "sent": 0.0, "buffer": 0, "ms": 0.0} for r in range(plan.world_size)}
    links: dict = {}
    for b in layout.buffers:
        numel = b.padded_numel if setup.zero_stage else b.numel
        if b.ranks not in links:
            links[b.ranks] = plan.cluster.link_gbps(list(b.ranks)) if len(b.ranks) > 1 else 0
        for r in b.ranks:
            rows[r]["buffer"] += numel * g
            if len(b.ranks) == 1:
                continue
            if setup.zero_stage == 0:
                rows[r]["collectives"] += 1
                rows[r]["sent"] += sent_bytes(b.ranks, numel * g, 0)
                rows[r]["ms"] += collective_ms("all_reduce", len(b.ranks), numel * g, links[b.ranks], None)
            else:
                rows[r]["collectives"] += 2
                rows[r]["sent"] += sent_bytes(b.ranks, numel * (g + w), 1)
                rows[r]["ms"] += (collective_ms("reduce_scatter", len(b.ranks), numel * g, links[b.ranks], None)
                                  + collective_ms("all_gather", len(b.ranks), numel * w, links[b.ranks], None))
    for r, row in rows.items():
        row["extra"] = row["buffer"] - own[r]
    return rows


def _summary(rows) -> dict:
    vals = list(rows.values())
    return {"collectives": max(v["collectives"] for v in vals), "sent": max(v["sent"] for v in vals),
            "buffer": max(v["buffer"] for v in vals), "extra": max(v["extra"] for v in vals),
            "ms": max(v["ms"] for v in vals)}


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if b else "-"


def count_only(path: str, bucket_numel: int) -> int:
    from eth.spec.plan import load_plan
    from eth.spec.precision import TrainSetup

    plan = load_plan(path)
    setup = TrainSetup("bf16", 0, "fp32")
    print(f"plan {path}: {plan.model.name}, {plan.world_size} ranks, {len(plan.pipelines)} pipelines, "
          f"bf16 weights, fp32 gradients, ZeRO 0, bucket {bucket_numel or 'none'}")
    print(f"{'strategy':8} {'coll/rank':>9} {'sent GB/rank':>12} {'buffer GB/rank':>14} "
          f"{'padding GB':>10} {'a-b ms':>9}   vs block: coll, sent, buffer, ms")
    res = {s: _summary(count_layout(plan, s, setup, bucket_numel)) for s in STRATEGIES}
    for s, r in res.items():
        b = res["block"]
        print(f"{s:8} {r['collectives']:9d} {r['sent'] / 1e9:12.3f} {r['buffer'] / 1e9:14.3f} "
              f"{r['extra'] / 1e9:10.3f} {r['ms']:9.1f}   {_ratio(r['collectives'], b['collectives'])}, "
              f"{_ratio(r['sent'], b['sent'])}, {_ratio(r['buffer'], b['buffer'])}, {_ratio(r['ms'], b['ms'])}")
    memory_table(plan)
    return 0


def memory_table(plan) -> None:
    """Model-state bytes per rank and the cost model's stage memory under ZeRO 0/1/2, bf16."""
    from eth.cost.model import CostModel
    from eth.spec.precision import TrainSetup
    from eth.profiles.db import ProfileDB
    from eth.cost.sync import rank_state_bytes

    db = ProfileDB()
    db.ensure(plan.model, plan.cluster.types.values())
    print("\nmodel state per rank, bf16 weights + fp32 gradients + fp32 main weights and Adam "
          "(GB, largest rank of each device type), and the cost model's largest stage memory:")
    types = sorted({plan.cluster.devices[r].type for r in range(plan.world_size)})
    for zero in (0, 1, 2):
        setup = TrainSetup("bf16", zero, "fp32")
        peak = TrainSetup("bf16", 1, "fp32") if zero == 2 else setup
        state, at_peak = rank_state_bytes(plan, setup), rank_state_bytes(plan, peak)
        parts = []
        for t in types:
            ranks = [r for r in range(plan.world_size) if plan.cluster.devices[r].type == t]
            worst = max(ranks, key=lambda r: sum(at_peak[r].values()))
            s = state[worst]
            parts.append(f"{t}: weights {s['weights'] / 1e9:.2f} grads {s['grads'] / 1e9:.2f} "
                         f"(peak {at_peak[worst]['grads'] / 1e9:.2f}) optimizer {s['optimizer'] / 1e9:.2f}")
        ev = CostModel(plan.model, plan.cluster, db, setup).evaluate(plan)
        worst = max((c for pp in ev["pipelines"] for c in pp["costs"]), key=lambda c: c.memory_bytes / c.capacity_bytes)
        print(f"  ZeRO {zero}: " + "; ".join(parts)
              + f"; fullest stage {worst.memory_bytes / 1e9:.1f} of {worst.capacity_bytes / 1e9:.0f} GB")


# ---------------------------------------------------------------- gloo runs
def bench_plans():
    from eth.spec.cluster import Cluster
    from eth.spec.model import get_model
    from eth.spec.plan import PipelinePlan, Plan, StagePlan

    model = get_model("small")

    def make(n, pipes):
        c = Cluster.from_dict({"name": f"bench-{n}", "inter_node_gbps": 100,
                               "nodes": [{"type": "A100", "devices_per_node": n}]})
        return Plan(model, c, 16, pipes)

    def st(ranks, tp, dp, layers):
        return StagePlan(list(ranks), "A100", tp, dp, tuple(layers))

    L = model.num_layers
    return {
        "fig5: dp 2 | tp 2 (4 ranks)": make(4, [PipelinePlan(4, 8, [st([0, 1], 1, 2, (0, L))]),
                                                PipelinePlan(4, 8, [st([2, 3], 2, 1, (0, L))])]),
        "tp 4 | tp 2 -> tp 1 (7 ranks)": make(7, [PipelinePlan(2, 8, [st([0, 1, 2, 3], 4, 1, (0, L))]),
                                                  PipelinePlan(2, 8, [st([4, 5], 2, 1, (0, L // 2)),
                                                                      st([6], 1, 1, (L // 2, L))])]),
    }


def worker(plan_path: str, out: str, steps: int, repeats: int) -> None:
    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    import torch.distributed as dist

    from eth.spec.plan import load_plan
    from megatron.hpp.parallel.topology import check_plan
    from megatron.hpp.training.loop import TrainConfig, Trainer

    rank, result = int(os.environ["RANK"]), {}
    for strategy in STRATEGIES:
        cfg = TrainConfig(plan=plan_path, train_iters=steps + 1, grad_sync=strategy)
        trainer = Trainer(cfg, check_plan(load_plan(plan_path), int(os.environ["WORLD_SIZE"])), rank)
        trainer.step(0)   # warm-up
        iters = []
        for it in range(1, steps + 1):
            iters.append(trainer.step(it).elapsed_s)
        collectives = list(trainer.reducer.collectives)
        reduce_s = []
        for _ in range(repeats):   # the reduction alone: every buffer once, same sizes
            dist.barrier()
            trainer.reducer.start_step()
            t0 = time.perf_counter()
            trainer.reducer.finish()
            reduce_s.append(time.perf_counter() - t0)
        trainer.reducer.remove_hooks()
        result[strategy] = {"collectives": len(collectives),
                            "sent": sum(sent_bytes(r, b, 0) for r, b in collectives),
                            "buffer": trainer.reducer.state_bytes(),
                            "own": sum(p.numel() for p in trainer.model.parameters()) * 4,
                            "reduce_s": statistics.median(reduce_s), "iter_s": statistics.median(iters)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run_plan(name, plan, steps, repeats) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan.save(path)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(path), str(out),
                                   str(steps), str(repeats)],
                                  env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),
                                           WORLD_SIZE=str(plan.world_size), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                                           PYTHONWARNINGS="ignore"))
                 for r in range(plan.world_size)]
        if any(p.wait() for p in procs):
            raise SystemExit(f"{name}: a rank failed")
        ranks = json.loads(out.read_text())
    agg = {s: {"collectives": max(r[s]["collectives"] for r in ranks),
               "sent": max(r[s]["sent"] for r in ranks),
               "buffer": max(r[s]["buffer"] for r in ranks),
               "extra": max(r[s]["buffer"] - r[s]["own"] for r in ranks),
               "reduce_ms": max(r[s]["reduce_s"] for r in ranks) * 1e3,
               "iter_ms": max(r[s]["iter_s"] for r in ranks) * 1e3} for s in STRATEGIES}
    print(f"\n{name}: {plan.model.name} ({sum(1 for _ in plan.pipelines)} pipelines), fp32, ZeRO 0, gloo; "
          f"largest rank")
    print(f"{'strategy':8} {'coll/rank':>9} {'sent MB':>8} {'buffer MB':>9} {'padding MB':>10} "
          f"{'reduce ms':>9} {'iter ms':>8}   vs block: coll, sent, buffer, reduce, iter")
    b = agg["block"]
    for s, r in agg.items():
        print(f"{s:8} {r['collectives']:9d} {r['sent'] / 1e6:8.2f} {r['buffer'] / 1e6:9.2f} "
              f"{r['extra'] / 1e6:10.2f} {r['reduce_ms']:9.1f} {r['iter_ms']:8.1f}   "
              f"{_ratio(r['collectives'], b['collectives'])}, {_ratio(r['sent'], b['sent'])}, "
              f"{_ratio(r['buffer'], b['buffer'])}, {_ratio(r['reduce_ms'], b['reduce_ms'])}, "
              f"{_ratio(r['iter_ms'], b['iter_ms'])}")


def main(argv=None) -> int:
    """Bad input (a missing or invalid plan file): one ``error:`` line, exit 2 (run_main)."""
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count-only", metavar="PLAN", help="count from a plan file's topology, no processes")
    parser.add_argument("--bucket", type=int, default=0,
                        help="count-only: bucket size in elements (0 = one per fused buffer)")
    parser.add_argument("--steps", type=int, default=3, help="timed iterations per strategy")
    parser.add_argument("--repeats", type=int, default=5, help="timed reductions per strategy")
    args = parser.parse_args(argv)
    if args.count_only:
        return count_only(args.count_only, args.bucket)
    print(f"gloo, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    for name, plan in bench_plans().items():
        run_plan(name, plan, args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    from eth.cli.common import run_main

    sys.exit(main() if sys.argv[1:2] == ["--worker"] else run_main(main))
