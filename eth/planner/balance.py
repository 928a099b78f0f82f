"""Stage balancer: Aceso-style bottleneck alleviation for one stage device group.

Objective (Eq. 1, batch B = Gbs in phase 1, Lbs in phase 3), see
:mod:`eth.planner.evaluate`:

    min over {tp, dp, ro, l, Mbs}   sum_j T_j + max_j T_j * (B / Mbs - 1)
    subject to  tp_j * dp_j = devices of stage j,  Mbs mod dp_j = 0,
                sum_j l_j = L, l_j >= 1, memory of every device <= capacity.

:func:`warm_start` starts from the configuration the stage group's floor describes
(:func:`eth.planner.bounds.floor_configuration`: the Mbs, layer split and tps at which
the lower bound of every configuration's Eq. 1 is least), which the stage times
nearly reach; where it has none in the planner's space (Mbs = lcm of the dps x a power
of two), from :func:`initial_state`: a compute-proportional layer split (layers
inversely proportional to the measured per-layer time of each stage), the smallest tp
whose weight shard fits comfortably, and mbs = lcm of the dp degrees (trying 1x, 2x and
4x of it; 4x only when 2x beat 1x).  Mbs always divides the batch B (a pipeline trains
on whole micro-batches); a stage group whose dp degrees admit no such mbs is skipped for
that batch.

:func:`balance` then repeats: take the bottleneck stage (a memory-infeasible stage
first, else the largest T_j; if nothing helps it, the runner-up) and evaluate the
primitives

  * move 1 (or a quarter of the) layers to the previous / next stage,
  * tp <-> dp exchange (tp x2 / dp /2 and tp /2 / dp x2; tp * dp stays the stage's
    devices), also combined with mbs x2 when the new dp needs it,
  * mbs x2 / mbs /2 (mbs stays divisible by every stage's dp and divides B),
  * re-split all layers in proportion to the current per-layer speed,
  * when none of these improves: joint tp moves of a whole type (:func:`joint_moves`)
    and one layer from a bottleneck to the least-loaded distant stage of each type
    (:func:`far_moves`),

with recompute re-derived for every candidate (least op-level recompute that fits).
The best improving candidate is taken; the loop stops when nothing improves or the
evaluation budget is spent.  The budget is set per stage group by
:func:`eth.planner.pipeline.adaptive_budgets` (section 6).
"""
from __future__ import annotations

import math

from eth.planner.bounds import floor_configuration
from eth.planner.evaluate import Evaluation, Evaluator, PipeState, StageState, pipe_state


