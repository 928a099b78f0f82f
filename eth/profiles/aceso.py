"""Import Aceso's profiling output as a profile dict (``tools/make_profiles.py --import-aceso``).

Aceso's op profiler writes one CSV per (model, size, mbs, tp, algo)::

    {model}_{size}_mbs{m}_tp{t}_algo{a}.csv      e.g. gpt_1_3B_mbs4_tp2_algo0.csv
    op_name,forward-compute,backward-compute,input_size,output_size,weights,activations,
    fwd_reserved,bwd_reserved

with the times in microseconds (it scales seconds by 1e6; its own cost model divides
by 1000) and the sizes in MB of 2**20 bytes for one tp rank.  ``activations`` is the
memory the op's forward left allocated, i.e. the tensors the op *produced* (its output
and what it saved of its own, such as a dropout mask or layernorm statistics).  Our
profiles give each op the bytes it *keeps for backward* (docs/FORMATS.md), so the
import moves a tensor from its producer to the op that keeps it:

    act(op) = max(activations - output_size, 0)        what the op saved of its own
            + input_size    if the op keeps its input   (KEEPS_INPUT: GEMMs, layernorms, gelu)
            + output_size   if the op keeps its output  (KEEPS_OUTPUT: softmax)

Input sizes come from the keeper's own ``input_size`` column, so a tensor that Aceso
passes along an op unused (its "extra" tensors, e.g. v past score) counts at each op
that lists it: the import errs on the side of more memory.

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
exactly (:func:`check_shape`: qkv, mlp-gemm-1, embedding and head fix hidden, the kv
width, ffn, vocab and seq_len); the softmax's activations (heads) only warn, since that
column is noisy in Aceso's own CSVs.  The warnings are printed and kept in the profile's
``provenance.warnings``.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path
from types import MappingProxyType

from eth.errors import ProfileError
from eth.spec.model import ACT_BYTES, ALL_OPS, ModelSpec, all_ops, layer_ops, op_shapes
from eth.profiles.db import OP_FIELDS, PROFILE_VERSION, RESERVED_BYTES, SHAPE_FIELDS

US_PER_MS = 1000.0
OP_FILE = re.compile(r"^(?P<prefix>[A-Za-z0-9.-]+_.+?)_mbs(?P<mbs>\d+)_tp(?P<tp>\d+)_algo(?P<algo>\d+)\.csv$")
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
# (the GEMM weight elements of one tp rank, biases excluded, the flags that set them)
WEIGHT_CHECKS = {
    "qkv": (lambda m, tp: m.hidden * m.qkv_width // tp, ("--hidden-size", "--num-query-groups")),
    "mlp-gemm-1": (lambda m, tp: m.hidden * m.ffn // tp, ("--hidden-size", "--ffn-hidden-size")),
    "embedding": (lambda m, tp: (m.vocab // tp + m.seq_len) * m.hidden, ("--vocab-size", "--seq-length")),
    "head+loss": (lambda m, tp: m.vocab // tp * m.hidden, ("--vocab-size",)),
}


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
    """({op: profile row}, reserved bytes, {op: raw CSV sizes in bytes}) of one op CSV."""
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


def check_shape(path: Path, raw: dict, model: ModelSpec, mbs: int, tp: int) -> tuple[int, list[str]]:
    """Refuse a CSV whose weight columns do not fit ``model`` exactly (ProfileError).

    Aceso's ``weights`` column holds an op's GEMM weights (the element size of the CSV's
    precision, biases excluded; a CSV that counts the biases too is accepted as well):
    qkv and mlp-gemm-1 fix hidden, the kv width and ffn, the embedding (vocab-parallel
    words + the whole position table) and the head fix vocab and seq_len.  Returns the
    element size (2 or 4 bytes, from qkv) and the warnings of the noisy ``activations``
    column (the softmax's, which gives heads x seq^2, is off by up to 3x in some of
    Aceso's own CSVs): a warning with the numbers, not an error."""
    shapes = op_shapes(model, mbs, tp)
    elems = {op: fn(model, tp) for op, (fn, _) in WEIGHT_CHECKS.items()}
    def fits(op, size):
        got, want = raw[op]["weights"], elems[op] * size
        bias = shapes[op].weight_bytes / ACT_BYTES * size - want          # with the biases counted
        return min(abs(got - want), abs(got - want - bias)) <= CSV_ROUNDING

    size = 4 if fits("qkv", 4) else 2          # fp32 CSVs; fp16 / bf16 otherwise
    for op, (_, flags) in WEIGHT_CHECKS.items():
        got, want = raw[op]["weights"], elems[op] * size
        if not fits(op, size):
            raise ProfileError(
                f"{path.name}: {op} weights {got / 2 ** 20:.3f} MB, but model {model.name} (hidden "
                f"{model.hidden}, kv_heads {model.kv_heads}, ffn {model.ffn}, vocab {model.vocab}, seq "
                f"{model.seq_len}) at tp {tp} in {size}-byte elements gives {want / 2 ** 20:.3f} MB; describe "
                f"the CSVs' model with --model and {', '.join(flags)}")
    warnings = []
    want = shapes["softmax"].output_bytes / ACT_BYTES * size
    got = raw["softmax"]["activations"]
    if abs(got - want) > 0.10 * want + CSV_ROUNDING:
        warnings.append(f"{path.name}: softmax activations {got / 2 ** 20:.3f} MB, model {model.name} (heads "
                        f"{model.heads}, seq {model.seq_len}) at mbs {mbs}, tp {tp} gives {want / 2 ** 20:.3f} MB "
                        f"(imported as measured; the weights agree)")
    return size, warnings


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


def _choose_prefix(folder: Path, found: set[str], aceso_model: str | None, algo: int) -> str:
    if aceso_model is not None:
        if aceso_model not in found:
            raise ProfileError(f"{folder} has no op CSVs of Aceso model {aceso_model!r} (algo {algo}); "
                               f"it holds: {', '.join(sorted(found)) or 'none'}")
        return aceso_model
    if not found:
        raise ProfileError(f"{folder} has no files named {{model}}_{{size}}_mbs{{m}}_tp{{t}}_algo{algo}.csv")
    if len(found) > 1:
        raise ProfileError(f"{folder} holds op CSVs of {len(found)} Aceso models ({', '.join(sorted(found))}); "
                           f"choose one with --aceso-model")
    return next(iter(found))


def import_aceso(folder, device: str, model: ModelSpec, size_unit_bytes: float = 2 ** 20,
                 algo: int = 0, aceso_model: str | None = None) -> dict:
    """Read an Aceso profile folder into a profile dict for ``device`` (see module docstring).

    ``aceso_model`` (e.g. "gpt_1_3B", Aceso's ``{model}_{size}``) selects the CSVs of one
    model in a folder that holds several; without it the folder must hold exactly one.
    """
    folder = Path(folder)
    if all_ops(model) != ALL_OPS:
        raise ProfileError(f"Aceso CSVs hold the GPT op set (layernorm, learned positions, unfused "
                           f"attention, gelu); model {model.name} has ops {list(layer_ops(model))}")
    if not folder.is_dir():
        raise ProfileError(f"Aceso profile folder {folder} does not exist")
    files = [(p, OP_FILE.match(p.name)) for p in sorted(folder.glob("*.csv"))]
    files = [(p, m) for p, m in files if m and int(m["algo"]) == algo]
    prefix = _choose_prefix(folder, {m["prefix"] for _, m in files}, aceso_model, algo)
    entries, sizes, warnings = [], set(), []
    for path, m in files:
        if m["prefix"] != prefix:
            continue
        mbs, tp = int(m["mbs"]), int(m["tp"])
        ops, reserved, raw = read_op_csv(path, size_unit_bytes)
        size, found = check_shape(path, raw, model, mbs, tp)
        sizes.add(size)
        warnings += found
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
            "provenance": {"imported_from": str(folder), "aceso_model": prefix, "algo": algo,
                           "size_unit_bytes": size_unit_bytes,
                           "op_times": "Aceso microseconds / 1000",
                           "act_bytes": "moved from the producing op to the op that keeps it (eth/profiles/aceso.py)",
                           "p2p": ("p2p_intra_node.csv (last run)" if "p2p" in collectives
                                   else "alpha-beta (no p2p_intra_node.csv)"),
                           "dtype_bytes": next(iter(sizes), 2), "warnings": warnings},
            "op_fields": list(OP_FIELDS), "tp_comm_included": True,
            "models": [{"name": model.name, "source": "aceso-csv", "tp_comm_included": True,
                        "shape": {f: getattr(model, f) for f in SHAPE_FIELDS}, "entries": entries}]}
    if collectives:
        data["collectives"] = collectives
    return data
