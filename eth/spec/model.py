"""Model specification: presets and the per-op shape formulas of one transformer layer.

A GPT layer is decomposed into the 13 operators of the design (the granularity at
which the planner places layers and chooses recomputation):

    1st-layernorm, qkv, score, softmax, attn-dropout, context, attn-dense,
    post-attn-dropout, 2nd-layernorm, mlp-gemm-1, gelu, mlp-gemm-2, post-mlp-dropout

plus three non-layer ops: ``embedding`` (before layer 0), ``final-layernorm`` and
``head+loss`` (after the last layer).  That is the op set of the default spec
(:data:`LAYER_OPS`, :data:`ALL_OPS`); the spec's options change it
(:func:`layer_ops`, :func:`all_ops`):

    norm "rmsnorm"       1st-rmsnorm, 2nd-rmsnorm, final-rmsnorm instead of *-layernorm
    position "rope"      rotary (q and k rotated) right after qkv; no position table
    attention "fused"    fused-attention instead of score, softmax, attn-dropout, context:
                         softmax(Q K^T / sqrt(d)) V in one kernel that keeps no s x s tensor
    swiglu               swiglu (silu(gate) * up) instead of gelu; mlp-gemm-1 makes 2 ffn
    activation "relu"    relu instead of gelu (OPT): it keeps its output, which mlp-gemm-2
                         keeps anyway, so the layer keeps one ffn-wide tensor less
    bias false           no biases in qkv, attn-dense, mlp-gemm-1/2 (norm weights only
                         for rmsnorm)

so LLaMA (rmsnorm, rope, swiglu, no bias) with unfused attention has 14 layer ops and
with fused attention 11.  :func:`op_shapes` gives, for a micro-batch of
``mbs`` samples on one tensor-parallel rank of degree ``tp``:

    flops_fwd / flops_bwd   floating point operations (backward = 2x forward; fused-attention 2.5x)
    weight_bytes            parameter bytes held by one tp rank (half precision)
    act_bytes               activation bytes saved for backward
    input_bytes/output_bytes  size of the op's input and output
    traffic_bytes           bytes read+written in forward (for memory-bound ops)
    is_gemm                 True for matrix multiplies (compute bound)

Notation: b = mbs, s = seq_len, h = hidden, a = heads, t = tp, f = ffn,
E = bytes per activation element (2: fp16/bf16).  Tensor parallelism follows
Megatron-LM: qkv and mlp-gemm-1 are column-parallel, attn-dense and mlp-gemm-2
row-parallel, the embedding and the output head are vocab-parallel.  With tp > 1 the
forward pass all-reduces the outputs of attn-dense, mlp-gemm-2 and the embedding, and
the backward pass all-reduces the input gradients of qkv, mlp-gemm-1 and the head:
see :func:`tp_allreduces`.  This module is pure arithmetic (no torch).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType

from eth.errors import SpecError, is_count, is_number

LAYER_OPS = (
    "1st-layernorm", "qkv", "score", "softmax", "attn-dropout", "context", "attn-dense",
    "post-attn-dropout", "2nd-layernorm", "mlp-gemm-1", "gelu", "mlp-gemm-2",
    "post-mlp-dropout",
)
PRE_OPS = ("embedding",)
POST_OPS = ("final-layernorm", "head+loss")
ALL_OPS = PRE_OPS + LAYER_OPS + POST_OPS
"""The default (GPT, unfused attention) op set; a spec's own: :func:`all_ops`."""

UNFUSED_ATTENTION_OPS = ("score", "softmax", "attn-dropout", "context")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("unfused", "fused")
ACTIVATIONS = ("gelu", "relu")
KNOWN_LAYER_OPS = ("1st-layernorm", "1st-rmsnorm", "qkv", "rotary", "score", "softmax",
                   "attn-dropout", "context", "fused-attention", "attn-dense",
                   "post-attn-dropout", "2nd-layernorm", "2nd-rmsnorm", "mlp-gemm-1", "gelu", "relu",
                   "swiglu", "mlp-gemm-2", "post-mlp-dropout")
"""Every layer op of any spec, in layer order (display and validation)."""

