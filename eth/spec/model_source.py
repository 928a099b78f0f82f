"""Where a model description comes from: ``--model`` and Megatron's override flags.

``--model`` takes one of three things (:func:`load_model`):

* a preset name (:data:`eth.spec.model.PRESETS`);
* a model YAML file (``*.yaml`` / ``*.yml``): the :class:`~eth.spec.model.ModelSpec`
  fields (docs/FORMATS.md, "Model file"); ``name`` defaults to the file's stem;
* a HuggingFace ``config.json`` (any ``*.json``), read by its ``architectures`` entry:
  ``LlamaForCausalLM`` and ``MistralForCausalLM`` (RMSNorm, rotary, SwiGLU, no biases,
  grouped-query attention), ``GPTNeoXForCausalLM`` (LayerNorm, rotary, GELU, biases) and
  ``GPT2LMHeadModel`` (LayerNorm, learned positions, GELU, biases) and ``OPTForCausalLM``
  (LayerNorm, learned positions, ReLU or GELU, biases), as far as our layers express
  them; ``GPTNeoForCausalLM`` is read and refused with every feature our layers lack.  A feature they do not implement is refused by name (tied embeddings,
  rope scaling, partial rotary, parallel residual, a sliding window shorter than the
  sequence, biases on some linear layers only as in Qwen2, an activation other than the
  exact GELU / SiLU), never silently dropped.

Megatron's flags then change fields of it (:func:`apply_overrides`; :func:`add_model_args`
adds them to a parser, :func:`model_from_args` reads them):

    --num-layers --hidden-size --num-attention-heads --num-query-groups --ffn-hidden-size
    --seq-length (--seq) --vocab-size --normalization --position-embedding-type --swiglu

``--num-attention-heads`` alone keeps multi-head attention (the key/value heads follow the
heads unless ``--num-query-groups`` is given), and a model whose ffn is 4 x hidden keeps
Megatron's default ffn: ``--hidden-size`` moves it, ``--swiglu`` turns it into Megatron's
SwiGLU default int(4h x 2/3 / 64) x 64; ``--vocab-size`` is the padded vocabulary (ours has
no padding step).  ``--group-query-attention`` is accepted and changes nothing.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from eth.errors import SpecError, is_count, is_number
from eth.fileio import read_yaml
from eth.spec.model import PRESETS, ModelSpec

OVERRIDE_FLAGS = {
    "num_layers": ("--num-layers", "num_layers"),
    "hidden_size": ("--hidden-size", "hidden"),
    "num_attention_heads": ("--num-attention-heads", "heads"),
    "num_query_groups": ("--num-query-groups", "kv_heads"),
    "ffn_hidden_size": ("--ffn-hidden-size", "ffn"),
    "seq_length": ("--seq-length", "seq_len"),
    "vocab_size": ("--vocab-size", "vocab"),
    "normalization": ("--normalization", "norm"),
    "position_embedding_type": ("--position-embedding-type", "position"),
    "swiglu": ("--swiglu", "swiglu"),
}
"""argparse dest -> (Megatron flag, ModelSpec field)."""
NORMALIZATIONS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
POSITION_TYPES = {"learned_absolute": "learned", "rope": "rope"}
HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "GPTNeoXForCausalLM", "GPT2LMHeadModel",
                    "OPTForCausalLM", "GPTNeoForCausalLM")
TIED_BY_DEFAULT = ("GPT2LMHeadModel", "OPTForCausalLM", "GPTNeoForCausalLM")
"""Architectures whose config class ties the embeddings unless ``tie_word_embeddings`` says no."""


def load_model(source: str, seq_len: int | None = None) -> ModelSpec:
    """The model ``source`` names (module docstring); ``seq_len`` (``--seq-length``), when
    given, is the sequence length a HuggingFace config's limits are checked against."""
    if source in PRESETS:
        return PRESETS[source]
    path = Path(source)
    if path.suffix in (".yaml", ".yml", ".json") and not path.is_file():
        raise SpecError(f"--model {source}: no such file")
    if path.suffix in (".yaml", ".yml"):
        data = read_yaml(path, "model")
        if not isinstance(data, dict):
            raise SpecError(f"{source}: a model file is a mapping of ModelSpec fields, got {type(data).__name__}")
        for key in ("norm_eps", "rope_theta", "dropout"):     # YAML 1.1 reads 1e-6 as a string
            if isinstance(data.get(key), str):
                try:
                    data[key] = float(data[key])
                except ValueError:
                    raise SpecError(f"{source}: {key} must be a number, got {data[key]!r}") from None
        return ModelSpec.from_dict({"name": path.stem, **data}, where=str(source))
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise SpecError(f"{source}: not a readable JSON file ({err})") from None
        if not isinstance(data, dict):
            raise SpecError(f"{source}: a HuggingFace config is a JSON object, got {type(data).__name__}")
        return from_hf_config(data, name=_hf_name(path, data), where=str(source), seq_len=seq_len)
    raise SpecError(f"unknown model {source!r}: give a preset ({', '.join(PRESETS)}), a model YAML file "
                    f"or a HuggingFace config.json")


