"""What one layer keeps for its backward under a recompute set, tensor by tensor.

A layer op keeps named tensors (:func:`eth.spec.model.layer_dataflow`: a GEMM its input,
softmax its output, ...) and bytes of its own (dropout masks, norm statistics, a fused
kernel's copies).  A tensor kept by two ops is held once (the fused qkv output, kept by
score and context through views of one storage; the attention probabilities, kept by
softmax and by context when attn-dropout is the identity), and an op's act_bytes counts
it only in the first op that keeps it (as ``tools/profile_ops.py`` measures: the ops'
act_bytes sum to what a layer keeps), so an op's own bytes are its act_bytes less the
named tensors it counts.

The runtime checkpoints each maximal run of consecutive recomputed ops as one callable
(``torch.utils.checkpoint``): the run keeps its inputs (the tensors its ops read that
were made before the run) and nothing its ops would keep; a run none of whose ops keeps
anything (rotary, a residual add without dropout) keeps nothing at all, its inputs
included (torch's checkpoint holds them only for the tensors its ops save).  With the recomputed ops R a
layer therefore keeps

    the own bytes of every op not in R
    + every named tensor that an op not in R keeps or that is the input of a run of R,

each named tensor once, and frees the rest of what it keeps without recompute.  A run
whose input another op keeps anyway costs nothing to keep (attn-dropout + context
recomputed after softmax keep softmax's output, which softmax keeps already), and a run
may free less than nothing (post-attn-dropout alone keeps the attention output, which
only its mask replaced).  The sizes: an op's output_bytes for its output, the first op's
input_bytes for the layer input.
"""
from __future__ import annotations

import numpy as np

from eth.spec.model import recompute_runs


class LayerKeep:
    """The bytes one layer keeps for backward (module docstring), for the layer ops
    ``ops`` (name -> op cost with act/input/output bytes) of the dataflow ``flow``;
    ``held``: only those ops of the layer (a stage that starts or ends inside it), whose
    tensors made before the part are read like the layer input."""

    def __init__(self, flow, ops, held=None):
        self.size = {f.output: float(ops[f.name].output_bytes) for f in flow}
        self.size["x"] = float(ops[flow[0].name].input_bytes)
        first_keeper: dict[str, str] = {}
        for f in flow:
            for t in f.saves:
                first_keeper.setdefault(t, f.name)
        own = {f.name: float(ops[f.name].act_bytes) - sum(self.size[t] for t in f.saves
                                                          if first_keeper[t] == f.name)
               for f in flow}
        if held is not None:
            flow = tuple(f for f in flow if f.name in held)
            first_keeper = {t: op for t, op in first_keeper.items() if any(t in f.saves for f in flow)}
        self.order = tuple(f.name for f in flow)
        self.flow = {f.name: f for f in flow}
        self.own = {f.name: own[f.name] for f in flow}
        self.total = float(sum(ops[op].act_bytes for op in self.order))
        self._keeps = {f.name: bool(f.saves) or self.own[f.name] > 0 for f in flow}
        self._memo: dict = {}
        # every (tensor, reader, its maker: the last op before the reader that outputs it;
        # None for "x"): attn-dropout at dropout 0 passes "probs" on as its own output
        self._reads = []
        for j, f in enumerate(flow):
            for t in f.inputs:
                makers = [i for i in range(j) if flow[i].output == t]
                self._reads.append((t, j, makers[-1] if makers else None))
        self._keepers = {t: [self.order.index(op) for op, fl in self.flow.items() if t in fl.saves]
                         for t in first_keeper}
        if held is not None:   # what the part keeps without recompute, each tensor once
            self.total = self.kept(())

    # ------------------------------------------------------------------ one set
    def named_kept(self, recomputed) -> frozenset[str]:
        """The named tensors kept with the ops ``recomputed``: kept by an op not in it, or
        read by a run of it from outside the run (memoised per set)."""
        key = frozenset(recomputed)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = frozenset(self._named_kept(key))
        return hit

    def _named_kept(self, recomputed) -> set[str]:
        kept = {t for op, f in self.flow.items() if op not in recomputed for t in f.saves}
        for run in recompute_runs(set(recomputed), self.order):
            if not any(self._keeps[op] for op in run):
                continue
            made = set()
            for op in run:
                kept.update(t for t in self.flow[op].inputs if t not in made)
                made.add(self.flow[op].output)
        return kept

    def kept(self, recomputed) -> float:
        """Bytes the layer keeps for backward with the ops ``recomputed``."""
        own = sum(b for op, b in self.own.items() if op not in recomputed)
        return own + sum(self.size[t] for t in self.named_kept(recomputed))

    def freed(self, recomputed) -> float:
        """Bytes recomputing ``recomputed`` frees (negative when it keeps more)."""
        return self.total - self.kept(recomputed) if recomputed else 0.0

    def rematerialised(self, run, recomputed) -> float:
        """Bytes the backward holds again while it re-runs ``run`` (one run of the set
        ``recomputed``): what its ops keep that the layer does not keep anyway."""
        kept = self.named_kept(recomputed)
        again = {t for op in run for t in self.flow[op].saves if t not in kept}
        return max(sum(self.own[op] for op in run) + sum(self.size[t] for t in again), 0.0)

    # ------------------------------------------------------------------ every set
    def freed_all(self) -> tuple[np.ndarray, np.ndarray]:
        """(members, freed): for every subset R of the layer ops (row m: bit i of m is
        op i of the layer order) its 0 / 1 membership row and :meth:`freed` (R), in numpy.
        Which tensors each R keeps depends on the dataflow alone (:func:`_kept_masks`,
        memoised); the bytes are this layer's."""
        key = (self.order, tuple((t, tuple(k)) for t, k in self._keepers.items()),
               tuple(self._keeps[op] for op in self.order), tuple(self._reads))
        bits, members, named = _kept_masks(*key)
        own = np.array([self.own[op] for op in self.order])
        kept = (~bits) @ own + sum(self.size[t] * v for t, v in named)
        freed = kept.copy()
        freed[1:] = self.total - kept[1:]
        freed[0] = 0.0
        return members, freed


