"""Text views of a plan (paper Appendix A, Table 3 style) and of a simulated iteration.

:func:`format_plan_table` prints, per pipeline, ``Pipe-i Mbs=.. Lbs=..`` and one line
per stage: stage index, global ranks, device type x count, TP/DP, number of layers,
recomputed operators with the number of layers each is recomputed in (``4 AS`` =
attention softmax in 4 layers), and the cost model's predicted forward/backward time
per micro-batch and memory per device when the plan carries them.
:func:`format_sim_summary` prints where each stage's time goes in a
:class:`eth.report.simulate.SimResult`; :func:`format_legend` explains every heading and
abbreviation of both (``show_plan.py --legend``).  All return strings; the CLIs print them.
"""
from __future__ import annotations

from types import MappingProxyType

from eth.cost.model import OBJECTIVES
from eth.spec.model import KNOWN_LAYER_OPS, LAYER_OPS, layer_ops

# Short names of the 13 layer ops; AS, AD, Qkv and Sco as in the paper's Table 3.
OP_ABBREV = MappingProxyType({
    "1st-layernorm": "LN1", "qkv": "Qkv", "score": "Sco", "softmax": "AS",
    "attn-dropout": "AD", "context": "Ctx", "attn-dense": "Proj",
    "post-attn-dropout": "PAD", "2nd-layernorm": "LN2", "mlp-gemm-1": "FC1",
    "gelu": "Act", "mlp-gemm-2": "FC2", "post-mlp-dropout": "PMD",
    # ops of other layer kinds (eth.spec.model.layer_ops)
    "1st-rmsnorm": "RN1", "2nd-rmsnorm": "RN2", "rotary": "Rope", "fused-attention": "FA",
    "swiglu": "Swi", "relu": "ReLU",
})


OP_NAMES = MappingProxyType({
    "1st-layernorm": "layernorm before attention", "qkv": "fused query/key/value projection",
    "score": "attention scores Q.K^T", "softmax": "attention softmax",
    "attn-dropout": "attention-probability dropout", "context": "attention-weighted values",
    "attn-dense": "attention output projection", "post-attn-dropout": "dropout after attention",
    "2nd-layernorm": "layernorm before the MLP", "mlp-gemm-1": "first MLP GEMM (h -> ffn)",
    "gelu": "MLP activation", "mlp-gemm-2": "second MLP GEMM (ffn -> h)",
    "post-mlp-dropout": "dropout after the MLP",
    "1st-rmsnorm": "RMSNorm before attention", "2nd-rmsnorm": "RMSNorm before the MLP",
    "rotary": "rotary position embedding of q and k",
    "fused-attention": "softmax(Q.K^T)V in one kernel (no s x s tensors kept)",
    "swiglu": "MLP activation silu(gate) * up", "relu": "MLP activation relu",
})

_PLAN_TERMS = (
    ("Pipe-i", "pipeline i: an independent pipeline, a data-parallel replica of the whole model"),
    ("Mbs", "micro-batch size of the pipeline (samples per micro-batch)"),
    ("Lbs", "local batch size: the pipeline's share of the global batch (gbs = sum of Lbs)"),
    ("micro-batches", "Lbs / Mbs, the 1F1B micro-batches the pipeline runs per iteration"),
    ("pred.", "the pipeline's predicted end: 1F1B, its stages' gradient All-Reduce and optimizer step,\n"
              "by the plan's objective (gradient blocks, or the paper's Eq. 5)"),
    ("Stage", "stage index inside the pipeline (0 holds the embedding, the last one the loss)"),
    ("Ranks", "global ranks of the stage (torchrun RANK; node-major, as the cluster YAML lists nodes)"),
    ("Dev.", "device type x number of devices of the stage"),
    ("TP/DP", "tensor-parallel degree / data-parallel degree inside the stage (TP x DP = devices)"),
    ("#L", "number of transformer layers of the stage"),
    ("Layers", "first-last layer index (inclusive)"),
    ("Recomp. Operator", "ops recomputed in the backward pass: 'n OP' = OP is recomputed\n"
                         "in the stage's first n layers; None = nothing recomputed"),
    ("Fwd ms / Bwd ms", "cost-model forward / backward time of one micro-batch on the stage"),
    ("Mem GB", "cost-model peak memory per device; '!' = above the device's capacity"),
)

