"""Evaluation of one pipeline configuration: Eq. 1 with op-level recompute chosen to fit.

A configuration (:class:`PipeState`) fixes, for every stage, its device type, device
count, tp (dp = devices / tp) and number of layers, plus the pipeline's mbs.  Its cost
for a batch ``B`` (Gbs in phase 1, Lbs in phase 3) is Eq. 1 of the paper:

    min over {tp, dp, ro, l, Mbs} of  sum_j T_j + max_j T_j * (B / Mbs - 1)

with T_j from :meth:`eth.cost.model.CostModel.stage_cost`, plus the pipeline's *own*
data-parallel All-Reduce, i.e. Eq. 5 of the pipeline alone (:meth:`Evaluator.evaluate`):

    ms = Eq. 1 + max_j ( AR_j - sum_{k<j} Tb_k ),   AR_j = Eq. 6 over stage j's dp replicas

(0 when every dp is 1).  This is a deliberate extension of the paper's Eq. 1: without
it the balancer prefers wide-dp stages across slow links whose gradient All-Reduce
then dominates the iteration (found by the brute-force cross-check).  The group's real
AR (more holders, slower links) is never smaller, so Gbs / ms stays a valid throughput
upper bound for early skipping.  The recompute set ``ro`` of a
stage is not searched but derived (:meth:`Evaluator.fit_stage`, paper section 6): if
the stage does not fit in device memory, runs of ops are recomputed in order of the
activation bytes they free per recompute millisecond (high-memory, low-cost first;
:meth:`Evaluator.recompute_order`), each in all of the stage's layers, until the stage
fits; the last run's layer count is then reduced to the smallest number that still fits
(binary search).  A run whose recompute makes the stage's memory grow is skipped: the
backward holds a recomputed run again (``CostModel.remat_bytes``), so an op that joins
runs into a longer one can cost more than it frees.  A stage that does not fit carries
its overflow (bytes over capacity, with the op set found or every op recomputed,
whichever holds less) as a penalty; configurations compare by (overflow, Eq. 1 time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from eth.cost.equations import StageCost, eq1_pipeline_ms, eq6_allreduce_ms
from eth.cost.model import CostModel
from eth.planner.enumerate import tp_groups_in_nodes


@dataclass(frozen=True)
class StageState:
    device_type: str
    ndev: int
    tp: int
    layers: int

    @property
    def dp(self) -> int:
        return self.ndev // self.tp

    def __post_init__(self):
        # the hash is computed once per state: the balancer's and the evaluator's memos
        # hash states over and over (the generated hash built a tuple on every call)
        object.__setattr__(self, "_hash", hash((self.device_type, self.ndev, self.tp, self.layers)))

    def __hash__(self) -> int:
        return self._hash

    def with_layers(self, layers: int) -> "StageState":
        """This stage with ``layers`` layers (``dataclasses.replace`` is slow in the balancer)."""
        return _stage(self.device_type, self.ndev, self.tp, layers)

    def with_tp(self, tp: int) -> "StageState":
        return _stage(self.device_type, self.ndev, tp, self.layers)


def _new(cls, **fields):
    """``cls(**fields)`` for a frozen dataclass without its ``__init__`` (one
    ``object.__setattr__`` per field: half the cost of a balancer move)."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _stage(device_type: str, ndev: int, tp: int, layers: int) -> StageState:
    """``StageState(device_type, ndev, tp, layers)``, fast (:func:`_new`)."""
    return _new(StageState, device_type=device_type, ndev=ndev, tp=tp, layers=layers,
                _hash=hash((device_type, ndev, tp, layers)))


@dataclass(frozen=True)
class PipeState:
    """A pipeline configuration without its derived recompute sets."""

    stages: tuple[StageState, ...]
    mbs: int

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.stages, self.mbs)))   # once, as StageState's

    def __hash__(self) -> int:
        return self._hash

    def layer_ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for s in self.stages:
            out.append((start, start + s.layers))
            start += s.layers
        return out


def pipe_state(stages: tuple[StageState, ...], mbs: int) -> PipeState:
    """``PipeState(stages, mbs)``, fast (:func:`_new`)."""
    return _new(PipeState, stages=stages, mbs=mbs, _hash=hash((stages, mbs)))


