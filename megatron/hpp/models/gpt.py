"""A GPT / LLaMA pipeline stage built from megatron.core.tensor_parallel layers, op by op.

A stage holds transformer layers [start, end) of the model, plus the embedding (word
+ learned position, vocab-parallel word table) on a pipeline's first stage and the
final norm, untied vocab-parallel output layer and vocab-parallel cross entropy
on its last stage.  Activations are [seq, batch, hidden] (Megatron's layout).  The
spec's options (``eth.spec.model.ModelSpec``: norm, position, bias, attention, swiglu,
kv_heads) pick the layer's pieces; the LLaMA ones (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU) and fused attention live in :mod:`megatron.hpp.models.llama`.

Each transformer layer runs the ops of ``eth.spec.model.layer_ops(spec)`` (the 13 of
``eth.spec.model.LAYER_OPS`` for a GPT) as separate callables (:func:`op_table`,
``Layer.OPS``), so that single ops can be recomputed:
``stage.recompute[op] = n`` recomputes ``op`` in the stage's first n layers.  In a
layer, each maximal run of consecutive recomputed ops (``eth.spec.model.recompute_runs``)
is ONE non-reentrant ``torch.utils.checkpoint`` (RNG states, including megatron's
tracker, are replayed), so the layer keeps only the run's inputs -- the cost model's
assumption (``eth.cost.model.CostModel.recompute_savings``).

Weights do not depend on the plan: every full parameter is drawn from a generator
seeded by (seed, logical name) and each tp rank keeps its slice
(:func:`full_parameter`, :class:`ShardSpec`).  The fused qkv output is ordered by
key/value group (its query heads, key, value; (head, q/k/v, head_dim) for multi-head
attention) so that a contiguous tp slice holds whole groups.
"""
from __future__ import annotations

import contextlib
import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eth.spec.model import ModelSpec, get_model, layer_dataflow, layer_ops
from eth.spec.plan import StagePlan
from eth.layout.params import ShardSpec, embedding_specs, head_specs, layer_specs, param_ops
from megatron.hpp.models import boundary, llama
from megatron.hpp.compat import MODEL_PARALLEL_RNG, tp_group_globals

INIT_STD = 0.02
LN_EPS = 1e-5   # the default ModelSpec.norm_eps; the layers read the spec's


def full_parameter(spec: ModelSpec, shard: ShardSpec, seed: int) -> torch.Tensor:
    """The full fp32 tensor of a logical parameter; depends only on (seed, name)."""
    if shard.init == "ones":
        return torch.ones(shard.full_shape)
    if shard.init == "zeros":
        return torch.zeros(shard.full_shape)
    std = INIT_STD if shard.init == "normal" else INIT_STD / math.sqrt(2 * spec.num_layers)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(shard.name.encode())) % 2**63)
    return torch.randn(shard.full_shape, generator=gen) * std


def _config():
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False,
                               params_dtype=torch.float32)


def _no_init(_weight):
    """Weights are copied in from :func:`full_parameter` after construction."""


@contextlib.contextmanager
def _rng_replay(tracker, saved: dict, replay: bool):
    """Forward: remember the tracker states; recompute: run with those states."""
    if not replay:
        saved.update(tracker.get_states())
        yield
        return
    current = tracker.get_states()
    tracker.set_states(saved)
    try:
        yield
    finally:
        tracker.set_states(current)


_METHODS = {"1st-layernorm": "op_ln1", "1st-rmsnorm": "op_ln1", "qkv": "op_qkv", "rotary": "op_rotary",
            "score": "op_score", "softmax": "op_softmax", "attn-dropout": "op_attn_dropout",
            "context": "op_context", "fused-attention": "op_fused_attention", "attn-dense": "op_attn_dense",
            "post-attn-dropout": "op_post_attn_dropout", "2nd-layernorm": "op_ln2", "2nd-rmsnorm": "op_ln2",
            "mlp-gemm-1": "op_fc1", "gelu": "op_gelu", "relu": "op_relu", "swiglu": "op_swiglu", "mlp-gemm-2": "op_fc2",
            "post-mlp-dropout": "op_post_mlp_dropout"}


def op_table(spec: ModelSpec) -> tuple:
    """(op name, method, input names, output name) of every layer op of ``spec``, in
    ``eth.spec.model.layer_ops`` order, with the tensors of ``eth.spec.model.layer_dataflow``
    (the cost model's): "x" is the layer input, "out" its output."""
    return tuple((f.name, _METHODS[f.name], f.inputs, f.output) for f in layer_dataflow(spec))


