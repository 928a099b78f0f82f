"""Import Sailor's layer profiles as a profile dict (``tools/make_profiles.py --import-sailor``).

Sailor (github eth-easl/sailor) profiles whole layers in the framework that trains
(Megatron-DeepSpeed), one JSON for all its models and GPUs
(``sailor/Planner/simulations/profiles_tmp.json``)::

    {model: {gpu: {mbs: {tp: {layer: [forward s, backward s, optimizer step s]}}}}}

where layer 0 is the embedding, 1 .. L the transformer layers and L + 1 the last one
(final layernorm, output head and loss; GPT-Neo's has no head), at ``mbs`` samples on
one rank of a tp group, with the tp collectives inside the times.  Sailor measures two
transformer layers and copies the second to the others; its embedding backward is not
measured (a microsecond).  The step is DeepSpeed's optimizer step of the profiled
two-layer model, the same for every stage.

A layer's measured time is spread over our ops in the proportions of the device type's
analytic profile (:func:`eth.profiles.db.analytic_op_costs`: the ops' roofline shares,
forward and backward apart); the embedding and the last layer likewise over their ops.
Bytes come from shapes (:func:`eth.spec.model.op_shapes` at ``dtype_bytes`` per element),
as for every profile source; the step becomes the entry's ``overhead_ms.optimizer`` per
stage (``eth.cost.model.CostModel.optimizer_ms``).  Sailor measures no workspace: the
entries reserve nothing, and the memory a rank holds beyond its tensors is the device
type's ``overhead_gb``.  ``absent`` ops (an output head the
model has not) keep no time and no bytes; the last layer's time goes to the others.
"""
from __future__ import annotations

from eth.errors import ProfileError
from eth.fileio import read_json
from eth.profiles.db import OP_FIELDS, PROFILE_VERSION, analytic_op_costs, shape_dict
from eth.spec.cluster import DeviceType
from eth.spec.model import ModelSpec, layer_ops, op_shapes, post_ops, pre_ops

MS_PER_S = 1000.0


def _spread(ops: dict, names, template: dict, fwd_ms: float, bwd_ms: float) -> None:
    """Give ``names`` of ``ops`` (op -> row) the measured ``fwd_ms`` and ``bwd_ms`` in the
    proportions of the ``template`` rows (op -> [fwd, bwd, ...])."""
    for k, total in ((0, fwd_ms), (1, bwd_ms)):
        shares = [template[op][k] for op in names]
        whole = sum(shares)
        for op, share in zip(names, shares):
            ops[op][k] = total * share / whole if whole > 0 else total / len(names)


def import_sailor(path, sailor_model: str, gpu: str, device: DeviceType, model: ModelSpec,
                  dtype_bytes: int = 4, absent: tuple[str, ...] = ()) -> dict:
    """Read Sailor's layer profiles of ``sailor_model`` on ``gpu`` into a profile dict for
    ``device`` (module docstring).  ``dtype_bytes``: the element size the layers ran in
    (Sailor's published profiles are fp32)."""
    table = read_json(path, "Sailor profile", ProfileError)
    if sailor_model not in table:
        raise ProfileError(f"{path}: no model {sailor_model!r}; it holds {', '.join(sorted(table))}")
    if gpu not in table[sailor_model]:
        raise ProfileError(f"{path}: model {sailor_model} has no GPU {gpu!r}; it holds "
                           f"{', '.join(sorted(table[sailor_model]))}")
    bad = [op for op in absent if op not in pre_ops(model) + post_ops(model)]
    if bad:
        raise ProfileError(f"absent op(s) {bad}: only the embedding and the last layer's ops may be absent")
    last = str(model.num_layers + 1)
    entries, steps = [], []
    for mbs_key, by_tp in sorted(table[sailor_model][gpu].items(), key=lambda kv: int(kv[0])):
        for tp_key, layers in sorted(by_tp.items(), key=lambda kv: int(kv[0])):
            mbs, tp = int(mbs_key), int(tp_key)
            if not model.splits(tp):
                continue
            if sorted(map(int, layers)) != list(range(model.num_layers + 2)):
                raise ProfileError(f"{path}: {sailor_model} on {gpu} at mbs {mbs}, tp {tp} holds layers 0 .. "
                                   f"{max(map(int, layers))}, not 0, 1 .. {last} of a {model.num_layers}-layer "
                                   f"model; describe the profiled model with --model and --num-layers")
            rows = {k: [float(v) * MS_PER_S for v in values] for k, values in layers.items()}
            template = analytic_op_costs(device, model, mbs, tp)
            shapes = op_shapes(model, mbs, tp, elem_bytes=dtype_bytes)
            ops = {op: [0.0, 0.0, sh.weight_bytes, sh.act_bytes, sh.input_bytes, sh.output_bytes]
                   for op, sh in shapes.items()}
            inner = [rows[str(i)] for i in range(1, model.num_layers + 1) if str(i) in rows]
            layer = [sum(r[k] for r in inner) / len(inner) for k in (0, 1)]
            _spread(ops, layer_ops(model), template, *layer)
            _spread(ops, pre_ops(model), template, *rows["0"][:2])
            kept = [op for op in post_ops(model) if op not in absent]
            _spread(ops, kept, template, *rows[last][:2])
            for op in absent:
                ops[op] = [0.0] * len(OP_FIELDS)
            step = rows["1"][2]
            steps.append(step)
            entries.append({"mbs": mbs, "tp": tp, "reserved_bytes": 0.0, "ops": ops,
                            "overhead_ms": {"optimizer": [0.0, step]}})
    if not entries:
        raise ProfileError(f"{path}: {sailor_model} on {gpu} has no tp that splits model {model.name}")
    return {"version": PROFILE_VERSION, "device": device.name, "source": "sailor-layers",
            "provenance": {"imported_from": f"{sailor_model} on {gpu} (Sailor's profiles_tmp.json)",
                           "op_times": "measured layer times (s x 1000) spread over the ops in the "
                                       "proportions of the analytic profile",
                           "act_bytes": "the tensor-level model's (eth.spec.model.op_shapes)",
                           "dtype_bytes": dtype_bytes, "absent_ops": list(absent),
                           "optimizer_step_ms": [round(min(steps), 4), round(max(steps), 4)]},
            "op_fields": list(OP_FIELDS), "tp_comm_included": True,
            "models": [{"name": model.name, "source": "sailor-layers", "tp_comm_included": True,
                        "shape": shape_dict(model), "entries": entries}]}