_SIM_TERMS = (
    ("1F1B end", "time at which the stage finishes its last backward pass"),
    ("Compute", "forward + backward (+ recompute) time of the stage"),
    ("Bubble", "idle time before the stage's last backward (pipeline fill and drain)"),
    ("AllReduce", "block-wise gradient All-Reduce time of the stage"),
    ("Optimizer", "optimizer-step time"),
    ("Idle", "iteration - compute - all-reduce - optimizer"),
    ("Busy %", "(compute + all-reduce + optimizer) / iteration"),
)


def format_legend() -> str:
    """What every heading and abbreviation of the plan table and the simulation means."""
    lines = ["Plan table (tools/search_hpp.py, tools/show_plan.py):"]
    lines += [f"  {k:<17} " + v.replace("\n", "\n" + " " * 20) for k, v in _PLAN_TERMS]
    lines.append("Recomputed operators (one GPT layer has these 13 ops):")
    lines += [f"  {OP_ABBREV[op]:<5} {op:<18} {OP_NAMES[op]}" for op in LAYER_OPS]
    lines.append("  other layer kinds (model norm rmsnorm, position rope, attention fused, swiglu):")
    lines += [f"  {OP_ABBREV[op]:<5} {op:<18} {OP_NAMES[op]}" for op in KNOWN_LAYER_OPS if op not in LAYER_OPS]
    lines.append("Simulated iteration (tools/show_plan.py; times in ms):")
    lines += [f"  {k:<17} {v}" for k, v in _SIM_TERMS]
    lines.append("Short forms elsewhere: tp, dp, pp = tensor-, data-, pipeline-parallel degree; "
                 "mbs, lbs, gbs = micro-, local, global batch size.")
    return "\n".join(lines)


def format_ranks(ranks) -> str:
    """Compress sorted runs: [0, 1, 2, 3, 6] -> "0-3,6"."""
    ranks = list(ranks)
    if not ranks:
        return "-"
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def format_recompute(recompute: dict) -> str:
    """{"softmax": 4, "attn-dropout": 4} -> "4 AS, 4 AD" (layer-op order)."""
    items = [(op, n) for op, n in recompute.items() if n]
    if not items:
        return "None"
    order = {op: i for i, op in enumerate(KNOWN_LAYER_OPS)}
    items.sort(key=lambda item: order.get(item[0], len(order)))
    return ", ".join(f"{n} {OP_ABBREV.get(op, op)}" for op, n in items)


def stage_label(plan, pipeline: int, stage: int) -> str:
    """Short row label: "P0 S1 A100x2 r4-5"."""
    st = plan.pipelines[pipeline].stages[stage]
    return f"P{pipeline} S{stage} {st.device_type}x{len(st.ranks)} r{format_ranks(st.ranks)}"


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    numeric = [all(_is_number(r[i]) for r in rows) and bool(rows) for i in range(len(header))]

    def line(cells):
        out = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)]
        return (indent + "  ".join(out)).rstrip()
    return [line(header)] + [line(r) for r in rows]


def _is_number(text: str) -> bool:
    if text == "-":
        return True
    try:
        float(text)
        return True
    except ValueError:
        return False


def format_plan_table(plan) -> str:
    """Table-3-style text view of ``plan`` (see module docstring)."""
    types = ", ".join(f"{n}x{t}" for t, n in plan.cluster.type_counts().items())
    head = (f"Plan: model {plan.model.name} ({plan.model.num_layers} layers, seq {plan.model.seq_len}), "
            f"gbs {plan.gbs}, cluster {plan.cluster.name} ({plan.world_size} ranks: {types})")
    lines = [head]
    if "iteration_ms" in plan.predicted:
        objective = OBJECTIVES[plan.predicted.get("objective", "eq5")]
        lines.append(f"Predicted iteration (cost model, {objective}): {plan.predicted['iteration_ms']:.2f} ms"
                     + ("" if plan.predicted.get("feasible", True) else "  [INFEASIBLE: memory]"))
    header = ["Stage", "Ranks", "Dev.", "TP/DP", "#L", "Layers", "Recomp. Operator",
              "Fwd ms", "Bwd ms", "Mem GB"]
    over = False
    for i, p in enumerate(plan.pipelines):
        lines.append("")
        extra = f"  pred. {p.predicted['pipeline_ms']:.2f} ms" if "pipeline_ms" in p.predicted else ""
        lines.append(f"Pipe-{i}  Mbs={p.mbs}  Lbs={p.lbs}  ({p.num_microbatches} micro-batches){extra}")
        rows = []
        for j, s in enumerate(p.stages):
            pred = s.predicted
            mem = pred.get("memory_gb")
            cap = pred.get("capacity_gb")
            full = mem is not None and cap is not None and mem > cap
            over = over or full
            mem_text = _num(mem, 2) + ("!" if full else "")
            rows.append([str(j), format_ranks(s.ranks), f"{s.device_type}x{len(s.ranks)}",
                         f"{s.tp}/{s.dp}", str(s.num_layers), format_layers(s, plan.model),
                         format_recompute(s.recompute), _num(pred.get("fwd_ms"), 2),
                         _num(pred.get("bwd_ms"), 2), mem_text])
        lines += _table(header, rows)
    if over:
        lines.append("  (! = predicted memory exceeds the device's capacity)")
    return "\n".join(lines)


