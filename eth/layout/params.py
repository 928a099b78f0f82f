"""The logical parameters of the runtime's GPT: names, full shapes, tp partitioning.

Pure Python (no torch): the runtime (``megatron.hpp.models.gpt``) builds its modules from
this table, and the gradient layout (``eth.layout.blocks``) and the cost model's gradient and
model-state counts (``eth.cost.sync``) read it, so all three agree on what a
parameter is.

Every parameter has a plan-independent logical name ("layer 3.qkv.weight",
"embedding.word") and belongs to one *block* of the model: ``embedding`` (held by
every pipeline's first stage), ``layer l``, or ``head`` (final layernorm + untied
output layer, held by every last stage).  A layer that some stage of the plan starts or
ends inside (``StagePlan.ops``) is cut at every such boundary of every pipeline into
parts ``layer l:a-b`` (its ops [a, b) in layer order; parts without parameters have no
block), so that each part lies whole in one stage of each pipeline (:func:`stage_blocks`).  A tp-partitioned parameter (``dim`` is not
None) is cut into ``tp`` equal chunks along ``dim`` and tp rank t keeps chunk t
(megatron-core's column-parallel layers cut dim 0, row-parallel ones dim 1, the
vocab-parallel embedding and head dim 0); a replicated one (``dim`` None: layernorms,
row-parallel biases, position embedding) is held whole by every tp rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from eth.spec.model import ModelSpec, layer_ops


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter relates to the plan-independent full parameter."""

    name: str
    """Logical name, the same in every plan ("layer 3.qkv.weight", "embedding.word")."""
    block: str
    """Block key of the topology ("embedding", "layer 3", "head")."""
    full_shape: tuple
    dim: int | None
    """tp partition dimension; None = replicated on the tp ranks."""
    init: str
    """"normal", "scaled" (std / sqrt(2 L)), "zeros" or "ones"."""

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def decay(self) -> bool:
        """AdamW weight decay applies (matrices; not biases and norms)."""
        return len(self.full_shape) > 1

    def local(self, full, tp_rank: int, tp: int):
        """tp rank ``tp_rank``'s part of ``full`` (a tensor of ``full_shape``)."""
        return full if self.dim is None else full.chunk(tp, self.dim)[tp_rank]


def param_ops(spec: ModelSpec) -> dict[str, str]:
    """The layer op each module of a layer's parameters belongs to (``layer_specs`` keys
    are "<module>.<weight|bias>")."""
    norm = "rmsnorm" if spec.norm == "rmsnorm" else "layernorm"
    return {"ln1": f"1st-{norm}", "qkv": "qkv", "dense": "attn-dense", "ln2": f"2nd-{norm}",
            "fc1": "mlp-gemm-1", "fc1_up": "mlp-gemm-1", "fc2": "mlp-gemm-2"}


def layer_specs(spec: ModelSpec, layer: int, ops=None, block: str | None = None) -> dict[str, ShardSpec]:
    """Parameters of transformer layer ``layer``, keyed by their module path in a layer.

    The qkv rows are ordered by key/value group: for each group its query heads, then
    its key head, then its value head (megatron-core's layout; for multi-head attention
    (head, q/k/v, head_dim)), so a contiguous tp slice holds whole groups.  A SwiGLU MLP
    has two column-parallel GEMMs, ``fc1`` (gate) and ``fc1_up`` (up); RMSNorm has no
    bias and ``spec.bias`` false drops the linear layers' biases.  ``ops``: only the
    parameters of those layer ops (a stage holding part of the layer); ``block``: their
    block key (default ``layer l``)."""
    h, f, b = spec.hidden, spec.ffn, f"layer {layer}"
    qkv = h + 2 * spec.kv_heads * spec.head_dim
    table = {"ln1.weight": ((h,), None, "ones"), "ln1.bias": ((h,), None, "zeros"),
             "qkv.weight": ((qkv, h), 0, "normal"), "qkv.bias": ((qkv,), 0, "zeros"),
             "dense.weight": ((h, h), 1, "scaled"), "dense.bias": ((h,), None, "zeros"),
             "ln2.weight": ((h,), None, "ones"), "ln2.bias": ((h,), None, "zeros"),
             "fc1.weight": ((f, h), 0, "normal"), "fc1.bias": ((f,), 0, "zeros"),
             "fc1_up.weight": ((f, h), 0, "normal"), "fc1_up.bias": ((f,), 0, "zeros"),
             "fc2.weight": ((h, f), 1, "scaled"), "fc2.bias": ((h,), None, "zeros")}
    if not spec.swiglu:
        table = {k: v for k, v in table.items() if not k.startswith("fc1_up.")}
    if not spec.bias:
        table = {k: v for k, v in table.items() if k.startswith("ln") or not k.endswith(".bias")}
    if spec.norm == "rmsnorm":
        table = {k: v for k, v in table.items() if k not in ("ln1.bias", "ln2.bias")}
    if ops is not None:
        owner = param_ops(spec)
        table = {k: v for k, v in table.items() if owner[k.split(".")[0]] in ops}
    return {k: ShardSpec(f"{b}.{k}", block or b, *v) for k, v in table.items()}