ACT_BYTES = 2  # fp16/bf16 activations in the cost model
MASK_BYTES = 1  # dropout masks are stored as bytes


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (GPT-3 style, optionally LLaMA-style GQA + SwiGLU)."""

    name: str
    """Preset or user name; only used for display and profile look-up messages."""
    num_layers: int
    """Number of transformer layers L."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a (h must divide by a)."""
    ffn: int = 0
    """MLP inner size f; 0 means 4 * hidden."""
    seq_len: int = 2048
    """Sequence length s."""
    vocab: int = 50304
    """Vocabulary size (already padded; 50304 = GPT-2 BPE padded to a multiple of 128)."""
    kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means equal to heads."""
    swiglu: bool = False
    """Gated MLP (SwiGLU): mlp-gemm-1 produces 2 * ffn outputs."""
    dropout: float = 0.1
    """Hidden and attention dropout probability (0 disables the dropout ops' masks)."""
    attention_dropout: float | None = None
    """Dropout on the attention probabilities where it differs from ``dropout`` (GPT-Neo
    as Megatron-DeepSpeed runs it: 0, with hidden dropout 0.1); None: ``dropout``
    (:attr:`attn_dropout`)."""
    norm: str = "layernorm"
    """"layernorm" (weight + bias) or "rmsnorm" (weight only), before attention, before
    the MLP and after the last layer."""
    position: str = "learned"
    """"learned" (a position table added to the word embedding) or "rope" (rotary
    embeddings applied to q and k in every layer)."""
    bias: bool = True
    """Biases in the qkv, attention output and MLP linear layers."""
    attention: str = "unfused"
    """"unfused" (score, softmax, attn-dropout, context ops) or "fused" (one
    fused-attention op: torch scaled_dot_product_attention)."""
    activation: str = "gelu"
    """The MLP's activation without SwiGLU: "gelu" (exact) or "relu" (OPT)."""
    norm_eps: float = 1e-5
    """Epsilon of every layernorm / rmsnorm (numerics only: no effect on cost)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding's frequencies (position "rope"; numerics only)."""

    def __post_init__(self):
        for name in ("num_layers", "hidden", "heads", "seq_len", "vocab"):
            if not is_count(getattr(self, name)):
                raise SpecError(f"model.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        for name in ("ffn", "kv_heads"):
            value = getattr(self, name)
            if not is_count(value):
                raise SpecError(f"model.{name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise SpecError(f"model.hidden {self.hidden} is not divisible by model.heads {self.heads}")
        if self.heads % self.kv_heads:
            raise SpecError(f"model.heads {self.heads} is not divisible by model.kv_heads {self.kv_heads}")
        if not isinstance(self.swiglu, bool):
            raise SpecError(f"model.swiglu must be true or false, got {self.swiglu!r}")
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise SpecError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.attention_dropout is not None:
            if not is_number(self.attention_dropout) or not 0.0 <= self.attention_dropout < 1.0:
                raise SpecError(f"model.attention_dropout must be in [0, 1) or null, got {self.attention_dropout}")
            if self.attention_dropout == self.dropout:     # one spec, one form
                object.__setattr__(self, "attention_dropout", None)
        for name, allowed in (("norm", NORMS), ("position", POSITIONS), ("attention", ATTENTIONS),
                              ("activation", ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"model.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in ("norm_eps", "rope_theta"):
            if isinstance(getattr(self, name), bool) or not is_number(getattr(self, name)) \
                    or getattr(self, name) <= 0:
                raise SpecError(f"model.{name} must be a positive number, got {getattr(self, name)!r}")
        if not isinstance(self.bias, bool):
            raise SpecError(f"model.bias must be true or false, got {self.bias!r}")
        if self.swiglu and self.activation != "gelu":
            raise SpecError(f"model.activation {self.activation!r} with swiglu true: the gated MLP's "
                            f"activation is silu")
        if self.position == "rope" and self.head_dim % 2:
            raise SpecError(f"model.position rope needs an even head dimension, got "
                            f"hidden {self.hidden} / heads {self.heads} = {self.head_dim}")

    @property
    def attn_dropout(self) -> float:
        """The dropout on the attention probabilities: ``attention_dropout``, else ``dropout``."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_width(self) -> int:
        """Output width of the fused qkv GEMM: hidden + 2 x kv_heads x head_dim."""
        return self.hidden + 2 * self.kv_heads * self.head_dim

    def splits(self, tp: int) -> bool:
        """Whether ``tp`` is a valid tensor-parallel degree (:meth:`check_tp`)."""
        try:
            self.check_tp(tp)
        except SpecError:
            return False
        return True

    def check_tp(self, tp: int) -> None:
        """Raise SpecError unless ``tp`` splits heads, ffn and vocab evenly and, as in
        megatron-core, divides kv_heads or is a multiple of it (then each tp rank keeps one
        key/value head of the all-gathered qkv output, and tp must divide its width)."""
        for name, value in (("heads", self.heads), ("ffn", self.ffn), ("vocab", self.vocab)):
            if value % tp:
                raise SpecError(f"tp {tp} does not divide model.{name} {value}")
        kv = self.kv_heads
        if kv % tp and tp % kv:
            raise SpecError(f"tp {tp} does not divide model.kv_heads {kv} and is not a multiple of it")
        if tp > kv and self.qkv_width % tp:
            raise SpecError(f"tp {tp} (> model.kv_heads {kv}) does not divide the qkv width "
                            f"{self.qkv_width} (hidden + 2 x kv_heads x head_dim)")

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: weight + bias (layernorm) or weight (rmsnorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def params_per_layer(self) -> int:
        """Parameters of one transformer layer (all tp ranks together)."""
        h, f = self.hidden, self.ffn
        qkv = h + 2 * self.kv_heads * self.head_dim
        f1 = 2 * f if self.swiglu else f
        biases = (qkv + h + f1 + h) if self.bias else 0
        return 2 * self.norm_params + h * qkv + h * h + h * f1 + f * h + biases

    def embedding_params(self) -> int:
        """Word (+ learned position) embedding (held by every first stage)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.position == "learned" else 0)

    def head_params(self) -> int:
        """Final norm + untied output layer (held by every last stage)."""
        return self.norm_params + self.vocab * self.hidden

    def num_params(self) -> int:
        """All parameters: layers, embedding, final layernorm and head."""
        return self.num_layers * self.params_per_layer() + self.embedding_params() + self.head_params()

    def to_dict(self, compact: bool = False) -> dict:
        """Every field; ``compact`` leaves out the layer options (norm, position, bias,
        attention, norm_eps, rope_theta) that equal the GPT defaults, so that a plan's hash
        is the one it had before these fields existed."""
        data = asdict(self)
        if self.attention_dropout is None:
            del data["attention_dropout"]
        if compact:
            for f in fields(self):
                if f.name in _OPTION_FIELDS and data[f.name] == f.default:
                    del data[f.name]
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "model") -> "ModelSpec":
        if not isinstance(data, dict):
            raise SpecError(f"{where} must be a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"{where} has unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [n for n in ("name", "num_layers", "hidden", "heads") if n not in data]
        if missing:
            raise SpecError(f"{where} is missing field(s) {missing}")
        return cls(**data)


_OPTION_FIELDS = ("norm", "position", "bias", "attention", "activation", "norm_eps", "rope_theta")
_LLAMA = {"norm": "rmsnorm", "position": "rope", "bias": False, "swiglu": True, "dropout": 0.0}


def layer_ops(spec) -> tuple[str, ...]:
    """The layer ops of ``spec`` in execution order (module docstring); ``spec`` needs
    the attributes norm, position, attention and swiglu."""
    return _layer_ops(spec.norm, spec.position, spec.attention, spec.swiglu, getattr(spec, "activation", "gelu"))


@functools.lru_cache(maxsize=None)
def _layer_ops(norm, position, attention, swiglu, activation="gelu") -> tuple[str, ...]:
    norm = "rmsnorm" if norm == "rmsnorm" else "layernorm"
    ops = [f"1st-{norm}", "qkv"] + (["rotary"] if position == "rope" else [])
    ops += ["fused-attention"] if attention == "fused" else list(UNFUSED_ATTENTION_OPS)
    ops += ["attn-dense", "post-attn-dropout", f"2nd-{norm}", "mlp-gemm-1",
            "swiglu" if swiglu else activation, "mlp-gemm-2", "post-mlp-dropout"]
    return tuple(ops)


@dataclass(frozen=True)
class OpFlow:
    """One layer op's tensors: the named tensors it reads (``inputs``) and makes
    (``output``), and those of them its backward needs, which autograd keeps (``saves``).
    "x" is the layer input, "out" its output.  What an op keeps beyond named tensors
    (dropout masks, norm statistics, a kernel's own copies) is its act_bytes less the
    named tensors first kept by it (:class:`eth.cost.activations.LayerKeep`)."""

    name: str
    inputs: tuple[str, ...]
    output: str
    saves: tuple[str, ...]


def layer_dataflow(spec) -> tuple[OpFlow, ...]:
    """The :class:`OpFlow` of every layer op of ``spec`` (:func:`layer_ops` order), as the
    runtime (``megatron.hpp.models.gpt.Layer``) runs them: a tensor kept by two ops (the
    fused qkv output, read by score and context through views of one storage; the
    attention probabilities, which context reads as they are when attn-dropout is the
    identity) is one tensor, held once.  With ``spec.attn_dropout`` 0 attn-dropout passes
    "probs" on unchanged (its output is "probs"); the residual adds and rotary keep nothing."""
    qkv = "qkv_r" if spec.position == "rope" else "qkv"
    probs_d = "probs_d" if spec.attn_dropout > 0 else "probs"
    norm = "rmsnorm" if spec.norm == "rmsnorm" else "layernorm"
    flows = {f"1st-{norm}": (("x",), "a", ("x",)), "qkv": (("a",), "qkv", ("a",)),
             "rotary": (("qkv",), "qkv_r", ()), "score": ((qkv,), "scores", (qkv,)),
             "softmax": (("scores",), "probs", ("probs",)),
             "attn-dropout": (("probs",), probs_d, ()),
             "context": ((probs_d, qkv), "ctx", (probs_d, qkv)),
             "fused-attention": ((qkv,), "ctx", ()),   # keeps its own contiguous q, k, v copies
             "attn-dense": (("ctx",), "attn", ("ctx",)),
             "post-attn-dropout": (("x", "attn"), "x2", ()), f"2nd-{norm}": (("x2",), "m", ("x2",)),
             "mlp-gemm-1": (("m",), "f1", ("m",)), "gelu": (("f1",), "g", ("f1",)),
             "relu": (("f1",), "g", ("g",)),   # its output: the mask of the backward
             "swiglu": (("f1",), "g", ("f1",)), "mlp-gemm-2": (("g",), "f2", ("g",)),
             "post-mlp-dropout": (("x2", "f2"), "out", ())}
    return tuple(OpFlow(op, *flows[op]) for op in layer_ops(spec))


@dataclass(frozen=True)
class CutTensor:
    """A named tensor that crosses a stage boundary after a layer op: per-sample elements
    and how the runtime lays it out on a tp rank (``shard`` None: replicated; "heads":
    dim 1 of [b, heads, s, s] cut by heads; "last": the last dim of [s, b, w] cut in tp
    contiguous chunks, within each of ``pieces`` equal pieces (SwiGLU's [gate, up]))."""

    name: str
    numel: int
    shard: str | None
    pieces: int = 1


@functools.lru_cache(maxsize=1024)
def cut_tensors(spec, after: str) -> tuple[CutTensor, ...]:
    """The tensors a stage boundary after layer op ``after`` carries: those made at or
    before ``after`` in its layer (or the layer input "x") that an op after it reads, in
    :func:`layer_dataflow` order ("x" first).  After the last op: the layer output alone,
    which is the next layer's "x"."""
    flow = layer_dataflow(spec)
    names = [f.name for f in flow]
    if after not in names:
        raise SpecError(f"{after!r} is not a layer op of model {spec.name}: {', '.join(names)}")
    k = names.index(after)
    if k == len(flow) - 1:
        made = ["x"]
    else:
        made = ["x"] + [f.output for f in flow[:k + 1]]
        read = {t for f in flow[k + 1:] for t in f.inputs}
        made = [t for t in dict.fromkeys(made) if t in read]
    s, h, f = spec.seq_len, spec.hidden, spec.ffn
    qkv = s * (h + 2 * spec.kv_heads * spec.head_dim)
    table = {"x": (s * h, None), "a": (s * h, None), "qkv": (qkv, "last"), "qkv_r": (qkv, "last"),
             "scores": (spec.heads * s * s, "heads"), "probs": (spec.heads * s * s, "heads"),
             "probs_d": (spec.heads * s * s, "heads"), "ctx": (s * h, "last"), "attn": (s * h, None),
             "x2": (s * h, None), "m": (s * h, None), "f1": (s * f * (2 if spec.swiglu else 1), "last"),
             "g": (s * f, "last"), "f2": (s * h, None)}
    return tuple(CutTensor(t, *table[t], 2 if t == "f1" and spec.swiglu else 1) for t in made)


def pre_ops(spec) -> tuple[str, ...]:
    return PRE_OPS


def post_ops(spec) -> tuple[str, ...]:
    return ("final-rmsnorm" if spec.norm == "rmsnorm" else "final-layernorm", "head+loss")


def all_ops(spec) -> tuple[str, ...]:
    """Every op of ``spec``: embedding, the layer ops, final norm, head+loss."""
    return pre_ops(spec) + layer_ops(spec) + post_ops(spec)


# Table 2 of the paper (layers, hidden); heads keep a head dimension of 64-128 as in
# GPT-3 / Megatron-LM.  LLaMA-2 uses its published shapes (Touvron et al. 2023, Table 1
# and the released configs: RMSNorm, rotary embeddings, SwiGLU, no biases, untied head,
# vocabulary 32000; 70B with 8 key/value heads).  Sequence length 2048 as in the paper's
# evaluation (LLaMA-2 itself was trained at 4096: --seq-len 4096).
PRESETS = MappingProxyType({
    "gpt3-350m": ModelSpec("gpt3-350m", 24, 1024, 16),
    "gpt3-1.3b": ModelSpec("gpt3-1.3b", 24, 2048, 16),
    "gpt3-2.6b": ModelSpec("gpt3-2.6b", 32, 2560, 32),
    "gpt3-6.7b": ModelSpec("gpt3-6.7b", 32, 4096, 32),
    "gpt3-13b": ModelSpec("gpt3-13b", 40, 5120, 40),
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 32, ffn=11008, vocab=32000, **_LLAMA),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 40, ffn=13824, vocab=32000, **_LLAMA),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, ffn=28672, vocab=32000, kv_heads=8,
                            **_LLAMA),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96),
    # Small shapes for CPU training runs and tests.
    "tiny": ModelSpec("tiny", 4, 64, 4, seq_len=32, vocab=256, dropout=0.0),
    "small": ModelSpec("small", 8, 128, 8, seq_len=64, vocab=512, dropout=0.0),
    "tiny-llama": ModelSpec("tiny-llama", 4, 64, 4, ffn=96, seq_len=32, vocab=256, kv_heads=2,
                            attention="fused", **_LLAMA),
})