def _hf_name(path: Path, data: dict) -> str:
    name = data.get("_name_or_path")
    if isinstance(name, str) and name:
        return name.rstrip("/").rpartition("/")[2]
    return path.parent.name if path.stem == "config" and path.parent.name else path.stem


# Defaults of the transformers config classes for keys a config.json may leave out
HF_DEFAULTS = {
    "LlamaForCausalLM": {"num_key_value_heads": None, "sliding_window": None},
    "MistralForCausalLM": {"num_key_value_heads": 8, "sliding_window": 4096},
}


def from_hf_config(cfg: dict, name: str = "hf-model", where: str = "config.json",
                   seq_len: int | None = None) -> ModelSpec:
    """A ModelSpec from a HuggingFace ``config.json`` dict (module docstring); refuses by
    name what our layers do not implement.  ``seq_len`` replaces max_position_embeddings
    (a sliding window is checked against the sequence actually trained)."""
    if not isinstance(cfg, dict):
        raise SpecError(f"{where}: a HuggingFace config is a JSON object")
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else cfg.get("model_type", "?")
    if arch not in HF_ARCHITECTURES:
        raise SpecError(f"{where}: architecture {arch} is not supported; supported: {', '.join(HF_ARCHITECTURES)}"
                        + ("" if arch != "Qwen2ForCausalLM" else " (Qwen2 has biases on q, k and v only; our "
                           "layers have biases in every linear layer or in none)"))

    def count(key, default=None):
        if key not in cfg and default is None:
            raise SpecError(f"{where}: {arch} config is missing {key!r}")
        value = cfg.get(key, default)
        if not is_count(value):
            raise SpecError(f"{where}: {arch} config needs {key!r} as a positive integer, got {value!r}")
        return value

    def number(key, default):
        value = cfg.get(key)
        value = default if value is None else value
        if isinstance(value, bool) or not is_number(value) or value < 0:
            raise SpecError(f"{where}: {arch} config needs {key!r} as a number >= 0, got {value!r}")
        return float(value)

    def refuse(what):
        raise SpecError(f"{where}: {arch} with {what} is not supported by our layers")

    if arch == "GPTNeoForCausalLM":
        _refuse_gpt_neo(cfg, where)
    if cfg.get("tie_word_embeddings", arch in TIED_BY_DEFAULT):
        refuse("tie_word_embeddings true (input and output embeddings are untied here)")
    if cfg.get("rope_scaling"):
        refuse(f"rope_scaling {cfg['rope_scaling']!r}")
    rope = cfg.get("rope_parameters") or {}          # newer transformers keep rope settings here
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        refuse(f"rope_parameters {rope!r} (only the default rope)")
    if arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        defaults = HF_DEFAULTS[arch]
        if cfg.get("hidden_act", "silu") != "silu":
            refuse(f"hidden_act {cfg['hidden_act']!r} (the gated MLP is SwiGLU: silu)")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                refuse(f"{key} true")
        if number("attention_dropout", 0.0):
            refuse(f"attention_dropout {cfg['attention_dropout']} (our dropout also acts on the residual stream)")
        heads = count("num_attention_heads")
        kv = cfg.get("num_key_value_heads", defaults["num_key_value_heads"])
        spec = dict(num_layers=count("num_hidden_layers"), hidden=count("hidden_size"), heads=heads,
                    kv_heads=heads if kv is None else count("num_key_value_heads", kv), ffn=count("intermediate_size"),
                    vocab=count("vocab_size"), seq_len=seq_len or count("max_position_embeddings"), norm="rmsnorm",
                    norm_eps=number("rms_norm_eps", 1e-6), position="rope",
                    rope_theta=number("rope_theta", rope.get("rope_theta", 10000.0)),
                    swiglu=True, bias=False, dropout=0.0)
        window = cfg.get("sliding_window", defaults["sliding_window"])
        if window is not None and cfg.get("use_sliding_window", True):
            window = count("sliding_window", window)
            if window < spec["seq_len"]:
                refuse(f"sliding_window {window} shorter than the sequence ({spec['seq_len']}; "
                       f"--seq-length {window} or less makes it plain causal attention)")
    elif arch == "GPTNeoXForCausalLM":
        if cfg.get("use_parallel_residual", True):
            refuse("use_parallel_residual true (attention and MLP in parallel)")
        if number("rotary_pct", 0.25) != 1.0:
            refuse(f"rotary_pct {cfg.get('rotary_pct', 0.25)} (rotary on part of each head)")
        if cfg.get("hidden_act", "gelu") != "gelu":
            refuse(f"hidden_act {cfg['hidden_act']!r} (the MLP uses the exact GELU)")
        if not cfg.get("attention_bias", True):
            refuse("attention_bias false (biases in every linear layer or in none)")
        theta = cfg.get("rotary_emb_base", cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        spec = dict(num_layers=count("num_hidden_layers"), hidden=count("hidden_size"),
                    heads=count("num_attention_heads"), ffn=count("intermediate_size"), vocab=count("vocab_size"),
                    seq_len=seq_len or count("max_position_embeddings"), norm_eps=number("layer_norm_eps", 1e-5),
                    position="rope", rope_theta=theta,
                    dropout=_one_dropout(cfg, ("hidden_dropout", "attention_dropout"), where))
    elif arch == "OPTForCausalLM":
        if not cfg.get("do_layer_norm_before", True):
            refuse("do_layer_norm_before false (layernorm after attention and MLP, as OPT-350m)")
        hidden = count("hidden_size")
        if cfg.get("word_embed_proj_dim", hidden) != hidden:
            refuse(f"word_embed_proj_dim {cfg['word_embed_proj_dim']} != hidden_size {hidden} (projections "
                   f"between the embedding and the layers)")
        if not cfg.get("enable_bias", True):
            refuse("enable_bias false (biases in every linear layer or in none: give bias: false in a model YAML)")
        if not cfg.get("layer_norm_elementwise_affine", True):
            refuse("layer_norm_elementwise_affine false (layernorms without weights)")
        if number("layerdrop", 0.0):
            refuse(f"layerdrop {cfg['layerdrop']}")
        activation = cfg.get("activation_function", "relu")
        if activation not in ("relu", "gelu"):
            refuse(f"activation_function {activation!r} (relu or the exact GELU)")
        spec = dict(num_layers=count("num_hidden_layers"), hidden=hidden, heads=count("num_attention_heads"),
                    ffn=count("ffn_dim"), vocab=count("vocab_size"),
                    seq_len=seq_len or count("max_position_embeddings"), activation=activation,
                    dropout=number("dropout", 0.1), attention_dropout=number("attention_dropout", 0.0))
    else:   # GPT2LMHeadModel
        if cfg.get("activation_function", "gelu_new") != "gelu":
            refuse(f"activation_function {cfg.get('activation_function', 'gelu_new')!r} (the MLP uses "
                   f"the exact GELU)")
        hidden = count("n_embd")
        spec = dict(num_layers=count("n_layer"), hidden=hidden, heads=count("n_head"),
                    ffn=count("n_inner") if cfg.get("n_inner") is not None else 4 * hidden,
                    vocab=count("vocab_size"), seq_len=seq_len or count("n_positions"),
                    norm_eps=number("layer_norm_epsilon", 1e-5),
                    dropout=_one_dropout(cfg, ("resid_pdrop", "embd_pdrop", "attn_pdrop"), where, 0.1))
    head_dim = cfg.get("head_dim")
    if head_dim is not None and (not is_count(head_dim) or head_dim * spec["heads"] != spec["hidden"]):
        refuse(f"head_dim {head_dim!r} (not hidden_size / num_attention_heads = "
               f"{spec['hidden']} / {spec['heads']})")
    return ModelSpec(name=name, **spec)


def _refuse_gpt_neo(cfg: dict, where: str) -> None:
    """GPT-Neo's layers differ from ours in ways a spec cannot state: SpecError naming them."""
    lacks = ["q, k and v projections without biases beside biased output and MLP projections",
             "attention scores not scaled by 1 / sqrt(head_dim)"]
    kinds = {kind for kinds, n in (cfg.get("attention_types") or [[["global"], 1]]) for kind in kinds}
    if "local" in kinds or "local" in (cfg.get("attention_layers") or []):
        lacks.insert(0, f"local attention layers (a window of {cfg.get('window_size', 256)} tokens)")
    if cfg.get("activation_function", "gelu_new") != "gelu":
        lacks.append(f"activation_function {cfg.get('activation_function', 'gelu_new')!r}")
    raise SpecError(f"{where}: GPTNeoForCausalLM with {'; '.join(lacks)} is not supported by our layers "
                    f"(a model YAML describes the nearest shape we train)")


def _one_dropout(cfg: dict, keys, where: str, default: float = 0.0) -> float:
    values = {k: cfg.get(k, default) for k in keys}
    bad = {k: v for k, v in values.items() if isinstance(v, bool) or not is_number(v)}
    if bad:
        raise SpecError(f"{where}: dropout probabilities must be numbers, got {bad}")
    if len(set(values.values())) > 1:
        raise SpecError(f"{where}: one dropout probability for every dropout here, got {values}")
    return float(next(iter(values.values())))


def add_model_args(parser, required: bool = True, model_help: str = "", model: bool = True,
                   title: str = "model overrides (Megatron-LM's flags; change fields of --model)") -> None:
    """``--model`` (unless ``model`` is False) and Megatron's model flags (module docstring)."""
    if model:
        parser.add_argument("--model", required=required, metavar="PRESET|FILE",
                            help=model_help or "model: a preset name, a model YAML file or a HuggingFace config.json")
    g = parser.add_argument_group(title)
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int, help="alone: the key/value heads follow (multi-head)")
    g.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="accepted for Megatron-LM's command lines: --num-query-groups sets the groups")
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--seq-length", "--seq", dest="seq_length", type=int, help="sequence length")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--normalization", choices=sorted(NORMALIZATIONS))
    g.add_argument("--position-embedding-type", choices=sorted(POSITION_TYPES))
    g.add_argument("--swiglu", action="store_true", default=None, help="gated MLP (SwiGLU)")


