"""Stages that start or end inside a layer (plan version 2, ``--op-boundaries``).

:class:`CutStages` is a part of :class:`eth.cost.model.CostModel`, as
:class:`eth.cost.floors.StageFloors` is: it reads the model's profiles, memoised layer
keeps and measured-collective choice, and gives :meth:`eth.cost.model.CostModel.stage_cost`
the shape of a stage whose first or last layer it holds only in part.
"""
from __future__ import annotations

from eth.profiles.db import collective_ms
from eth.spec.model import (ACT_BYTES, cut_tensors, layer_ops, post_ops, pre_ops, recompute_runs, tp_allgathers,
                            tp_allreduces)


class CutStages:
    """Stage shapes of stages cut inside a layer, for :class:`eth.cost.model.CostModel`."""

    def cut_stage_shape(self, device_type: str, tp: int, micro: int, layers: tuple[int, int],
                        ops: tuple[str, str], recompute: dict[str, int],
                        links: tuple[float, float, float]) -> tuple:
        """The stage shape (as the cost model's ``_stage_shape``) of a stage that starts or
        ends inside a layer, layer by layer: each layer's held ops (``StagePlan.held_ops``) add their times and weights, and
        keep :class:`eth.cost.activations.LayerKeep` of that part under its recomputed
        ops (``StagePlan.recompute_layers``); a layer's TP all-reduces count with the
        ops they follow (attn-dense, mlp-gemm-2 forward; qkv, mlp-gemm-1 backward).  A
        boundary inside a layer carries ``eth.spec.model.cut_tensors``: the p2p messages
        are their bytes, the tp-sharded ones are all-gathered over the sender's tp group
        (forward) and the receiver's (backward), and the received buffer is kept per
        micro-batch in flight.  :meth:`eth.cost.model.CostModel.stage_cost` memoises the
        StageCost it gives."""
        from eth.spec.plan import StagePlan

        model, names = self.model, layer_ops(self.model)
        stage = StagePlan([], device_type, tp, 1, tuple(layers), recompute, ops=tuple(ops))
        a, b = stage.span(model)
        first, last = a == 0, b == model.num_layers * len(names)
        prof = self.profiles.get(device_type)
        scale = prof.dtype_bytes / ACT_BYTES
        costs, reserved = self.profiles.layer_costs(device_type, model, micro, tp)
        full = self.layer_keep(costs)
        link_tp, link_next, link_prev = links
        measured = self._measured(prof, device_type, link_tp)
        tp_comm = tp > 1 and not prof.tp_comm_included(model)
        tok = tp_allreduces(model, micro, "layer")[0][0] * scale
        ar = collective_ms("all_reduce", tp, tok, link_tp, measured) if tp_comm else 0.0
        ag_f, ag_b = tp_allgathers(model, micro, tp)
        oh = self.profiles.overheads(device_type, model, micro, tp)
        fwd = bwd = weights = act = recompute_ms = comm = remat = 0.0
        held_in = dict.fromkeys(range(*layers), names)   # whole but for the first and last
        for layer in {layers[0], layers[1] - 1}:
            held_in[layer] = stage.held_ops(model, layer)
        redo_in: dict[int, set] = {layer: set() for layer in held_in}
        for op, n in recompute.items():   # the first n of the stage's layers that run op
            for layer in [layer for layer, held in held_in.items() if op in held][:n]:
                redo_in[layer].add(op)
        groups: dict[tuple, int] = {}   # layers alike: the same held ops and recomputed ones
        for layer, held in held_in.items():
            key = (held, frozenset(redo_in[layer]))
            groups[key] = groups.get(key, 0) + 1
        for (held, redo), n in groups.items():
            fwd += n * (sum(costs[op].fwd_ms for op in held) + oh[0])
            bwd += n * (sum(costs[op].bwd_ms for op in held) + oh[1])
            weights += n * sum(costs[op].weight_bytes for op in held)
            keep = full if held == names else self._part_keep(costs, held)
            act += n * keep.kept(redo)
            recompute_ms += n * sum(costs[op].fwd_ms for op in redo)
            runs = recompute_runs(set(redo), held)
            fwd += n * (len(runs) * oh[6] + sum(map(len, runs)) * oh[8])
            bwd += n * (len(runs) * oh[7] + sum(map(len, runs)) * oh[9])
            remat = max([remat] + [keep.rematerialised(run, redo) for run in runs])
            if tp_comm:
                comm_f = ar * (("attn-dense" in held) + ("mlp-gemm-2" in held))
                comm_b = ar * (("qkv" in held) + ("mlp-gemm-1" in held))
                again = ar * (("attn-dense" in redo) + ("mlp-gemm-2" in redo))
                if ag_f and "qkv" in held:
                    comm_f += sum(collective_ms("all_gather", tp, x * scale, link_tp, measured) for x in ag_f)
                    comm_b += sum(collective_ms("reduce_scatter", tp, x * scale, link_tp, measured) for x in ag_b)
                fwd, bwd = fwd + n * comm_f, bwd + n * comm_b
                comm += n * (comm_f + comm_b + again)
                recompute_ms += n * again
        for op in (pre_ops(model) if first else ()) + (post_ops(model) if last else ()):
            fwd, bwd = fwd + costs[op].fwd_ms, bwd + costs[op].bwd_ms
            weights, act = weights + costs[op].weight_bytes, act + costs[op].act_bytes
        if tp_comm:
            for part in (["pre"] if first else []) + (["post"] if last else []):
                f_sizes, b_sizes = tp_allreduces(model, micro, part)
                comm_f = sum(collective_ms("all_reduce", tp, x * scale, link_tp, measured) for x in f_sizes)
                comm_b = sum(collective_ms("all_reduce", tp, x * scale, link_tp, measured) for x in b_sizes)
                fwd, bwd, comm = fwd + comm_f, bwd + comm_b, comm + comm_f + comm_b
        fwd += oh[2]
        bwd += oh[3] + recompute_ms
        send_f = send_b = 0.0
        for pos, is_in in ((a, True), (b, False)):
            if (is_in and first) or (not is_in and last):
                continue
            cut = cut_tensors(model, names[pos % len(names) - 1]) if pos % len(names) else ()
            message = micro * (sum(t.numel for t in cut) if cut else model.seq_len * model.hidden) * ACT_BYTES * scale
            link = link_prev if is_in else link_next
            p2p = collective_ms("p2p", 2, message, link, self._measured(prof, device_type, link))
            sharded = micro * sum(t.numel for t in cut if t.shard) * ACT_BYTES * scale
            gather = collective_ms("all_gather", tp, sharded, link_tp, measured) if tp > 1 and sharded else 0.0
            if is_in:
                act += message if cut else 0.0   # at a layer boundary the first op keeps it
                send_b, bwd = p2p, bwd + p2p + gather
            else:
                send_f, fwd = p2p, fwd + p2p + gather
            comm += p2p + gather
        transient = self.backward_bytes(costs, last) + remat
        return fwd, bwd, recompute_ms, comm, weights / prof.dtype_bytes, act, reserved, send_f, send_b, transient
