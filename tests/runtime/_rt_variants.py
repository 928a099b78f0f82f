"""Rank program of the gradient-path tests: one launch trains a plan under several
gradient-path variants in turn (each a fresh Trainer on the same process group).

    python _rt_variants.py PLAN OUT_DIR VARIANTS_JSON

VARIANTS_JSON is a list of {"name": ..., "training": {TrainSetup fields} (optional:
the plan re-made for that setup), TrainConfig field: value, ...}.  For each
variant rank 0 writes OUT_DIR/NAME.pt ({"losses", "params"}: full fp32 parameters
gathered after training), and every rank writes OUT_DIR/NAME.rank{r}.json with its
model-state bytes counted from the tensors (weights, gradient buffers, optimizer
state) and the collectives of its last step ((participants, bytes) each).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def run_variant(plan_path: str, out: Path, variant: dict) -> None:
    import torch

    from megatron.hpp.distributed.grad_sync import gather_parameters
    from megatron.hpp.parallel.topology import check_plan
    from megatron.hpp.training.loop import TrainConfig, Trainer
    from eth.spec.plan import load_plan

    from eth.spec.precision import TrainSetup

    variant = dict(variant)
    name, training = variant.pop("name"), variant.pop("training", None)
    rank = int(os.environ["RANK"])
    plan = load_plan(plan_path)
    if training is not None:   # the plan made for another precision / ZeRO stage
        plan.training = TrainSetup(**training)
        plan_path = str(out / f"{name}.rank{rank}.plan.json")
        plan.save(plan_path)
    cfg = TrainConfig(plan=plan_path, **variant)
    trainer = Trainer(cfg, check_plan(plan, int(os.environ["WORLD_SIZE"])), rank)
    losses, skipped = [], 0
    for it in range(cfg.train_iters):
        result = trainer.step(it)
        losses.append(result.loss)
        skipped += result.skipped
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    record = {"weights": weights, "grads": trainer.reducer.state_bytes(),
              "optimizer": trainer.optimizer.state_bytes(),
              "collectives": [[list(r), b] for r, b in trainer.reducer.collectives],
              "skipped": skipped, "launched_early": trainer.reducer.launched_early,
              "finite": all(map(math.isfinite, losses))}
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(record))
    params = gather_parameters(trainer.model, trainer.topo)
    trainer.reducer.remove_hooks()
    if rank == 0:
        torch.save({"losses": losses, "params": params}, out / f"{name}.pt")


def main() -> int:
    from megatron.hpp import compat

    compat.quiet_megatron_warnings()
    plan_path, out, variants = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    import torch.distributed as dist

    try:
        for variant in variants:
            run_variant(plan_path, out, variant)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron.hpp.rank_exit import exit_rank

    exit_rank(main())