def embedding_specs(spec: ModelSpec) -> dict[str, ShardSpec]:
    out = {"word.weight": ShardSpec("embedding.word", "embedding", (spec.vocab, spec.hidden), 0, "normal")}
    if spec.position == "learned":
        out["pos"] = ShardSpec("embedding.pos", "embedding", (spec.seq_len, spec.hidden), None, "normal")
    return out


def head_specs(spec: ModelSpec) -> dict[str, ShardSpec]:
    h = spec.hidden
    out = {"ln.weight": ShardSpec("head.ln.weight", "head", (h,), None, "ones"),
           "ln.bias": ShardSpec("head.ln.bias", "head", (h,), None, "zeros"),
           "out.weight": ShardSpec("head.out.weight", "head", (spec.vocab, h), 0, "normal")}
    if spec.norm == "rmsnorm":
        del out["ln.bias"]
    return out


def block_specs(spec: ModelSpec, block: str) -> list[ShardSpec]:
    """The parameters of one block, in model order."""
    if block == "embedding":
        return list(embedding_specs(spec).values())
    if block == "head":
        return list(head_specs(spec).values())
    layer, part = _parse_layer(block)
    if part is None:
        return list(layer_specs(spec, layer).values())
    return list(layer_specs(spec, layer, layer_ops(spec)[part[0]:part[1]], block).values())


def _parse_layer(block: str) -> tuple[int, tuple[int, int] | None]:
    """"layer l" -> (l, None); "layer l:a-b" -> (l, (a, b))."""
    name = block.split()[1]
    if ":" not in name:
        return int(name), None
    layer, part = name.split(":")
    a, b = part.split("-")
    return int(layer), (int(a), int(b))


def all_specs(spec: ModelSpec) -> list[ShardSpec]:
    """Every logical parameter of the model, in model order."""
    out = list(embedding_specs(spec).values())
    for layer in range(spec.num_layers):
        out += layer_specs(spec, layer).values()
    return out + list(head_specs(spec).values())


def stage_blocks(plan) -> dict[tuple[int, int], tuple[str, ...]]:
    """(pipeline, stage) -> the blocks the stage holds, in model order (module docstring):
    whole layers are ``layer l`` unless some stage of the plan starts or ends inside them."""
    spec = plan.model
    k = len(layer_ops(spec))
    cuts: dict[int, set[int]] = {}
    for pipe in plan.pipelines:
        for st in pipe.stages:
            for pos in st.span(spec):
                if pos % k:
                    cuts.setdefault(pos // k, set()).add(pos % k)
    out = {}
    for i, pipe in enumerate(plan.pipelines):
        for j, st in enumerate(pipe.stages):
            a, b = st.span(spec)
            keys = ["embedding"] if j == 0 else []
            for layer in range(*st.layers):
                if layer not in cuts:
                    keys.append(f"layer {layer}")
                    continue
                edges = sorted(cuts[layer] | {0, k})
                for lo, hi in zip(edges, edges[1:]):
                    key = f"layer {layer}:{lo}-{hi}"
                    if a <= layer * k + lo and layer * k + hi <= b and block_specs(spec, key):
                        keys.append(key)
            out[i, j] = tuple(keys + (["head"] if j == len(pipe.stages) - 1 else []))
    return out


def block_position(block: str) -> float:
    """Model order of a block: embedding 0, layer l at l + 1 (its part from op a at
    l + 1 + a / 64), head last."""
    if block == "embedding":
        return 0
    if block == "head":
        return 1 << 30
    layer, part = _parse_layer(block)
    return layer + 1 + (part[0] / 64 if part else 0)