@dataclass(frozen=True)
class Evaluation:
    """Cost of a PipeState for one batch."""

    ms: float
    """Eq. 1 time (ms); inf when a stage overflows memory."""
    overflow: float
    """Bytes over capacity summed over stages after maximal recompute (0 = fits)."""
    costs: tuple[StageCost, ...]
    recompute: tuple[tuple[tuple[str, int], ...], ...]
    """Per stage: sorted (op, number of layers) pairs."""

    @property
    def key(self) -> tuple:
        return (self.overflow, self.ms)

    @property
    def feasible(self) -> bool:
        return self.overflow == 0


def _evaluation(ms: float, overflow: float, costs: tuple, recompute: tuple) -> Evaluation:
    """``Evaluation(ms, overflow, costs, recompute)``, fast (:func:`_new`)."""
    return _new(Evaluation, ms=ms, overflow=overflow, costs=costs, recompute=recompute)


class Evaluator:
    """Evaluates PipeStates with a CostModel; memoises recompute fitting.

    ``memo`` (default on; ``SearchOptions.memo``) keeps, per ranks object, every stage's
    (StageCost, recompute, overflow, own All-Reduce) by (position, stage count, type,
    devices, tp, layers, first / last layer held, mbs, in-flight micro-batches), which fixes
    everything :meth:`fit_stage` and :meth:`own_allreduce_ms` read, so an evaluation
    after a balancer move costs one dictionary look-up per unchanged stage; the
    balancer's layer re-splits are memoised too.  Off, every evaluation goes through
    :meth:`fit_stage` per stage (the results are the same)."""

    def __init__(self, cost: CostModel, memo: bool = True):
        self.cost = cost
        self.memo = memo
        self._stages: dict = {}
        self._splits: dict = {}
        self.model = cost.model
        self._fit: dict = {}
        self._order: dict = {}
        self._saved: dict = {}
        self._links: dict = {}
        self._tps: dict = {}
        self.ranks_memo: dict = {}
        self._floors: dict = {}    # eth.planner.bounds.stage_group_floor's per-stage rows
        self._entries: dict = {}   # _stage_entry's results by the stage, its links and All-Reduce bandwidth
        self.evaluations = 0

    def valid_tps(self, device_type: str, ndev: int, ranks=None) -> tuple[int, ...]:
        """tp degrees for a stage: divide ndev, fit in one node, split the model, profiled.

        With the stage's ``ranks``, only tps whose groups (``ranks[k*tp:(k+1)*tp]``) each
        lie inside one node."""
        key = (device_type, ndev)
        if key not in self._tps:
            per_node = min(g.devices_per_node for g in self.cost.cluster.nodes if g.type == device_type)
            profiled = set(self.cost.profiles.get(device_type).tps(self.model))
            ok = []
            for tp in sorted(profiled):
                if ndev % tp == 0 and tp <= per_node and self.model.splits(tp):
                    ok.append(tp)
            self._tps[key] = tuple(ok)
        if not ranks:
            return self._tps[key]
        rkey = (key, tuple(ranks))
        if rkey not in self._tps:
            self._tps[rkey] = tuple(tp for tp in self._tps[key]
                                    if tp_groups_in_nodes(self.cost.cluster, list(ranks), tp))
        return self._tps[rkey]

    def recompute_order(self, device_type: str, micro: int, tp: int) -> list[tuple[str, ...]]:
        """Runs of layer ops in the order recompute takes them (each run whole): greedily,
        the contiguous run of ops not taken yet that frees the most bytes per recompute ms
        together with those taken (``eth.cost.activations.LayerKeep``: what a run frees
        depends on its neighbours -- softmax alone frees nothing, since its input, the
        scores, must then be kept; with score it frees the scores too), ties to the
        earliest, then shortest run; ops that free nothing in any run are left out.  With
        additive savings (every op frees its own bytes) these are single ops by bytes per
        ms, equal ratios in layer order."""
        key = (device_type, micro, tp)
        if key not in self._order:
            ops, _ = self.cost.profiles.layer_costs(device_type, self.model, micro, tp)
            self._order[key] = _greedy_runs(self.cost.layer_keep(ops), ops)
        return self._order[key]

    def fit_stage(self, st: StageState, layers: tuple[int, int], mbs: int, j: int, num_stages: int,
                  nmb: int, ranks, next_ranks, prev_ranks=None, links=None):
        """(StageCost, recompute pairs, overflow bytes) with the least recompute that fits.

        ``links``: ``CostModel.stage_links`` of these ranks when the caller has them."""
        # the result depends on the stage's position only through its in-flight
        # micro-batches and on its ranks only through the links they cross
        first, last = layers[0] == 0, layers[1] == self.model.num_layers
        inflight = max(1, min(num_stages - j, nmb))
        if links is None:
            links = self.cost.stage_links(st.device_type, st.tp, ranks, next_ranks, prev_ranks)
        key = (st.device_type, st.ndev, st.tp, st.layers, first, last, mbs, inflight) + links
        hit = self._fit.get(key)
        if hit is not None:
            return hit

        def cost(rec):
            rec = {op: n for op, n in (rec or {}).items() if n > 0}
            return self.cost.stage_cost_at(st.device_type, st.tp, st.dp, layers[1] - layers[0], first, last,
                                           mbs, rec, inflight, links)

        c = cost(None)
        result = (c, (), 0.0)
        if not c.fits:
            # memory = fixed + inflight * max(act - saved(recompute), 0) + remat(recompute)
            # (CostModel.remat_bytes: a recomputed run held again in the backward);
            # search the recompute set on that formula, then cost the chosen set once.
            okey = ("ops", st.device_type, mbs // st.dp, st.tp)
            ops = self._order.get(okey)
            if ops is None:
                ops = self._order[okey] = self.cost.profiles.layer_costs(st.device_type, self.model,
                                                                         mbs // st.dp, st.tp)[0]
            fixed = c.memory_bytes - c.inflight * c.act_bytes
            room = c.capacity_bytes - fixed

            nl = layers[1] - layers[0]
            skey = (st.device_type, mbs // st.dp, st.tp, nl)

            def held(rec, sk):
                # bytes above ``fixed``; rec = the order's first k ops but the skipped
                # ones in all nl layers and op (the k-th) in rec[op] layers, so they
                # depend on (shape, skipped, k, rec[op]) only: ``sk``
                saved = self._saved.get(sk)
                if saved is None:
                    saved = self._saved[sk] = (self.cost.recompute_savings(ops, rec),
                                               self.cost.remat_bytes(ops, rec, nl))
                return c.inflight * max(c.act_bytes - saved[0], 0.0) + saved[1]

            chosen: dict[str, int] = {}
            found, skipped, best = False, 0, c.inflight * c.act_bytes
            runs = self.recompute_order(st.device_type, mbs // st.dp, st.tp)
            order = [op for run in runs for op in run]
            if room >= 0:
                for k, run in enumerate(runs):
                    chosen.update((op, nl) for op in run)
                    now = held(chosen, skey + (skipped, k, nl))
                    if now <= room:
                        lo, hi = 0, nl
                        while hi - lo > 1:
                            mid = (lo + hi) // 2
                            chosen.update((op, mid) for op in run)
                            if held(chosen, skey + (skipped, k, mid)) <= room:
                                hi = mid
                            else:
                                lo = mid
                        chosen.update((op, hi) for op in run)
                        found = True
                        break
                    if now > best:   # joined runs the backward holds again: worse, skip them
                        for op in run:
                            del chosen[op]
                        skipped |= 1 << k
                    else:
                        best = now
            if not found:   # every op, or the set found if it holds less; then drop the
                # ops whose recompute joins runs into longer ones than it frees, last first
                every = {op: nl for op in order}
                now = held(every, skey + ("every",))
                if chosen and best <= now:
                    now = best
                else:
                    chosen = every
                for op in reversed(order):
                    if op in chosen and now > room:
                        trial = {o: n for o, n in chosen.items() if o != op}
                        less = held(trial, skey + (tuple(trial),))
                        if less < now:
                            chosen, now = trial, less
            c = cost(chosen)
            result = (c, tuple(sorted(chosen.items())), max(c.memory_bytes - c.capacity_bytes, 0.0))
        self._fit[key] = result
        return result

    def evaluate(self, state: PipeState, batch: int, ranks) -> Evaluation:
        """Eq. 1 for ``batch`` samples; ``ranks[j]`` are representative ranks of stage j."""
        self.evaluations += 1
        if not self.memo:
            return self._evaluate_plain(state, batch, ranks)
        stages, mbs = state.stages, state.mbs
        S = len(stages)
        nmb = max(1, math.ceil(batch / mbs))
        # per-stage results memoised per ranks object; the entry keeps ranks alive
        memo = self._stages.get(id(ranks))
        if memo is None or memo[0] is not ranks:
            memo = self._stages[id(ranks)] = (ranks, {})
        memo = memo[1]
        hits, start, overflow, L = [], 0, 0.0, self.model.num_layers
        total, top, shared = 0, 0.0, False
        get = memo.get
        for j, st in enumerate(stages):
            # len(ranks) == S; the position enters through j, the first/last flags and
            # the in-flight micro-batches (min(S - j, nmb), both >= 1) only
            n = st.layers
            key = (j, st.device_type, st.ndev, st.tp, n, start == 0, start + n == L, mbs,
                   S - j if S - j < nmb else nmb)
            hit = get(key)
            if hit is None:
                hit = memo[key] = self._stage_entry(st, (start, start + n), mbs, j, S, nmb, ranks, memo)
            hits.append(hit)
            overflow += hit[2]
            t = hit[4]
            total += t          # in stage order from 0, as sum() adds
            if t > top:
                top = t
            if hit[3] is not None:
                shared = True
            start += n
        costs = tuple([h[0] for h in hits])
        recs = tuple([h[1] for h in hits])
        if overflow:
            return _evaluation(math.inf, overflow, costs, recs)
        ms = total + top * (batch / mbs - 1)   # eq1_pipeline_ms
        extra, head_bwd = 0.0, 0.0
        if shared:          # its own All-Reduce (dp > 1) and optimizer step after the stages before it
            for c, _, _, after, _ in hits:
                if after is not None:
                    extra = max(extra, after - head_bwd)
                head_bwd += c.bwd_ms
        return _evaluation(ms + extra, overflow, costs, recs)

    def _stage_entry(self, st: StageState, rng: tuple[int, int], mbs: int, j: int, S: int, nmb: int, ranks,
                     memo=None):
        """(StageCost, recompute, overflow, what follows its last backward: own All-Reduce
        (dp > 1) + optimizer step, ms, or None when both are 0, total ms).

        ``memo``: the per-ranks dictionary of :meth:`evaluate`, which also keeps stage j's
        links by (type, tp) and the bandwidth of its own All-Reduce.  The entry depends on
        the ranks only through those two, so it is also kept by them and the stage's
        fields (:attr:`_entries`): a stage group's stages met on other ranks objects with
        the same links (other stage groups of the pipeline, other pipelines) are found
        there."""
        nxt, prv = ranks[j + 1] if j + 1 < S else None, ranks[j - 1] if j > 0 else None
        lkey = ("links", j, st.device_type, st.tp)
        links = memo.get(lkey) if memo is not None else None
        if links is None:
            links = self.cost.stage_links(st.device_type, st.tp, ranks[j], nxt, prv)
            if memo is not None:
                memo[lkey] = links
        gbps = None
        if st.ndev > st.tp:
            gbps = memo.get(("gbps", j)) if memo is not None else None
            if gbps is None:
                gbps = self._ar_gbps(st, ranks[j])
                if memo is not None:
                    memo[("gbps", j)] = gbps
        first, last = rng[0] == 0, rng[1] == self.model.num_layers
        ekey = (st.device_type, st.ndev, st.tp, st.layers, first, last, mbs, S - j if S - j < nmb else nmb,
                gbps) + links
        hit = self._entries.get(ekey)
        if hit is None:
            c, rec, over = self.fit_stage(st, rng, mbs, j, S, nmb, ranks[j], nxt, prv, links)
            after = (self._allreduce_at(st, first, last, gbps) if gbps is not None else 0.0) + \
                self._optimizer_ms(st, rng, mbs, c)
            hit = self._entries[ekey] = (c, rec, over, after if after > 0 else None, c.total_ms)
        return hit

    def _evaluate_plain(self, state: PipeState, batch: int, ranks) -> Evaluation:
        """:meth:`evaluate` without the per-stage memo (``memo`` off)."""
        S = len(state.stages)
        nmb = max(1, math.ceil(batch / state.mbs))
        ranges = state.layer_ranges()
        # links of stage j by (j, type, tp), memoised per ranks object (the balancer
        # evaluates thousands of states on the same ranks); the entry keeps ranks alive
        memo = self._links.get(id(ranks))
        if memo is None or memo[0] is not ranks:
            memo = self._links[id(ranks)] = (ranks, {})
        memo = memo[1]
        costs, recs, overflow = [], [], 0.0
        for j, (st, rng) in enumerate(zip(state.stages, ranges)):
            lkey = (j, S, st.device_type, st.tp)
            links = memo.get(lkey)
            nxt, prv = ranks[j + 1] if j + 1 < S else None, ranks[j - 1] if j > 0 else None
            if links is None:
                links = memo[lkey] = self.cost.stage_links(st.device_type, st.tp, ranks[j], nxt, prv)
            c, rec, over = self.fit_stage(st, rng, state.mbs, j, S, nmb, ranks[j], nxt, prv, links)
            costs.append(c)
            recs.append(rec)
            overflow += over
        if overflow:
            return Evaluation(math.inf, overflow, tuple(costs), tuple(recs))
        ms = eq1_pipeline_ms(costs, batch, state.mbs)
        extra, head_bwd = 0.0, 0.0
        for j, (st, rng) in enumerate(zip(state.stages, ranges)):
            after = (self.own_allreduce_ms(st, rng, ranks[j]) if st.dp > 1 else 0.0) + \
                self._optimizer_ms(st, rng, state.mbs, costs[j])
            if after > 0:
                extra = max(extra, after - head_bwd)
            head_bwd += costs[j].bwd_ms
        return Evaluation(ms + extra, overflow, tuple(costs), tuple(recs))

    def tails(self, state: PipeState, costs, ar_row) -> list[float]:
        """What follows each stage's last backward in Eq. 5's lines
        (:func:`eth.planner.allocate.pipeline_line`): AR_i^j and the optimizer step."""
        return [a + self._optimizer_ms(st, rng, state.mbs, c)
                for a, st, rng, c in zip(ar_row, state.stages, state.layer_ranges(), costs)]

    def _optimizer_ms(self, st: StageState, layers: tuple[int, int], mbs: int, cost: StageCost) -> float:
        """The stage's optimizer step after its backward (:meth:`CostModel.optimizer_ms`)."""
        where = SimpleNamespace(device_type=st.device_type, tp=st.tp, dp=st.dp, layers=layers)
        return self.cost.optimizer_ms(mbs, where, cost.params)

    def own_allreduce_ms(self, st: StageState, layers: tuple[int, int], ranks) -> float:
        """Eq. 6 for a stage's gradients over its own dp replicas (as CostModel does per block)."""
        first, last = layers[0] == 0, layers[1] == self.model.num_layers
        key = ("own ar", st, first, last, tuple(ranks) if ranks else None)
        hit = self._fit.get(key)
        if hit is None:
            hit = self._fit[key] = self._allreduce_at(st, first, last, self._ar_gbps(st, ranks))
        return hit

    def _ar_gbps(self, st: StageState, ranks) -> float:
        """The link of a stage's own All-Reduce: the slowest among its ``ranks`` (without
        ranks: the intra-node link)."""
        return (self.cost.cluster.link_gbps(list(ranks)) if ranks else
                self.cost.cluster.intra_node_gbps or self.cost.cluster.types[st.device_type].link_gbps)

    def _allreduce_at(self, st: StageState, first: bool, last: bool, gbps: float) -> float:
        """:meth:`own_allreduce_ms` of a stage holding the embedding (``first``) and the
        head (``last``) or not, over a link of ``gbps``."""
        key = ("ar", st, first, last, gbps)
        hit = self._fit.get(key)
        if hit is None:
            m = self.model
            params = st.layers * m.params_per_layer()
            if first:
                params += m.vocab * m.hidden + m.seq_len * m.hidden
            if last:
                params += m.vocab * m.hidden + 2 * m.hidden
            hit = self._fit[key] = eq6_allreduce_ms(params / st.tp * self.cost.grad_bytes, st.dp, gbps)
        return hit

    def layer_ms(self, st: StageState, mbs: int) -> float:
        """Time of one middle layer of a stage (no boundary ops), for layer splitting."""
        key = ("layer", st.device_type, st.tp, st.dp, mbs)
        hit = self._fit.get(key)
        if hit is None:
            c = self.cost.stage_cost(st.device_type, st.tp, st.dp,
                                     (1, 2) if self.model.num_layers > 2 else (0, 1), mbs)
            hit = self._fit[key] = max(c.total_ms, 1e-9)
        return hit


def _greedy_runs(keep, ops) -> list[tuple[str, ...]]:
    """:meth:`Evaluator.recompute_order` of the layer ``keep`` (op costs ``ops``)."""
    members, freed = keep.freed_all()
    order, k = keep.order, len(keep.order)
    ms = [max(ops[op].fwd_ms, 1e-9) for op in order]
    taken, mask, out = [False] * k, 0, []
    while True:
        best = None
        for i in range(k):
            seg, spent = 0, 0.0
            for j in range(i, k):
                if taken[j]:
                    break
                seg |= 1 << j
                spent += ms[j]
                gain = freed[mask | seg] - freed[mask]
                if gain > 0 and (best is None or gain / spent > best[0] * (1 + 1e-12)):
                    best = (gain / spent, i, j, seg)
        if best is None:
            return out
        _, i, j, seg = best
        out.append(order[i:j + 1])
        mask |= seg
        taken[i:j + 1] = [True] * (j + 1 - i)
