"""The logical parameters of the runtime's GPT: names, full shapes, tp partitioning.

Pure Python (no torch): the runtime (``megatron.hpp.models.gpt``) builds its modules from
this table, and the gradient layout (``eth.layout.blocks``) and the cost model's gradient and
model-state counts (``eth.cost.sync``) read it, so all three agree on what a
parameter is.

Every parameter has a plan-independent logical name ("layer 3.qkv.weight",
"embedding.word") and belongs to one *block* of the model: ``embedding`` (held by
every pipeline's first stage), ``layer l``, or ``head`` (final layernorm + untied
output layer, held by every last stage).  A tp-partitioned parameter (``dim`` is not
None) is cut into ``tp`` equal chunks along ``dim`` and tp rank t keeps chunk t
(megatron-core's column-parallel layers cut dim 0, row-parallel ones dim 1, the
vocab-parallel embedding and head dim 0); a replicated one (``dim`` None: layernorms,
row-parallel biases, position embedding) is held whole by every tp rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from eth.spec.model import ModelSpec


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


def layer_specs(spec: ModelSpec, layer: int) -> dict[str, ShardSpec]:
    """Parameters of transformer layer ``layer``, keyed by their module path in a layer.

    The qkv rows are ordered by key/value group: for each group its query heads, then
    its key head, then its value head (megatron-core's layout; for multi-head attention
    (head, q/k/v, head_dim)), so a contiguous tp slice holds whole groups.  A SwiGLU MLP
    has two column-parallel GEMMs, ``fc1`` (gate) and ``fc1_up`` (up); RMSNorm has no
    bias and ``spec.bias`` false drops the linear layers' biases."""
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
    return {k: ShardSpec(f"{b}.{k}", b, *v) for k, v in table.items()}


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
    return list(layer_specs(spec, int(block.split()[1])).values())


def all_specs(spec: ModelSpec) -> list[ShardSpec]:
    """Every logical parameter of the model, in model order."""
    out = list(embedding_specs(spec).values())
    for layer in range(spec.num_layers):
        out += layer_specs(spec, layer).values()
    return out + list(head_specs(spec).values())


def block_keys(start: int, end: int, first: bool, last: bool) -> list[str]:
    """Blocks held by a stage of layers [start, end) (first/last stage of its pipeline)."""
    keys = ["embedding"] if first else []
    keys += [f"layer {layer}" for layer in range(start, end)]
    return keys + (["head"] if last else [])


def block_position(block: str) -> int:
    """Model order of a block: embedding 0, layer l at l + 1, head last."""
    if block == "embedding":
        return 0
    if block == "head":
        return 1 << 30
    return int(block.split()[1]) + 1
