"""Megatron-LM's parallelism, batch and model flags on a run that follows a plan.

The plan decides the micro-batch sizes, the global batch, tp per stage, the stages per
pipeline and the model, so ``pretrain_gpt.py`` accepts Megatron's names for them only
to check them (:func:`check_plan_flags`): a flag that equals what the plan says is fine,
one that differs is a one-line error giving the plan's value and how to re-plan.
"""
from __future__ import annotations

from dataclasses import fields

from eth.errors import SpecError
from eth.spec.model_source import OVERRIDE_FLAGS, apply_overrides

PARALLEL_FLAGS = {
    "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size",
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
}
"""argparse dest -> Megatron flag."""
REPLAN = "re-plan with tools/search_hpp.py or drop the flag"


def _plan_values(plan, dest: str) -> list[int]:
    """The distinct values ``plan`` has for a parallel flag, in pipeline / stage order."""
    if dest == "global_batch_size":
        values = [plan.gbs]
    elif dest == "micro_batch_size":
        values = [p.mbs for p in plan.pipelines]
    elif dest == "tensor_model_parallel_size":
        values = [s.tp for p in plan.pipelines for s in p.stages]
    else:
        values = [len(p.stages) for p in plan.pipelines]
    return list(dict.fromkeys(values))


def check_plan_flags(plan, given: dict) -> None:
    """SpecError unless every flag in ``given`` (``{argparse dest: value}``, None = not
    given) is what ``plan`` decides: the parallel flags above and the model flags of
    :mod:`eth.spec.model_source` (applied to the plan's model, it must stay the same)."""
    given = {k: v for k, v in given.items() if v is not None}
    for dest, flag in PARALLEL_FLAGS.items():
        if dest not in given:
            continue
        values = _plan_values(plan, dest)
        if values != [given[dest]]:
            where = "" if dest == "global_batch_size" else (
                " (per pipeline)" if dest in ("micro_batch_size", "pipeline_model_parallel_size") else " (per stage)")
            raise SpecError(f"{flag} {given[dest]} but the plan has {', '.join(map(str, values))}{where}; {REPLAN}")
    model_flags = {d: v for d, v in given.items() if d in OVERRIDE_FLAGS}
    if not model_flags:
        return
    want = apply_overrides(plan.model, model_flags)
    if want == plan.model:
        return
    differ = [f.name for f in fields(want) if getattr(want, f.name) != getattr(plan.model, f.name)]
    dest = next((d for d in model_flags if OVERRIDE_FLAGS[d][1] in differ), next(iter(model_flags)))
    has = ", ".join(f"{name} {getattr(plan.model, name)!r}" for name in differ)
    raise SpecError(f"{OVERRIDE_FLAGS[dest][0]} {model_flags[dest]} does not match the plan's model "
                    f"{plan.model.name} ({has}); {REPLAN}")