def overrides_of(args) -> dict:
    """{dest: value} of the model flags given in ``args``."""
    return {dest: getattr(args, dest) for dest in OVERRIDE_FLAGS if getattr(args, dest, None) is not None}


def apply_overrides(model: ModelSpec, overrides: dict) -> ModelSpec:
    """``model`` with Megatron's flags (``{argparse dest: value}``) applied; the
    divisibility rules are checked here so that the error names the flags."""
    unknown = sorted(set(overrides) - set(OVERRIDE_FLAGS))
    if unknown:
        raise SpecError(f"unknown model override(s) {unknown}; known: {sorted(OVERRIDE_FLAGS)}")
    for dest, value in overrides.items():
        flag = OVERRIDE_FLAGS[dest][0]
        for table in ({"normalization": NORMALIZATIONS, "position_embedding_type": POSITION_TYPES}.get(dest),):
            if table is not None and value not in table:
                raise SpecError(f"{flag} must be one of {sorted(table)}, got {value!r}")
        if dest not in ("normalization", "position_embedding_type", "swiglu") and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise SpecError(f"{flag} must be a positive integer, got {value!r}")
    fields = {OVERRIDE_FLAGS[d][1]: v for d, v in overrides.items()}
    if "norm" in fields:
        fields["norm"] = NORMALIZATIONS[fields["norm"]]
    if "position" in fields:
        fields["position"] = POSITION_TYPES[fields["position"]]
    if fields.get("heads", model.heads) != model.heads and "kv_heads" not in fields:
        fields["kv_heads"] = fields["heads"]              # multi-head unless groups are given
    if "ffn" not in fields and model.ffn == 4 * model.hidden and not model.swiglu:
        hidden = fields.get("hidden", model.hidden)       # Megatron's default ffn follows hidden
        if fields.get("swiglu"):
            fields["ffn"] = int(4 * hidden * 2 / 3 / 64) * 64    # ... and its SwiGLU default
        elif "hidden" in fields:
            fields["ffn"] = 4 * hidden
    hidden, heads = fields.get("hidden", model.hidden), fields.get("heads", model.heads)
    kv = fields.get("kv_heads", model.kv_heads)
    if hidden % heads:
        raise SpecError(f"--num-attention-heads {heads} does not divide --hidden-size {hidden}")
    if heads % kv:
        raise SpecError(f"--num-query-groups {kv} does not divide --num-attention-heads {heads}")
    return replace(model, **fields) if fields else model


def model_from_args(args, **fields) -> ModelSpec:
    """The ModelSpec of ``args.model`` with the flags of :func:`add_model_args` applied and
    then ModelSpec ``fields`` (e.g. ``attention``; None values ignored)."""
    model = apply_overrides(load_model(args.model, getattr(args, "seq_length", None)), overrides_of(args))
    fields = {k: v for k, v in fields.items() if v is not None}
    return replace(model, **fields) if fields else model
