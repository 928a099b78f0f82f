"""Whole-run recompute as an alternative to the op-by-op rule of the stage fit.

:meth:`eth.planner.evaluate.Evaluator.fit_stage` recomputes ops one at a time in order of
saved bytes per recompute ms.  A recomputed *run* of consecutive ops frees what its ops
store but keeps only the run's input (:meth:`eth.cost.model.CostModel.recompute_savings`), so
recomputing a whole layer (Megatron's "full" recompute) or the attention core as one run
(its "selective") can free the needed memory for less time than the op order's choice.
:class:`RunEvaluator` fits each stage that needs recompute also with those two runs --
every op of the run in the stage's first m layers, m the smallest that fits -- and keeps
the fastest of the three.
"""
from __future__ import annotations

import math

from eth.spec.model import UNFUSED_ATTENTION_OPS, layer_ops
from eth.planner.evaluate import Evaluator


class RunEvaluator(Evaluator):
    """An :class:`Evaluator` whose stage fit also tries whole-run recompute (module docstring)."""

    def __init__(self, cost, memo: bool = True):
        super().__init__(cost, memo)
        ops = layer_ops(self.model)
        core = tuple(op for op in ops if op in UNFUSED_ATTENTION_OPS + ("fused-attention",))
        self.runs = tuple(r for r in (core, ops) if r)
        self._run_fit: dict = {}   # fit key -> result (every stage, not only those with recompute)
        self._facts: dict = {}

    def fit_stage(self, st, layers, mbs, j, num_stages, nmb, ranks, next_ranks, prev_ranks=None, links=None):
        inflight = max(1, min(num_stages - j, nmb))
        if links is None:
            links = self.cost.stage_links(st.device_type, st.tp, ranks, next_ranks, prev_ranks)
        first, last = layers[0] == 0, layers[1] == self.model.num_layers
        # all that the fit reads; the stage by its fields (a StageState key compares in Python)
        key = (st.device_type, st.ndev, st.tp, st.layers, first, last, mbs, inflight) + tuple(links)
        hit = self._run_fit.get(key)
        if hit is None:
            hit = super().fit_stage(st, layers, mbs, j, num_stages, nmb, ranks, next_ranks, prev_ranks, links)
            if hit[1]:           # recompute needed: also the runs
                hit = self._runs(st, layers, mbs, inflight, first, last, links, hit)
            self._run_fit[key] = hit
        return hit

    def _runs(self, st, layers, mbs, inflight, first, last, links, base):
        """The fastest of ``base`` (the op order's fit) and each run in its fewest layers."""
        nl, micro = layers[1] - layers[0], mbs // st.dp

        def cost(rec):
            return self.cost.stage_cost_at(st.device_type, st.tp, st.dp, nl, first, last, mbs, rec, inflight, links)

        # as in Evaluator.fit_stage: memory = fixed + inflight * max(act - saved, 0), and a
        # run in m layers saves m times its one-layer saving and costs m times its forward
        c0 = cost({})
        room = c0.capacity_bytes - (c0.memory_bytes - c0.inflight * c0.act_bytes)
        best = base
        for run in self.runs if room >= 0 else ():
            saved1, run_ms = self._run_facts(st.device_type, micro, st.tp, run)
            if saved1 <= 0:
                continue
            need = c0.inflight * c0.act_bytes - room           # bytes the run must free, x inflight
            m = max(1, min(nl, math.ceil(need / (c0.inflight * saved1) - 1e-9)))
            if best[2] == 0 and m * run_ms >= best[0].recompute_ms:
                continue                                       # no faster than the fit so far
            for n in range(m, nl + 1):                         # the formula's m, then more if needed
                c = cost({op: n for op in run})
                if c.fits:
                    if best[2] > 0 or c.total_ms < best[0].total_ms * (1 - 1e-12):
                        best = (c, tuple(sorted((op, n) for op in run)), 0.0)
                    break
        return best

    def _run_facts(self, device_type: str, micro: int, tp: int, run) -> tuple[float, float]:
        """(bytes one layer's recompute of ``run`` frees, its recompute ms) at this shape."""
        key = (device_type, micro, tp, run)
        if key not in self._facts:
            ops = self.cost.profiles.layer_costs(device_type, self.model, micro, tp)[0]
            self._facts[key] = (self.cost.recompute_savings(ops, {op: 1 for op in run}),
                                sum(ops[op].fwd_ms for op in run))
        return self._facts[key]