def format_layers(stage, model) -> str:
    """"3-5", or with a boundary inside a layer the op it starts at / ends after:
    "1[attn-dropout..]-2[..mlp-gemm-1]"."""
    names = layer_ops(model)
    first, last = stage.ops or (names[0], names[-1])
    start = f"{stage.layers[0]}" + (f"[{first}..]" if first != names[0] else "")
    end = f"{stage.layers[1] - 1}" + (f"[..{last}]" if last != names[-1] else "")
    return f"{start}-{end}"


def format_search_line(plan) -> str:
    """Throughput and search metadata of a plan written by the planner ("" if none)."""
    search = plan.search or {}
    lines = []
    it = plan.predicted.get("iteration_ms")
    if it:
        lines.append(f"{plan.model.name}  gbs={plan.gbs}  devices={plan.world_size}  "
                     f"pipelines={len(plan.pipelines)}  predicted iteration {it:.1f} ms "
                     f"({plan.gbs / it * 1e3:.1f} samples/s)  [{plan.training.precision}, "
                     f"{plan.training.grad_reduce} gradients, ZeRO {plan.training.zero_stage}]")
    if search:
        c = search.get("candidates", {})
        counted = c.get("counted_pipelines")
        scope = (f" (pipeline counts 1..{counted} of {c.get('max_pipelines')})"
                 if counted and counted != c.get("max_pipelines") else "")
        strategy = search.get("strategy", "hpp")
        jobs = (search.get("options") or {}).get("jobs", 1) if strategy == "hpp" else 1
        lines.append(f"search [{strategy}] {search.get('time_s', 0):.2f}s"
                     + (f" (jobs {jobs})" if jobs > 1 else "") + ": "
                     f"{c.get('groups_total', 0)} device groups{scope}, {c.get('evaluated', 0)} evaluated, "
                     f"{c.get('skipped', 0)} skipped, {c.get('by_dp', 0)} from DP, "
                     f"{search.get('cache_hits', 0)} cache hits"
                     + (" [time limit hit]" if search.get("time_limited") else ""))
        if search.get("seed_won"):
            lines.append(f"plan from the {search['seed_won']} seed (faster than the enumerated "
                         f"groups; seeds ms: {search.get('seeds_ms')})")
    return "\n".join(lines)


def format_sim_summary(plan, result) -> str:
    """Per-stage time breakdown of a simulated iteration (:class:`eth.report.simulate.SimResult`)."""
    lines = [f"Simulated iteration (event-driven 1F1B + block All-Reduce + optimizer): "
             f"{result.iteration_ms:.2f} ms"]
    if "iteration_ms" in plan.predicted:
        pred = plan.predicted["iteration_ms"]
        diff = (result.iteration_ms - pred) / pred * 100 if pred else 0.0
        objective = OBJECTIVES[plan.predicted.get("objective", "eq5")]
        lines[0] += f"  (predicted by {objective} {pred:.2f} ms, simulation {diff:+.1f}%)"
    header = ["Pipe", "Stage", "Ranks", "1F1B end", "Compute", "Bubble", "AllReduce",
              "Optimizer", "Idle", "Busy %"]
    rows = []
    for row in result.stages:
        for s in row:
            busy = 100 * s.busy_ms / result.iteration_ms if result.iteration_ms else 0.0
            rows.append([str(s.pipeline), str(s.stage), format_ranks(plan.pipelines[s.pipeline].stages[s.stage].ranks),
                         f"{s.last_backward_ms:.2f}", f"{s.compute_ms:.2f}", f"{s.bubble_ms:.2f}",
                         f"{s.allreduce_ms:.2f}", f"{s.optimizer_ms:.2f}", f"{s.idle_ms:.2f}", f"{busy:.1f}"])
    lines += _table(header, rows)
    lines.append("  (times in ms; Bubble = idle before the stage's last backward, "
                 "Idle = iteration - compute - all-reduce - optimizer)")
    return "\n".join(lines)