class Layer(torch.nn.Module):
    """One transformer layer as op callables over named tensors (:func:`op_table`); with
    ``ops``, only those of its ops (a stage that starts or ends inside the layer): it
    then builds only their parameters, reads what its first op needs from the tensors
    handed in and hands on ``keep`` (the tensors crossing the boundary after it)."""

    OPS = op_table(get_model("tiny"))
    """The GPT op table (the instance's ``OPS`` is its spec's)."""

    def __init__(self, spec: ModelSpec, index: int, tp_group, tracker, recompute: frozenset,
                 ops: tuple[str, ...] | None = None, keep: tuple[str, ...] = ("out",)):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        h, f, cfg, tp = spec.hidden, spec.ffn, _config(), tp_group.size()
        spec.check_tp(tp)
        self.index, self.tracker, self.recompute, self.dropout = index, tracker, recompute, spec.dropout
        self.attn_dropout = spec.attn_dropout
        self.OPS = tuple(op for op in op_table(spec) if ops is None or op[0] in ops)
        self.keep = keep
        self.segments = self.plan_segments(recompute, self.OPS, keep)
        self._op_by_name = {op[0]: op for op in self.OPS}
        self.local_heads, self.head_dim = spec.heads // tp, spec.head_dim
        self.rope_theta = spec.rope_theta
        self.tp_group, self.kv_heads, self.full_group = tp_group, spec.kv_heads, spec.heads // spec.kv_heads
        if tp > spec.kv_heads:   # one (replicated) kv head per rank, from the gathered qkv output
            self.local_groups, self.group = 1, spec.heads // tp
        else:
            self.local_groups, self.group = spec.kv_heads // tp, spec.heads // spec.kv_heads
        qkv_width = h + 2 * spec.kv_heads * spec.head_dim
        bias, held = spec.bias, {op[0] for op in self.OPS}
        owner = param_ops(spec)
        if owner["ln1"] in held:
            self.ln1 = llama.norm(spec, spec.norm_eps)
        if "qkv" in held:
            self.qkv = ColumnParallelLinear(h, qkv_width, config=cfg, init_method=_no_init, bias=bias,
                                            gather_output=False, tp_group=tp_group)
        if "attn-dense" in held:
            self.dense = RowParallelLinear(h, h, config=cfg, init_method=_no_init, bias=bias,
                                           input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)
        if owner["ln2"] in held:
            self.ln2 = llama.norm(spec, spec.norm_eps)
        if "mlp-gemm-1" in held:
            self.fc1 = ColumnParallelLinear(h, f, config=cfg, init_method=_no_init, bias=bias,
                                            gather_output=False, tp_group=tp_group)
            if spec.swiglu:   # the up projection: mlp-gemm-1 outputs [gate, up]
                self.fc1_up = ColumnParallelLinear(h, f, config=cfg, init_method=_no_init, bias=bias,
                                                   gather_output=False, tp_group=tp_group)
        if "mlp-gemm-2" in held:
            self.fc2 = RowParallelLinear(f, h, config=cfg, init_method=_no_init, bias=bias,
                                         input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)

    def op_ln1(self, x):
        return self.ln1(x)

    def op_qkv(self, a):
        out = self.qkv(a)[0]
        if self.tp_group.size() > self.kv_heads:
            out = llama.gather_group(out, self.tp_group, self.kv_heads, self.full_group, self.head_dim)
        return out

    def op_rotary(self, qkv):
        return llama.rotate_qk(qkv, self.local_groups, self.group, self.head_dim, self.rope_theta)

    def op_score(self, qkv):
        return llama.scores(qkv, self.local_groups, self.group, self.head_dim)

    def op_softmax(self, scores):
        return llama.causal_softmax(scores)

    def op_attn_dropout(self, probs):
        if not (self.training and self.attn_dropout > 0):
            return probs
        with self.tracker.fork(MODEL_PARALLEL_RNG):  # different mask per tp rank (own heads)
            return F.dropout(probs, self.attn_dropout, training=True)

    def op_context(self, probs, qkv):
        return llama.context(probs, qkv, self.local_groups, self.group, self.head_dim)

    def op_fused_attention(self, qkv):
        args = (qkv, self.local_groups, self.group, self.head_dim, self.attn_dropout, self.training)
        if not (self.training and self.attn_dropout > 0):
            return llama.fused_attention(*args)
        with self.tracker.fork(MODEL_PARALLEL_RNG):  # as attn-dropout: own heads, own mask
            return llama.fused_attention(*args)

    def op_attn_dense(self, ctx):
        return self.dense(ctx)[0]

    def op_post_attn_dropout(self, x, attn):
        return x + F.dropout(attn, self.dropout, training=self.training)

    def op_ln2(self, x2):
        return self.ln2(x2)

    def op_fc1(self, m):
        if hasattr(self, "fc1_up"):
            return torch.cat([self.fc1(m)[0], self.fc1_up(m)[0]], dim=-1)
        return self.fc1(m)[0]

    def op_gelu(self, f1):
        return F.gelu(f1)

    def op_relu(self, f1):
        return F.relu(f1)

    def op_swiglu(self, f1):
        return llama.swiglu(f1)

    def op_fc2(self, g):
        return self.fc2(g)[0]

    def op_post_mlp_dropout(self, x2, f2):
        return x2 + F.dropout(f2, self.dropout, training=self.training)

    def _rng_contexts(self):
        """checkpoint's context_fn: (forward, recompute) contexts sharing tracker states."""
        saved = {}
        return lambda: (_rng_replay(self.tracker, saved, False), _rng_replay(self.tracker, saved, True))

    @classmethod
    def plan_segments(cls, recompute, table=None, keep=("out",)) -> list[tuple[tuple, tuple, tuple]]:
        """The layer's forward as segments (ops, input names, output names).

        A maximal run of consecutive recomputed ops (``eth.spec.model.recompute_runs``, the
        cost model's unit) is one segment, run under ONE checkpoint: it keeps only the
        run's inputs (tensors produced before it) and frees everything its ops save.
        Every other op is a segment of its own, run plainly.  Outputs are the names the
        segment produces that a later op reads or that the layer hands on (``keep``: the
        layer output "out", or what crosses the boundary after a part of the layer).
        ``table``: the layer's :func:`op_table` (the GPT one by default; a part of it for
        a part of the layer)."""
        from eth.spec.model import recompute_runs

        table = cls.OPS if table is None else table
        runs = {run[0]: tuple(run) for run in recompute_runs(set(recompute), [op[0] for op in table])}
        by_name = {op[0]: op for op in table}
        segments, i = [], 0
        while i < len(table):
            name = table[i][0]
            ops = runs.get(name, (name,))
            produced, inputs = [], []
            for op in ops:
                for n in by_name[op][2]:
                    if n not in produced and n not in inputs:
                        inputs.append(n)
                if by_name[op][3] not in produced:   # attn-dropout as the identity: "probs" again
                    produced.append(by_name[op][3])
            later = {n for op in table[i + len(ops):] for n in op[2]} | set(keep)
            outputs = tuple(n for n in produced if n in later)
            segments.append((ops, tuple(inputs), outputs))
            i += len(ops)
        return segments

    def _run_ops(self, ops, inputs, outputs, *args):
        env = dict(zip(inputs, args))
        for op in ops:
            _, method, names, output = self._op_by_name[op]
            env[output] = getattr(self, method)(*[env[n] for n in names])
        return tuple(env[n] for n in outputs)

    def forward(self, x):
        return self.run({"x": x})["out"]

    def run(self, env: dict) -> dict:
        """The layer's ops on the named tensors ``env`` (the layer input "x", or what the
        boundary before a part of the layer carried) -> {name: tensor} of ``keep``."""
        env = dict(env)
        for ops, inputs, outputs in self.segments:
            args = [env[n] for n in inputs]
            if len(ops) == 1 and ops[0] not in self.recompute:
                _, method, _, output = self._op_by_name[ops[0]]
                env[output] = getattr(self, method)(*args)
                continue
            fn = functools.partial(self._run_ops, ops, inputs, outputs)
            if torch.is_grad_enabled():
                results = checkpoint(fn, *args, use_reentrant=False, context_fn=self._rng_contexts())
            else:
                results = fn(*args)
            env.update(zip(outputs, results))
        return {n: env[n] for n in self.keep}