def get_model(name: str, **overrides) -> ModelSpec:
    """Preset by name, with optional field overrides (e.g. ``seq_len=4096``)."""
    if name not in PRESETS:
        raise SpecError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class OpShape:
    """Size facts of one op for one micro-batch on one tp rank (see module docstring)."""

    name: str
    flops_fwd: float
    flops_bwd: float
    weight_bytes: int
    act_bytes: int
    input_bytes: int
    output_bytes: int
    traffic_bytes: int
    is_gemm: bool


def _op(name, flops, weights, act, inp, out, traffic=None, gemm=False, bwd_factor=2.0):
    traffic = inp + out if traffic is None else traffic
    return OpShape(name, float(flops), bwd_factor * flops, int(weights), int(act), int(inp), int(out),
                   int(traffic), gemm)


def op_shapes(spec: ModelSpec, mbs: int, tp: int, elem_bytes: int = ACT_BYTES,
              mask_bytes: int = MASK_BYTES) -> dict[str, OpShape]:
    """Shapes of every op in :func:`all_ops` (``spec``'s op set, in that order) for ``mbs``
    samples on one rank of ``tp``, activations of ``elem_bytes`` per element (E; norm
    statistics and the loss's logits stay fp32) and dropout masks of ``mask_bytes`` per
    element (CUDA's fused dropout keeps a byte mask; torch's CPU dropout keeps its scaled
    mask in the activation dtype)."""
    if mbs <= 0:
        raise SpecError(f"mbs must be positive, got {mbs}")
    spec.check_tp(tp)
    b, s, h, a, t, f, E = mbs, spec.seq_len, spec.hidden, spec.heads, tp, spec.ffn, elem_bytes
    v = spec.vocab
    kvd = spec.kv_heads * spec.head_dim          # width of k (and of v)
    qkv = h + 2 * kvd                            # width of the fused qkv output
    # k (and v) width on one tp rank: its kv heads, or with tp > kv_heads the one head of
    # its group, taken from the all-gathered qkv output (megatron-core's layout)
    kv_l = max(spec.kv_heads // t, 1) * spec.head_dim
    f1 = 2 * f if spec.swiglu else f             # width of mlp-gemm-1's output
    tok = b * s * h * E                          # one full hidden activation
    att = b * (a // t) * s * s                   # elements of one tp rank's attention matrix
    drop, drop_a = spec.dropout > 0, spec.attn_dropout > 0
    mask_h = b * s * h * mask_bytes if drop else 0
    mask_a = att * mask_bytes if drop_a else 0
    bias = 1 if spec.bias else 0
    rms = spec.norm == "rmsnorm"
    norm_name = "rmsnorm" if rms else "layernorm"
    # layernorm saves its input and fp32 mean + rstd per token, rmsnorm its input and rstd
    norm_w, norm_act, norm_flops = (h * E, tok + b * s * 4, 4 * b * s * h) if rms else \
        (2 * h * E, tok + b * s * 8, 8 * b * s * h)
    pos_table = s * h if spec.position == "learned" else 0
    qkv_out = b * s * (h // t + 2 * kv_l) * E    # one tp rank's q, k, v (qkv op output)

    def norm(name):
        return _op(name, norm_flops, norm_w, norm_act, tok, tok)

    ops = [
        _op("embedding", b * s * h, (v // t * h + pos_table) * E, b * s * 8 + mask_h, b * s * 8, tok),
        norm(f"1st-{norm_name}"),
        _op("qkv", 2 * b * s * h * qkv // t, (h * qkv + bias * qkv) // t * E, tok, tok, qkv_out, gemm=True),
    ]
    if spec.position == "rope":
        # q and k rotated by fixed cos/sin tables (x cos + rotate_half(x) sin): linear in
        # its input, so backward needs no saved activation
        ops.append(_op("rotary", 3 * b * s * (h // t + kv_l), 0, 0, qkv_out, qkv_out))
    if spec.attention == "fused":
        # softmax(q k^T / sqrt(d)) v in one kernel: keeps q, k, v (its input), the output
        # and the fp32 log-sum-exp per row, never an s x s tensor; backward recomputes the
        # scores (FlashAttention: 5 instead of 2 s x s GEMMs, 2.5 x the forward FLOPs).
        # FLOPs are the full s x s products, as the unfused ops count them; a causal
        # kernel skips the masked blocks (about half), which measured profiles capture
        ops.append(_op("fused-attention", 4 * b * s * s * h // t + 5 * att, 0,
                       qkv_out + b * s * h // t * E + b * (a // t) * s * 4, qkv_out,
                       b * s * h // t * E, gemm=True, bwd_factor=2.5))
    else:
        ops += [
            # score keeps q and k, views of the fused qkv output: the whole qkv storage,
            # counted in the first op that keeps it (as profile_ops measures); context keeps
            # v (a view of the same storage) and the probabilities, softmax's own output
            # (counted there) when dropout is off (layer_dataflow)
            _op("score", 2 * b * s * s * h // t, 0, qkv_out, qkv_out, att * E, gemm=True),
            _op("softmax", 5 * att, 0, att * E, att * E, att * E),
            _op("attn-dropout", 2 * att, 0, mask_a, att * E, att * E, 2 * att * E + mask_a),
            _op("context", 2 * b * s * s * h // t, 0, att * E if drop_a else 0,
                att * E + b * s * kv_l * E, b * s * h // t * E, gemm=True),
        ]
    act_name = "swiglu" if spec.swiglu else spec.activation
    relu = act_name == "relu"
    # relu keeps its output g, which mlp-gemm-2 keeps too: counted once, at relu (the first)
    act_op = _op("relu", b * s * f // t, 0, b * s * f // t * E, b * s * f1 // t * E, b * s * f // t * E) if relu \
        else _op(act_name, 8 * b * s * f1 // t, 0, b * s * f1 // t * E, b * s * f1 // t * E, b * s * f // t * E)
    ops += [
        _op("attn-dense", 2 * b * s * h * h // t, (h * h // t + bias * h) * E, b * s * h // t * E,
            b * s * h // t * E, tok, gemm=True),
        _op("post-attn-dropout", 3 * b * s * h, 0, mask_h, 2 * tok, tok, 3 * tok + mask_h),
        norm(f"2nd-{norm_name}"),
        _op("mlp-gemm-1", 2 * b * s * h * f1 // t, (h * f1 + bias * f1) // t * E, tok, tok,
            b * s * f1 // t * E, gemm=True),
        act_op,
        _op("mlp-gemm-2", 2 * b * s * f * h // t, (f * h // t + bias * h) * E, 0 if relu else b * s * f // t * E,
            b * s * f // t * E, tok, gemm=True),
        _op("post-mlp-dropout", 3 * b * s * h, 0, mask_h, 2 * tok, tok, 3 * tok + mask_h),
        norm(f"final-{norm_name}"),
        # Untied output layer (vocab-parallel) + vocab-parallel cross entropy in fp32.
        _op("head+loss", 2 * b * s * h * v // t + 6 * b * s * v // t, v // t * h * E,
            tok + b * s * v // t * 4, tok, b * s * 4, tok + 3 * b * s * v // t * 4, gemm=True),
    ]
    assert tuple(op.name for op in ops) == all_ops(spec)
    return {op.name: op for op in ops}


def tp_allgathers(spec: ModelSpec, mbs: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(forward all-gathers, backward reduce-scatters) of one layer when tp > kv_heads:
    megatron-core gathers the qkv GEMM's output over the tp group (so that every rank
    sees its group's key and value head); bytes of the gathered tensor.  ((), ()) when
    tp <= kv_heads."""
    if tp <= spec.kv_heads:
        return (), ()
    full = mbs * spec.seq_len * spec.qkv_width * ACT_BYTES
    return (full,), (full,)


def tp_allreduces(spec: ModelSpec, mbs: int, part: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes (bytes per tp rank) of the (forward, backward) all-reduces when tp > 1.

    One entry per collective for one micro-batch.  ``part`` is "layer" (one
    transformer layer), "pre" (embedding) or "post" (final layernorm + head + loss).
    """
    tok = mbs * spec.seq_len * spec.hidden * ACT_BYTES
    if part == "layer":
        return (tok, tok), (tok, tok)  # attn-dense + mlp-gemm-2 outputs; qkv + mlp-gemm-1 input grads
    if part == "pre":
        return (tok,), ()              # vocab-parallel embedding output
    if part == "post":
        ce = mbs * spec.seq_len * 4    # vocab-parallel cross entropy: max, sum-exp, target logit
        return (ce, ce, ce), (tok,)    # head input grad
    raise ValueError(part)


def recompute_runs(recomputed: set[str], order=LAYER_OPS) -> list[list[str]]:
    """Maximal runs of consecutive layer ops (``order``: a spec's ``eth.spec.model.layer_ops``,
    the GPT set by default) that are all recomputed."""
    runs, run = [], []
    for op in order:
        if op in recomputed:
            run.append(op)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs
