"""Import Aceso's profiling output as a profile dict (``tools/make_profiles.py --import-aceso``).

Aceso's op profiler writes one CSV per (model, size, mbs, tp, algo)::

    {model}_{size}_mbs{m}_tp{t}_algo{a}.csv      e.g. gpt_1_3B_mbs4_tp2_algo0.csv
    op_name,forward-compute,backward-compute,input_size,output_size,weights,activations,
    fwd_reserved,bwd_reserved

with the times in microseconds (it scales seconds by 1e6; its own cost model divides
by 1000) and the sizes in MB of 2**20 bytes for one tp rank.  Other tools write the same
CSVs under other names (Sailor: ``OPT-350_mbs1_tp1_algo0.csv``): ``pattern`` names them,
with ``{model}``, ``{mbs}``, ``{tp}`` and ``{algo}`` standing for the fields
(:data:`DEFAULT_PATTERN`).

Profiles give times; bytes come from shapes.  The weight, activation, input and output
bytes of every op are those of our tensor-level model (:func:`eth.spec.model.op_shapes`
at the CSVs' element size, 1-byte dropout masks), the bytes the runtime's allocator
holds; the CSVs' own columns are a cross-check only.  Aceso's ``activations`` column is
what an op's forward left allocated, i.e. the tensors it *produced*; moved to the op
that keeps each of them (:func:`read_op_csv`) it charges a tensor that only passes
through an op (the residual stream) to every op that keeps its input, and so
over-counts: the ratio of the CSVs' layer bytes to the model's is kept in
``provenance.act_imported_over_model`` ([least, most] over the entries).

The communication profiler writes ``prim_{model}_{size}_{collective}_{n}gpus.csv`` with
header ``data_size(MB),time(ms)`` (times already in ms; the size is one rank's tensor,
the gathered input per rank for all_gather).  all_reduce, all_gather and
reduce_scatter become the profile's measured collective tables (all_gather as the
gathered size, n x the rank's tensor, which is what :func:`eth.profiles.db.collective_ms`
takes); all_to_all has no use here; rows of size 0 and Aceso's placeholder times for
sizes it did not run (>= 1e6 ms) are skipped.

Aceso's p2p bandwidth profiler appends, per run, two header-less rows to
``p2p_intra_node.csv`` / ``p2p_inter_node.csv``: the message sizes in MB (1, 2, ...,
1024) and the measured bandwidths in GB/s of 1024 MB.  The last run in
``p2p_intra_node.csv`` becomes the p2p table (``time ms = MB / 1024 / GB/s x 1000``);
the cost model uses measured tables only inside a node, so ``p2p_inter_node.csv`` is not
imported (between nodes the cluster's ``inter_node_gbps`` applies).

Aceso measures ops with a real tp group, so the imported op times include the tp
all-reduces: the profile says ``"tp_comm_included": true`` and the cost model adds none.
Before anything is written, the model's shape is checked against the CSVs' weight columns,
exactly (:func:`check_shape`: qkv, mlp-gemm-1 and the embedding fix hidden, the kv width,
ffn and seq_len); the softmax's activations (heads) only warn, since that column is
noisy in Aceso's own CSVs.  The warnings are printed and kept in the profile's
``provenance.warnings``.

What depends on the vocabulary is scaled to the model's instead of refused: the CSVs'
vocabulary is read from the head's weights (``vocab / tp x hidden`` elements), and the
head's times and the embedding's backward (the dense gradient of its table) are scaled
by model vocab / CSV vocab (:func:`scale_vocab`; ``provenance.csv_vocab``).  A model
without dropout runs no dropout kernels: attn-dropout keeps no time when the model's
attention dropout is 0, post-attn-dropout and post-mlp-dropout none when its hidden
dropout is 0 (:func:`not_run`, ``provenance.dropout_ops_not_run``; their bytes are the
shapes', without masks); ops the model does not have at all are given as ``absent``.
"""
from __future__ import annotations

import csv
import re
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from eth.errors import ProfileError
from eth.spec.model import ACT_BYTES, ALL_OPS, ModelSpec, all_ops, layer_ops, op_shapes
from eth.profiles.db import OP_FIELDS, PROFILE_VERSION, RESERVED_BYTES, shape_dict

US_PER_MS = 1000.0
DEFAULT_PATTERN = "{model}_mbs{mbs}_tp{tp}_algo{algo}.csv"
"""Aceso's op CSV names (``gpt_1_3B_mbs4_tp2_algo0.csv``); Sailor's fit it too."""
PATTERN_FIELDS = ("model", "mbs", "tp", "algo")
HIDDEN_DROPOUT_OPS = ("post-attn-dropout", "post-mlp-dropout")
PRIM_FILE = re.compile(r"^prim_(?P<prefix>.+)_(?P<kind>all_reduce|all_gather|reduce_scatter|all_to_all)"
                       r"_(?P<n>\d+)gpus\.csv$")
OP_HEADER = ["op_name", "forward-compute", "backward-compute", "input_size", "output_size",
             "weights", "activations", "fwd_reserved", "bwd_reserved"]
PRIM_HEADER = ["data_size(MB)", "time(ms)"]
PLACEHOLDER_MS = 1e6     # Aceso writes 1e6 / 1e9 for collectives it could not or did not run
KEEPS_INPUT = frozenset({"1st-layernorm", "qkv", "score", "context", "attn-dense", "2nd-layernorm",
                         "mlp-gemm-1", "gelu", "mlp-gemm-2", "final-layernorm", "head+loss"})