class GPTStage(torch.nn.Module):
    """Layers [start, end) of a GPT, with embedding (first) / head + loss (last); with
    ``ops`` (``eth.spec.plan.StagePlan.ops``) from op ``ops[0]`` of the first layer through
    op ``ops[1]`` of the last.  A stage that starts inside a layer takes, and one that
    ends inside a layer returns, the [1, b, total] buffer of :mod:`megatron.hpp.models.boundary`
    instead of the hidden state."""

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool,
                 tp_group, tracker, recompute: dict | None = None, seed: int = 1234,
                 ops: tuple[str, str] | None = None):
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

        super().__init__()
        self.spec, self.first, self.last, self.tp_group = spec, first, last, tp_group
        self.tp, self.tp_rank = tp_group.size(), tp_group.rank()
        recompute = recompute or {}
        cfg, start, end = _config(), layers[0], layers[1]
        self.shard_specs: dict[str, ShardSpec] = {}
        if first:
            self.word = VocabParallelEmbedding(spec.vocab, spec.hidden, config=cfg,
                                               init_method=_no_init, tp_group=tp_group)
            if spec.position == "learned":
                self.pos = torch.nn.Parameter(torch.empty(spec.seq_len, spec.hidden))
            self.shard_specs.update(embedding_specs(spec))
        plan = StagePlan([], "", 1, 1, (start, end), recompute, ops=ops)
        a, b = plan.span(spec)
        self.cut_in, self.cut_out = boundary.cut_after(spec, a), boundary.cut_after(spec, b)
        recomputed = {layer: frozenset(op for op in recompute if layer in plan.recompute_layers(spec, op))
                      for layer in range(start, end)}
        whole = layer_ops(spec)
        self.layers = torch.nn.ModuleList()
        for i, layer in enumerate(range(start, end)):
            held = plan.held_ops(spec, layer)
            keep = tuple(t.name for t in self.cut_out) if held[-1] != whole[-1] else ("out",)
            self.layers.append(Layer(spec, layer, tp_group, tracker, recomputed[layer],
                                     None if held == whole else held, keep))
            self.shard_specs.update({f"layers.{i}.{k}": v for k, v in layer_specs(spec, layer, held).items()})
        if last:
            self.ln = llama.norm(spec, spec.norm_eps)
            self.out = ColumnParallelLinear(spec.hidden, spec.vocab, config=cfg, init_method=_no_init,
                                            bias=False, gather_output=False, tp_group=tp_group)
            self.shard_specs.update(head_specs(spec))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        params = dict(self.named_parameters())
        if set(params) != set(self.shard_specs):
            raise RuntimeError(f"parameters {sorted(set(params) ^ set(self.shard_specs))} lack a "
                               f"shard spec or a module")
        for name, shard in self.shard_specs.items():
            params[name].copy_(shard.local(full_parameter(self.spec, shard, seed), self.tp_rank, self.tp))

    def embed(self, tokens):
        """tokens [b, s] -> hidden [s, b, h]."""
        x = self.word(tokens)
        if self.spec.position == "learned":
            x = x + self.pos[: tokens.shape[1]].unsqueeze(0)
        return F.dropout(x.transpose(0, 1).contiguous(), self.spec.dropout, training=self.training)

    def head_loss(self, x, labels, loss_scale: float):
        """Sum over samples of the per-sample mean token loss, times ``loss_scale``."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = self.out(self.ln(x))[0].float()  # [s, b, vocab / tp]; the loss in fp32
        with tp_group_globals(self.tp_group):
            losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        return losses.mean(dim=0).sum() * loss_scale

    def forward(self, inputs, labels=None, loss_scale: float = 1.0):
        """First stage: tokens [b, s]; other stages: hidden [s, b, h] (the boundary buffer
        when the stage starts inside a layer).  Returns hidden [s, b, h] (the boundary
        buffer when it ends inside a layer), or on the last stage the scaled loss (needs
        ``labels`` [b, s])."""
        if self.first:
            env = {"x": self.embed(inputs)}
        elif self.cut_in is None:
            env = {"x": inputs}
        else:
            env = boundary.unpack(inputs, self.cut_in, self.spec, self.tp_group)
        for layer in self.layers:
            env = layer.run(env)
            if "out" in env:
                env = {"x": env["out"]}
        if self.last:
            return self.head_loss(env["x"], labels, loss_scale)
        return env["x"] if self.cut_out is None else boundary.pack(env, self.cut_out, self.tp_group)