_MASKS: dict = {}


def _kept_masks(order, keepers, keeps, reads):
    """(bits, members, ((tensor, kept), ...)) of :meth:`LayerKeep.freed_all` for a layer
    of the ops ``order``: for every subset R (row m: bit i of m is op i) its boolean and
    0 / 1 membership rows, and for each named tensor whether R keeps it (``keepers``: the
    positions of the ops that keep it; ``keeps``: whether each op keeps anything;
    ``reads``: (tensor, reader position, its maker's position or None)).  Memoised: the
    profiles of every device type, tp and micro-batch share one dataflow."""
    key = (order, keepers, keeps, reads)
    hit = _MASKS.get(key)
    if hit is not None:
        return hit
    k = len(order)
    masks = np.arange(1 << k)
    bits = ((masks[:, None] >> np.arange(k)) & 1).astype(bool)
    kept_t: dict[str, np.ndarray] = {}
    for t, pos in keepers:
        kept_t[t] = ~bits[:, list(pos)].all(axis=1)
    # the run of each recomputed op keeps something (else torch's checkpoint keeps
    # nothing, its inputs included): an op of the run up to it, or from it on, does
    before = np.zeros((len(masks), k), bool)
    after = np.zeros((len(masks), k), bool)
    for i in range(k):
        prev = before[:, i - 1] if i else np.zeros(len(masks), bool)
        before[:, i] = bits[:, i] & (prev | keeps[i])
    for i in reversed(range(k)):
        nxt = after[:, i + 1] if i + 1 < k else np.zeros(len(masks), bool)
        after[:, i] = bits[:, i] & (nxt | keeps[i])
    run_keeps = before | after
    for t, j, start in reads:
        # read from outside its run: the reader recomputed, and the maker not, or an op
        # between them not (then the reader's run starts after the maker)
        inside = bits[:, start:j + 1].all(axis=1) if start is not None else np.zeros(len(masks), bool)
        outside = run_keeps[:, j] & ~inside
        kept_t[t] = kept_t.get(t, np.zeros(len(masks), bool)) | outside
    hit = _MASKS[key] = (bits, bits.astype(float), tuple(kept_t.items()))
    return hit
