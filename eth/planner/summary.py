"""Readable Table-3-style summary of a plan (paper appendix A)."""
from __future__ import annotations

from types import MappingProxyType

from eth.plan import Plan

# Short names as in the paper's Table 3 (read-only).
OP_SHORT = MappingProxyType({
    "1st-layernorm": "LN1", "qkv": "Qkv", "score": "Sco", "softmax": "AS", "attn-dropout": "AD",
    "context": "Ctx", "attn-dense": "Dense", "post-attn-dropout": "PAD", "2nd-layernorm": "LN2",
    "mlp-gemm-1": "G1", "gelu": "Gelu", "mlp-gemm-2": "G2", "post-mlp-dropout": "PMD",
})


def _recompute_text(rec: dict, num_layers: int) -> str:
    if not rec:
        return "None"
    parts = []
    for op, n in rec.items():
        name = OP_SHORT.get(op, op)
        parts.append(name if n == num_layers else f"{n} {name}")
    return ", ".join(parts)


def _short_type(t: str) -> str:
    return t[3:] if t.startswith("910") else t


def format_plan(plan: Plan) -> str:
    """One row per stage: pipeline, stage, devices, TP/DP, #L, recompute, Mbs, Lbs."""
    rows = [("Pipeline", "Stage", "Dev.", "TP/DP", "#L", "Layers", "Recomp. Operator", "T ms", "Mem GB")]
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            head = f"Pipe-{i} Mbs={p.mbs} Lbs={p.lbs}" if j == 0 else ""
            pred = s.predicted or {}
            t = pred.get("fwd_ms", 0.0) + pred.get("bwd_ms", 0.0)
            mem = pred.get("memory_gb")
            rows.append((head, str(j), f"{_short_type(s.device_type)}x{len(s.ranks)}", f"{s.tp}/{s.dp}",
                         str(s.num_layers), f"[{s.layers[0]},{s.layers[1]})",
                         _recompute_text(s.recompute, s.num_layers), f"{t:.1f}",
                         "" if mem is None else f"{mem:.1f}/{pred.get('capacity_gb', 0):.0f}"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    pred = plan.predicted or {}
    it = pred.get("iteration_ms")
    lines.append("-" * len(lines[0]))
    footer = f"{plan.model.name}  gbs={plan.gbs}  devices={plan.world_size}  pipelines={len(plan.pipelines)}"
    if it is not None:
        footer += f"  predicted iteration {it:.1f} ms ({plan.gbs / it * 1e3:.1f} samples/s)"
    lines.append(footer)
    s = plan.search or {}
    if s:
        c = s.get("candidates", {})
        lines.append(f"search {s.get('time_s', 0):.2f}s: {c.get('groups_total', 0)} device groups, "
                     f"{c.get('evaluated', 0)} evaluated, {c.get('skipped', 0)} skipped, "
                     f"{c.get('by_dp', 0)} from DP, {s.get('cache_hits', 0)} cache hits"
                     + (" [time limit hit]" if s.get("time_limited") else ""))
    return "\n".join(lines)