KEEPS_OUTPUT = frozenset({"softmax"})
# Aceso's op names (encoder prefix stripped, lower case) -> ours.
ALIASES = MappingProxyType({
    "embedding": "embedding", "encoder-embedding": "embedding",
    "1st-layernorm": "1st-layernorm", "attention-qkv": "qkv", "attention-score": "score",
    "attention-softmax": "softmax", "attention-dropout": "attn-dropout",
    "attention-context": "context", "attention-dense": "attn-dense",
    "post-attention-dropout": "post-attn-dropout", "2nd-layernorm": "2nd-layernorm",
    "mlp-gemm-1": "mlp-gemm-1", "mlp-gelu": "gelu", "mlp-gemm-2": "mlp-gemm-2",
    "post-mlp-dropout": "post-mlp-dropout", "final-layernorm": "final-layernorm",
    "gpt-post-process": "head+loss", "post-process": "head+loss",
})
CSV_ROUNDING = 0.0015 * 2 ** 20    # Aceso writes sizes in MB with 3 decimals
# The weight columns the shape is checked on, exactly (to the CSV's rounding): op ->
# (the GEMM weight elements of one tp rank, biases excluded, the flags that set them);
# the head's column gives the CSVs' vocabulary, the embedding's (words + positions) then seq_len
WEIGHT_CHECKS = {
    "qkv": (lambda m, tp: m.hidden * m.qkv_width // tp, ("--hidden-size", "--num-query-groups")),
    "mlp-gemm-1": (lambda m, tp: m.hidden * m.ffn // tp, ("--hidden-size", "--ffn-hidden-size")),
    "embedding": (lambda m, tp: (m.vocab // tp + m.seq_len) * m.hidden, ("--seq-length",)),
}


def not_run(model: ModelSpec) -> tuple[str, ...]:
    """The CSVs' dropout ops ``model`` does not run: attn-dropout without attention
    dropout, the post-attention and post-MLP dropouts without hidden dropout."""
    return (("attn-dropout",) if model.attn_dropout == 0 else ()) + \
        (HIDDEN_DROPOUT_OPS if model.dropout == 0 else ())


def op_file_regex(pattern: str = DEFAULT_PATTERN) -> re.Pattern:
    """The regular expression of an op CSV name ``pattern``: ``{model}`` any text, ``{mbs}``,
    ``{tp}`` and ``{algo}`` numbers (``{algo}`` may be left out: algo 0); ProfileError
    when a field is missing, repeated or unknown."""
    parts = re.split(r"\{(\w*)\}", pattern)
    names = parts[1::2]
    bad = sorted(set(names) - set(PATTERN_FIELDS))
    missing = [f for f in ("model", "mbs", "tp") if f not in names]
    if bad or missing or len(names) != len(set(names)):
        raise ProfileError(f"CSV name pattern {pattern!r} must hold {{model}}, {{mbs}} and {{tp}} once each "
                           f"(and may hold {{algo}}); fields found: {names}")
    regex = "".join(re.escape(text) if i % 2 == 0 else
                    (r"(?P<model>.+?)" if text == "model" else rf"(?P<{text}>\d+)")
                    for i, text in enumerate(parts))
    return re.compile(f"^{regex}$")


def aceso_op(name: str) -> str | None:
    key = name.strip().lower()
    for prefix in ("enc-", "dec-"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key if key in ALL_OPS else ALIASES.get(key)


def _rows(path: Path, header: list[str]):
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        got = [h.strip() for h in next(reader, [])]
        if got != header:
            raise ProfileError(f"{path.name}: header is {got}, expected {header}")
        for lineno, row in enumerate(reader, start=2):
            if not row or not row[0].strip():
                continue
            if len(row) != len(header):
                raise ProfileError(f"{path.name}:{lineno}: {len(row)} columns, expected {len(header)}")
            yield lineno, row


def _numbers(path, lineno, row):
    try:
        return list(map(float, row))
    except ValueError:
        raise ProfileError(f"{path.name}:{lineno}: non-numeric value in {row}") from None


def read_op_csv(path: Path, unit: float) -> tuple[dict, float, dict]:
    """({op: profile row}, reserved bytes, {op: raw CSV sizes in bytes}) of one op CSV.

    The row's activation bytes are Aceso's, moved from the producing op to the op that
    keeps them:

        act(op) = max(activations - output_size, 0)        what the op saved of its own
                + input_size    if the op keeps its input   (KEEPS_INPUT: GEMMs, layernorms, gelu)
                + output_size   if the op keeps its output  (KEEPS_OUTPUT: softmax)

    :func:`import_aceso` replaces them by the tensor-level model's and keeps their ratio."""
    ops, raw, reserved = {}, {}, 0.0
    for lineno, row in _rows(path, OP_HEADER):
        op = aceso_op(row[0])
        if op is None:
            raise ProfileError(f"{path.name}:{lineno}: unknown op {row[0]!r}")
        fwd_us, bwd_us, inp, out, w, act, fr, br = _numbers(path, lineno, row[1:])
        inp, out, w, act = inp * unit, out * unit, w * unit, act * unit
        kept = max(act - out, 0.0) + (inp if op in KEEPS_INPUT else 0.0) + (out if op in KEEPS_OUTPUT else 0.0)
        ops[op] = [fwd_us / US_PER_MS, bwd_us / US_PER_MS, w, kept, inp, out]
        raw[op] = {"weights": w, "activations": act}
        reserved = max(reserved, fr * unit, br * unit)
    missing = [op for op in ALL_OPS if op not in ops]
    if missing:
        raise ProfileError(f"{path.name} lacks op(s) {missing}")
    return ops, reserved, raw


def csv_vocab(raw: dict, model: ModelSpec, tp: int, size: int) -> int:
    """The vocabulary of the CSV whose head weights are ``raw["head+loss"]["weights"]``
    (``vocab / tp x hidden`` elements of ``size`` bytes)."""
    return round(raw["head+loss"]["weights"] / (model.hidden * size)) * tp


def check_shape(path: Path, raw: dict, model: ModelSpec, mbs: int, tp: int) -> tuple[int, int, list[str]]:
    """Refuse a CSV whose weight columns do not fit ``model`` exactly (ProfileError).

    Aceso's ``weights`` column holds an op's GEMM weights (the element size of the CSV's
    precision, biases excluded; a CSV that counts the biases too is accepted as well):
    qkv and mlp-gemm-1 fix hidden, the kv width and ffn; the head gives the CSV's
    vocabulary (:func:`csv_vocab`, which may differ from the model's: :func:`scale_vocab`)
    and the embedding (vocab-parallel words + the whole position table) then seq_len.
    Returns the element size (2 or 4 bytes, from qkv), the CSV's vocabulary and the
    warnings of the noisy ``activations`` column (the softmax's, which gives heads x
    seq^2, is off by up to 3x in some of Aceso's own CSVs): a warning with the numbers,
    not an error."""
    def fits(op, size, spec):
        got, want = raw[op]["weights"], WEIGHT_CHECKS[op][0](spec, tp) * size
        bias = shapes[op].weight_bytes / ACT_BYTES * size - want          # with the biases counted
        return min(abs(got - want), abs(got - want - bias)) <= CSV_ROUNDING

    shapes = op_shapes(model, mbs, tp)
    size = 4 if fits("qkv", 4, model) else 2          # fp32 CSVs; fp16 / bf16 otherwise
    vocab = csv_vocab(raw, model, tp, size)
    if vocab <= 0 or vocab % tp:
        raise ProfileError(f"{path.name}: head+loss weights {raw['head+loss']['weights'] / 2 ** 20:.3f} MB "
                           f"give no vocabulary divisible by tp {tp} at hidden {model.hidden}")
    spec = replace(model, vocab=vocab)
    for op, (fn, flags) in WEIGHT_CHECKS.items():
        got, want = raw[op]["weights"], fn(spec, tp) * size
        if not fits(op, size, spec):
            raise ProfileError(
                f"{path.name}: {op} weights {got / 2 ** 20:.3f} MB, but model {model.name} (hidden "
                f"{model.hidden}, kv_heads {model.kv_heads}, ffn {model.ffn}, seq {model.seq_len}; the "
                f"CSV's vocab {vocab}) at tp {tp} in {size}-byte elements gives {want / 2 ** 20:.3f} MB; "
                f"describe the CSVs' model with --model and {', '.join(flags)}")
    warnings = []
    want = shapes["softmax"].output_bytes / ACT_BYTES * size
    got = raw["softmax"]["activations"]
    if abs(got - want) > 0.10 * want + CSV_ROUNDING:
        warnings.append(f"{path.name}: softmax activations {got / 2 ** 20:.3f} MB, model {model.name} (heads "
                        f"{model.heads}, seq {model.seq_len}) at mbs {mbs}, tp {tp} gives {want / 2 ** 20:.3f} MB "
                        f"(imported as measured; the weights agree)")
    return size, vocab, warnings


def scale_vocab(ops: dict, ratio: float) -> None:
    """Scale the vocabulary-dependent times of ``ops`` (op -> profile row, in place) by
    ``ratio`` = model vocab / CSV vocab: the head's forward and backward (vocab-parallel
    GEMM and cross entropy) and the embedding's backward (the dense gradient of its
    table); the embedding's forward is a look-up of ``b x s`` rows."""
    ops["head+loss"][0] *= ratio
    ops["head+loss"][1] *= ratio
    ops["embedding"][1] *= ratio


def model_bytes(ops: dict, model: ModelSpec, mbs: int, tp: int, size: int) -> float:
    """Replace the byte fields of ``ops`` (op -> profile row, in place) by the tensor-level
    model's at element size ``size`` (weights, kept activations, input, output); returns
    the ratio of the replaced activation bytes of the layer ops to the model's."""
    shapes = op_shapes(model, mbs, tp, elem_bytes=size)
    imported = sum(ops[op][3] for op in layer_ops(model))
    for op, row in ops.items():
        sh = shapes[op]
        row[2:] = [sh.weight_bytes, sh.act_bytes, sh.input_bytes, sh.output_bytes]
    return imported / sum(shapes[op].act_bytes for op in layer_ops(model))


def read_prim_csv(path: Path, kind: str, n: int, unit: float) -> list[list[float]]:
    rows = []
    for lineno, row in _rows(path, PRIM_HEADER):
        size_mb, ms = _numbers(path, lineno, row)
        if size_mb <= 0 or ms >= PLACEHOLDER_MS:
            continue
        if ms < 0:
            raise ProfileError(f"{path.name}:{lineno}: negative time {ms}")
        rows.append([size_mb * unit * (n if kind == "all_gather" else 1), ms])
    return sorted(rows)


def read_p2p_csv(path: Path) -> list[list[float]]:
    """The last (sizes MB, bandwidths GB/s) row pair of an Aceso p2p file as [[bytes, ms], ...]."""
    with path.open(newline="") as fh:
        rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    if len(rows) < 2 or len(rows) % 2:
        raise ProfileError(f"{path.name}: expected pairs of rows (sizes MB, bandwidths GB/s), "
                           f"got {len(rows)} rows")
    sizes, bws = rows[-2], rows[-1]
    if len(sizes) != len(bws):
        raise ProfileError(f"{path.name}: {len(sizes)} sizes but {len(bws)} bandwidths in the last run")
    try:
        pairs = [(float(a), float(b)) for a, b in zip(sizes, bws)]
    except ValueError:
        raise ProfileError(f"{path.name}: non-numeric value in {sizes} / {bws}") from None
    bad = [(mb, gbs) for mb, gbs in pairs if mb <= 0 or gbs <= 0]
    if bad:
        raise ProfileError(f"{path.name}: sizes and bandwidths must be positive, got {bad[0][0]} MB "
                           f"at {bad[0][1]} GB/s")
    return sorted([mb * 2 ** 20, mb / 1024 / gbs * 1e3] for mb, gbs in pairs)


def _choose_prefix(folder: Path, found: set[str], aceso_model: str | None, algo: int, pattern: str) -> str:
    if aceso_model is not None:
        if aceso_model not in found:
            raise ProfileError(f"{folder} has no op CSVs of Aceso model {aceso_model!r} (algo {algo}); "
                               f"it holds: {', '.join(sorted(found)) or 'none'}")
        return aceso_model
    if not found:
        raise ProfileError(f"{folder} has no files named {pattern} (algo {algo}); name the files' pattern "
                           f"with --aceso-pattern")
    if len(found) > 1:
        raise ProfileError(f"{folder} holds op CSVs of {len(found)} Aceso models ({', '.join(sorted(found))}); "
                           f"choose one with --aceso-model")
    return next(iter(found))


def import_aceso(folder, device: str, model: ModelSpec, size_unit_bytes: float = 2 ** 20,
                 algo: int = 0, aceso_model: str | None = None, pattern: str = DEFAULT_PATTERN,
                 absent: tuple[str, ...] = ()) -> dict:
    """Read an Aceso profile folder into a profile dict for ``device`` (see module docstring).

    ``aceso_model`` (e.g. "gpt_1_3B", Aceso's ``{model}_{size}``, or what ``{model}`` of
    ``pattern`` matched) selects the CSVs of one model in a folder that holds several;
    without it the folder must hold exactly one.  ``absent``: ops the CSVs time that the
    model as it runs does not have (an attention dropout it never applies, an output head
    it has not: GPT-Neo's pipeline in Megatron-DeepSpeed ends at its final layernorm);
    they keep no time and no bytes, as the dropout ops of a model without dropout.
    """
    unknown = [op for op in absent if op not in ALL_OPS]
    if unknown:
        raise ProfileError(f"absent op(s) {unknown} are not ops of the CSVs; they hold {', '.join(ALL_OPS)}")
    folder = Path(folder)
    if all_ops(model) != tuple(model.activation if op == "gelu" else op for op in ALL_OPS):
        raise ProfileError(f"Aceso CSVs hold the GPT op set (layernorm, learned positions, unfused "
                           f"attention, gelu or relu); model {model.name} has ops {list(layer_ops(model))}")
    if not folder.is_dir():
        raise ProfileError(f"Aceso profile folder {folder} does not exist")
    regex = op_file_regex(pattern)
    files = [(p, regex.match(p.name)) for p in sorted(folder.glob("*.csv"))]
    files = [(p, m) for p, m in files if m and int(m.groupdict().get("algo") or 0) == algo]
    prefix = _choose_prefix(folder, {m["model"] for _, m in files}, aceso_model, algo, pattern)
    entries, sizes, vocabs, ratios, warnings = [], set(), set(), [], []
    for path, m in files:
        if m["model"] != prefix:
            continue
        mbs, tp = int(m["mbs"]), int(m["tp"])
        if not model.splits(tp):
            warnings.append(f"{path.name}: skipped, tp {tp} does not split model {model.name}")
            continue
        ops, reserved, raw = read_op_csv(path, size_unit_bytes)
        if model.activation != "gelu":     # Aceso's op list names the MLP's activation gelu
            ops = {model.activation if op == "gelu" else op: row for op, row in ops.items()}
        size, vocab, found = check_shape(path, raw, model, mbs, tp)
        sizes.add(size)
        vocabs.add(vocab)
        warnings += found
        if vocab != model.vocab:
            scale_vocab(ops, model.vocab / vocab)
        ratios.append(model_bytes(ops, model, mbs, tp, size))
        for op in not_run(model):
            ops[op][:2] = [0.0, 0.0]        # the shapes keep no mask; the residual add's bytes stay
        for op in absent:
            ops[op][:] = [0.0] * len(OP_FIELDS)
        entries.append({"mbs": mbs, "tp": tp, "reserved_bytes": reserved or RESERVED_BYTES, "ops": ops})
    if len(sizes) > 1:
        raise ProfileError(f"{folder}: the CSVs of {prefix} mix 2- and 4-byte weights (fp16 and fp32 runs)")
    collectives: dict = {}
    for path in sorted(folder.glob(f"prim_{prefix}_*gpus.csv")):
        pm = PRIM_FILE.match(path.name)
        if not pm or pm["prefix"] != prefix or pm["kind"] == "all_to_all" or int(pm["n"]) < 2:
            continue
        rows = read_prim_csv(path, pm["kind"], int(pm["n"]), size_unit_bytes)
        if rows:
            collectives.setdefault(pm["kind"], {})[pm["n"]] = rows
    if (folder / "p2p_intra_node.csv").is_file():
        collectives["p2p"] = {"2": read_p2p_csv(folder / "p2p_intra_node.csv")}
    data = {"version": PROFILE_VERSION, "device": device, "source": "aceso-csv",
            "provenance": {"imported_from": folder.name, "aceso_model": prefix, "algo": algo,
                           "pattern": pattern, "size_unit_bytes": size_unit_bytes,
                           "op_times": "Aceso microseconds / 1000",
                           "act_bytes": "the tensor-level model's (eth.spec.model.op_shapes)",
                           "act_imported_over_model": [round(min(ratios), 4), round(max(ratios), 4)]
                           if ratios else None,
                           "csv_vocab": sorted(vocabs), "model_vocab": model.vocab,
                           "dropout_ops_not_run": list(not_run(model)),
                           "absent_ops": list(absent),
                           "p2p": ("p2p_intra_node.csv (last run)" if "p2p" in collectives
                                   else "alpha-beta (no p2p_intra_node.csv)"),
                           "dtype_bytes": next(iter(sizes), 2), "warnings": warnings},
            "op_fields": list(OP_FIELDS), "tp_comm_included": True,
            "models": [{"name": model.name, "source": "aceso-csv", "tp_comm_included": True,
                        "shape": shape_dict(model), "entries": entries}]}
    if collectives:
        data["collectives"] = collectives
    return data