def split_layers(num_layers: int, weights: list[float]) -> list[int]:
    """Split ``num_layers`` in proportion to ``weights`` (largest remainder, >= 1 each)."""
    n = len(weights)
    if n > num_layers:
        raise ValueError(f"{n} stages for {num_layers} layers")
    total = sum(weights)
    spare = num_layers - n
    raw = [spare * w / total for w in weights]
    counts = [1 + int(r) for r in raw]
    rest = num_layers - sum(counts)
    order = sorted(range(n), key=lambda i: (-(raw[i] - int(raw[i])), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def resplit(ev: Evaluator, state: PipeState) -> PipeState:
    """Layers inversely proportional to each stage's per-layer time at its tp/dp/mbs."""
    key = None
    if getattr(ev, "memo", False):      # the re-split state itself (immutable) by what it reads
        key = (state.mbs,) + tuple((s.device_type, s.ndev, s.tp) for s in state.stages)
        hit = ev._splits.get(key)
        if hit is not None:
            return hit
    speeds = [1.0 / ev.layer_ms(s, state.mbs) for s in state.stages]
    counts = split_layers(ev.model.num_layers, speeds)
    out = pipe_state(tuple(s.with_layers(c) for s, c in zip(state.stages, counts)), state.mbs)
    if key is not None:
        ev._splits[key] = out
    return out


def _lcm(values) -> int:
    return math.lcm(*values)


def initial_state(ev: Evaluator, stages, batch: int, ranks) -> tuple[PipeState, Evaluation] | None:
    """Warm start for stage device group ``stages`` ((type, devices), ...).

    tp per stage: the smallest whose weight shard takes at most half the memory; when
    no mbs = lcm(dp) x {1, 2, 4} divides ``batch`` (a small batch), the tp of the
    widest-dp stage is raised until one does.  The largest tp of every stage (the
    smallest dp and Mbs, the most micro-batches, no dp All-Reduce) is tried too, and the
    better start is kept (measured: GPT-3 13B at gbs 4 429 -> 344 ms unseeded; at gbs 1024
    21913.4 -> 21886.7 ms).  Layers: inversely proportional to each stage's per-layer time.

    None if a stage has no valid tp or no such mbs divides ``batch``.
    """
    model = ev.model
    L = model.num_layers
    share = L / len(stages)
    layer_bytes = model.params_per_layer() * ev.cost.bytes_per_param
    chosen, widest = [], []
    for j, (t, n) in enumerate(stages):
        tps = ev.valid_tps(t, n, ranks[j] if ranks else None)
        if not tps:
            return None
        cap = ev.cost.cluster.types[t].memory_bytes
        tp = next((x for x in tps if layer_bytes * share / x <= 0.5 * cap), tps[-1])
        chosen.append(StageState(t, n, tp, 1))
        widest.append(StageState(t, n, tps[-1], 1))
    # a small batch may admit no mbs = lcm(dp) x {1, 2, 4}: then raise the tp of the
    # widest-dp stage (dp falls) until one divides the batch (or no tp is left)
    while not any(batch % (_lcm(s.dp for s in chosen) * m) == 0 for m in (1, 2, 4)):
        j = max(range(len(chosen)), key=lambda k: (chosen[k].dp, -k))
        st = chosen[j]
        tps = ev.valid_tps(st.device_type, st.ndev, ranks[j] if ranks else None)
        higher = [x for x in tps if x > st.tp]
        if not higher or st.dp == 1:
            return None
        chosen[j] = st.with_tp(higher[0])
    best = _best_mbs(ev, chosen, batch, ranks)
    if best is not None and widest != chosen:
        other = _best_mbs(ev, widest, batch, ranks)
        if other is not None and other[1].key < best[1].key:
            best = other
    return best


def warm_start(ev: Evaluator, stages, batch: int, ranks) -> tuple[PipeState, Evaluation] | None:
    """The start of the balancer for stage device group ``stages`` in phase 1 (and in the
    metis-strong baseline): the configuration its floor describes
    (:func:`eth.planner.bounds.floor_configuration`), evaluated; where the floor describes
    none in the planner's space, :func:`initial_state`.  From near the floor the balancer
    has few moves left: the unseeded search of GPT-3 13B on mixed3-96 (gbs 1024) spends
    15,600 cost evaluations instead of 55,641 with :func:`initial_state` alone, for the
    same plan."""
    got = floor_configuration(ev, stages, ranks, batch)
    if got is None:
        return initial_state(ev, stages, batch, ranks)
    mbs, parts = got
    state = pipe_state(tuple(StageState(t, n, tp, layers) for (t, n), (tp, layers) in zip(stages, parts)), mbs)
    return state, ev.evaluate(state, batch, ranks)


def _best_mbs(ev: Evaluator, chosen, batch: int, ranks):
    """Best of mbs = lcm(dp) x {1, 2, 4} dividing ``batch``, layers re-split for each;
    4x is not tried when 2x was no better than 1x (the warm starts are a third of phase
    1's CPU time, their fresh layouts missing the stage-cost memo; on the seeded suite of
    test_search_core.py and GPT-3 13B / b2b4-64 at gbs 4-1024 and 175B / 1024 the plans
    were the same without those evaluations)."""
    base = _lcm(s.dp for s in chosen)
    best = None
    for mult in (1, 2, 4):
        mbs = base * mult
        if batch % mbs:
            continue
        state = resplit(ev, PipeState(tuple(chosen), mbs))
        e = ev.evaluate(state, batch, ranks)
        if best is not None and e.key >= best[1].key:
            break   # a doubled mbs that did not help: the next doubling is not tried
        best = (state, e)
    return best


def neighbours(ev: Evaluator, state: PipeState, j: int, batch: int, ranks=None) -> list[PipeState]:
    """Primitive moves that may relieve stage ``j`` (``ranks``: per-stage ranks; tps whose
    groups would cross nodes on them are not tried)."""
    out = []
    stages = list(state.stages)
    st = stages[j]
    # move layers to a neighbour
    if st.layers > 1:
        for k in sorted({1, max(1, st.layers // 4)}):
            for nb in (j - 1, j + 1):
                if 0 <= nb < len(stages):
                    new = list(stages)
                    new[j] = st.with_layers(st.layers - k)
                    new[nb] = stages[nb].with_layers(stages[nb].layers + k)
                    out.append(pipe_state(tuple(new), state.mbs))
    # tp <-> dp exchange
    tps = ev.valid_tps(st.device_type, st.ndev, ranks[j] if ranks else None)
    for tp in (st.tp * 2, st.tp // 2):
        if tp in tps:
            new = list(stages)
            new[j] = st.with_tp(tp)
            dp = st.ndev // tp
            if state.mbs % dp == 0:
                out.append(pipe_state(tuple(new), state.mbs))
            else:
                mbs = _lcm([state.mbs, dp])
                if batch % mbs == 0:
                    out.append(pipe_state(tuple(new), mbs))
    # micro-batch size
    if batch % (state.mbs * 2) == 0:
        out.append(pipe_state(state.stages, state.mbs * 2))
    half = state.mbs // 2
    if half >= 1 and state.mbs % 2 == 0 and all(half % s.dp == 0 for s in stages):
        out.append(pipe_state(state.stages, half))
    # few micro-batches (B / Mbs < 2 S): tp x2 or /2 on every stage of the bottleneck's
    # type, or on every stage, at once, with the Mbs the new dps allow (a smaller Mbs
    # needs every stage's dp to shrink, which single-stage exchanges cannot reach one
    # step at a time)
    if batch < 2 * len(stages) * state.mbs:
        out += _type_wide(ev, state, st.device_type, batch, ranks)
        if len({s.device_type for s in stages}) > 1:
            out += _type_wide(ev, state, None, batch, ranks)
    # re-split layers by current speed
    out.append(resplit(ev, state))
    return out


def _type_wide(ev: Evaluator, state: PipeState, device_type, batch: int, ranks) -> list[PipeState]:
    """tp x2 (and, separately, /2) on every stage of ``device_type`` (None: every stage)."""
    out = []
    for up in (True, False):
        new = list(state.stages)
        for k, s in enumerate(new):
            if device_type is not None and s.device_type != device_type:
                continue
            tps = ev.valid_tps(s.device_type, s.ndev, ranks[k] if ranks else None)
            tp = s.tp * 2 if up else s.tp // 2
            if tp not in tps:
                break
            new[k] = s.with_tp(tp)
        else:
            base = _lcm(x.dp for x in new)
            for mbs in sorted({state.mbs, state.mbs // 2, base}):
                if mbs >= 1 and mbs % base == 0 and batch % mbs == 0:
                    out.append(pipe_state(tuple(new), mbs))
    return out


def balance(ev: Evaluator, state: PipeState, batch: int, ranks, budget: int,
            current: Evaluation | None = None, stop=None) -> tuple[PipeState, Evaluation, int]:
    """Bottleneck alleviation from ``state``; returns (state, evaluation, evaluations spent).

    ``stop()`` (optional) is polled before every round; when it returns true the best
    state so far is returned (the search's time limit)."""
    memo: dict = {}

    def cost(s):
        e = memo.get(s)
        if e is None:
            e = memo[s] = ev.evaluate(s, batch, ranks)
        return e

    cur = current or cost(state)
    memo[state] = cur
    spent = 1

    def best_of(cands):
        """The best (state, evaluation) of ``cands`` if it improves on ``cur``, else None."""
        nonlocal spent
        best = None
        for cand in cands:
            e = memo.get(cand)
            if e is None:
                e = memo[cand] = ev.evaluate(cand, batch, ranks)
                spent += 1
            if best is None or e.key < best[1].key:
                best = (cand, e)
        if best is not None and best[1].key < cur.key and (
                best[1].overflow < cur.overflow or best[1].ms < cur.ms * (1 - 1e-9)):
            return best
        return None

    while spent < budget and not (stop is not None and stop()):
        order = sorted(range(len(state.stages)),
                       key=lambda j: (-(cur.costs[j].memory_bytes > cur.costs[j].capacity_bytes),
                                      -cur.costs[j].total_ms, j))
        best = None
        for j in order[:2]:
            best = best_of(neighbours(ev, state, j, batch, ranks))
            if best is not None or spent >= budget:
                break
        if best is None and spent < budget:
            # stuck: the joint moves of every stage of a type (or of every stage)
            # or a layer moved from a bottleneck stage to a far, lightly loaded one
            best = best_of(joint_moves(ev, state, batch, ranks) + far_moves(state, cur, order[:2]))
        if best is None:
            break
        state, cur = best
    return state, cur, spent


def far_moves(state: PipeState, cur: Evaluation, sources) -> list[PipeState]:
    """One layer from each stage j of ``sources`` (the bottlenecks) to the least-loaded
    stage i (smallest T_i) of each device type that is neither j nor its neighbour,
    tried by :func:`balance` when no single-stage move improves.  A bottleneck amid
    equally loaded stages cannot hand a layer to a neighbour without making it the new
    bottleneck, while stages further along, often of another type, still have slack
    (measured: GPT-3 175B, 8 A100 then 8 RTX3090 stages of tp 8, gbs 1024: phase 1
    stopped at 8 layers on the A100 stages and 4 with full-layer recompute on the
    RTX3090 stages, 227 ms per micro-batch at the bottleneck against 141 ms on the A100
    stages).  A move is left out when T_i (l_i + 1) / l_i, the target's time with one
    more layer at its present per-layer time, is not below T_j: it could not lower the
    bottleneck."""
    stages, costs = state.stages, cur.costs
    out = []
    for j in sources:
        if stages[j].layers <= 1:
            continue
        targets: dict = {}
        for i, s in enumerate(stages):
            if abs(i - j) > 1:
                t = targets.get(s.device_type)
                if t is None or costs[i].total_ms < costs[t].total_ms:
                    targets[s.device_type] = i
        for i in sorted(targets.values()):
            if costs[i].total_ms * (stages[i].layers + 1) / stages[i].layers >= costs[j].total_ms:
                continue
            new = list(stages)
            new[j] = stages[j].with_layers(stages[j].layers - 1)
            new[i] = stages[i].with_layers(stages[i].layers + 1)
            out.append(pipe_state(tuple(new), state.mbs))
    return out


def joint_moves(ev: Evaluator, state: PipeState, batch: int, ranks) -> list[PipeState]:
    """tp x2 / tp /2 on every stage of one device type, or on every stage, at once (with
    the Mbs the new dps allow), tried by :func:`balance` when no single-stage move
    improves.  Eq. 1's max_j T_j and the pipeline's own All-Reduce term (max_j AR_j -
    sum_{k<j} Tb_k) move only when all of a type's equal stages change together, which
    single-stage exchanges cannot reach one step at a time (measured: GPT-3 13B on
    b2b4-64 at seq 32 and at gbs 64 the search stopped at tp 1 / tp 8 on every 910B2
    stage, 0.5% / 0.005% slower than Metis's tp 2 / tp 4 on all of them)."""
    types = sorted({s.device_type for s in state.stages})
    out = []
    for t in types:
        out += _type_wide(ev, state, t, batch, ranks)
    if len(types) > 1:
        out += _type_wide(ev, state, None, batch, ranks)
    return out
