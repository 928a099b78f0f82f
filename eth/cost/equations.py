"""The paper's pipeline-time equations over per-stage costs (section 4.2.3).

Eq. 1, pipeline time for the stage search (batch B = Gbs or Lbs) -- :func:`eq1_pipeline_ms`:

    sum_j T_j + max_j T_j * (B / Mbs - 1)

Eq. 5, end time of stage j of pipeline i for batch allocation -- :func:`eq5_end_times`:

    Te_i^j = sum_k Tf_i^k + max_k T_i^k * (Lbs_i / Mbs_i - 1) + sum_{k>=j} Tb_i^k + AR_i^j

Eq. 6, All-Reduce of a gradient block -- :func:`eq6_allreduce_ms`:

    AR = 2 * Gra * (N - 1) / (N * BW)

Gradient-timed end times (this project's extension of Eq. 5/6, the planner's default
objective) -- :func:`synced_end_times`.  Eq. 5 adds AR_i^j, the stage's own share of
every block it holds, to the stage's own backward end, as if its partners in other
pipelines were ready when it is.  The runtime reduces a block with one collective over
all its holders, so a block

    starts at   R_b = max over holders h of E_h        (E_h: the stage's last backward)
    lasts       D_b = max over holders h of AR_{b,h}    (the lowest-tp holder's share)

and a stage's link carries its blocks one after another in the order they become
ready: c_{b,h} = max(c_{prev,h}, R_b) + AR_{b,h}, from c = E_h; a block is done when
its last holder's link is, F_b = max_h c_{b,h} (>= R_b + D_b), and a stage ends when
all its blocks are: Te_h = max(E_h, max over its blocks of F_b).  Te_h >= Eq. 5's
E_h + sum_b AR_{b,h}, with equality when every partner is ready at E_h and holds the
same shares.  E_h is the end of the stage's last backward as 1F1B plays it, op by op
(:func:`one_f_one_b_end_times`), not Eq. 5's closed form: with few micro-batches or
unequal stages the fill and drain differ.

:class:`StageCost` is what they read: one stage's forward and backward time per
micro-batch and its memory, as :class:`eth.cost.model.CostModel` predicts it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageCost:
    """Per-micro-batch times (ms) and per-device memory (bytes) of one stage."""

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    """Part of bwd_ms spent re-running forward ops."""
    comm_ms: float
    """Part of fwd_ms + bwd_ms spent in TP collectives and stage-boundary p2p."""
    params: float
    """Parameters held by one device."""
    act_bytes: float
    """Saved activations of one micro-batch on one device, after recompute."""
    inflight: int
    memory_bytes: float
    capacity_bytes: float
    send_fwd_ms: float = 0.0
    """Part of fwd_ms spent sending the activation to the next stage (and, when
    transfers block both ends, receiving the input from the previous one)."""
    send_bwd_ms: float = 0.0
    """Part of bwd_ms spent sending the input gradient to the previous stage (and, when
    transfers block both ends, receiving the output gradient from the next one)."""

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


def eq1_pipeline_ms(costs, batch: int, mbs: int) -> float:
    """Eq. 1: sum_j T_j + max_j T_j * (batch / mbs - 1)."""
    totals = [c.total_ms for c in costs]
    return sum(totals) + max(totals) * (batch / mbs - 1)


def eq5_end_times(costs, lbs: int, mbs: int, ar_ms=None) -> list[float]:
    """Eq. 5: end time Te^j of every stage j of one pipeline with ``lbs`` samples."""
    if lbs <= 0:
        return [0.0] * len(costs)
    ar_ms = ar_ms or [0.0] * len(costs)
    head = sum(c.fwd_ms for c in costs) + max(c.total_ms for c in costs) * (lbs / mbs - 1)
    ends, tail = [], 0.0
    for j in range(len(costs) - 1, -1, -1):
        tail += costs[j].bwd_ms
        ends.append(head + tail + ar_ms[j])
    return ends[::-1]


def synced_end_times(backward_end: dict, blocks) -> dict:
    """Gradient-timed end time of every stage (module docstring): ``backward_end`` maps
    (pipeline, stage) to E_h, the end of its last backward (Eq. 5 without AR_i^j);
    ``blocks`` are :class:`eth.cost.sync.SyncBlock`-like (``holders``, ``holder_ms``).
    Returns (pipeline, stage) -> when the stage's last block is reduced."""
    ready = [max(backward_end[h] for h in b.holders) for b in blocks]
    mine: dict = {}
    for k, b in enumerate(blocks):
        for h, ms in zip(b.holders, b.holder_ms):
            mine.setdefault(h, []).append((ready[k], k, ms))
    done = list(ready)
    for h, queue in mine.items():
        t = backward_end[h]
        for r, k, ms in sorted(queue):
            t = max(t, r) + ms
            done[k] = max(done[k], t)
    ends = dict(backward_end)
    for k, b in enumerate(blocks):
        for h in b.holders:
            ends[h] = max(ends[h], done[k])
    return ends


def one_f_one_b_end_times(costs, lbs: int, mbs: int, sends_overlap: bool = True) -> list[float]:
    """When every stage of one pipeline ends its last backward under 1F1B, played op by
    op instead of Eq. 5's closed form (the gradient-timed objective's E_h, module
    docstring).  Stage j of S with M = lbs / mbs micro-batches runs min(S - j, M) forwards,
    then one backward and one forward in turn, then the remaining backwards; an op starts
    when the stage's previous op has ended and its input is there: F(j, m) after F(j-1, m)
    and its activation send, B(j, m) after B(j+1, m) and its gradient send (B(S-1, m) after
    F(S-1, m)).  With ``sends_overlap`` the boundary sends (``send_fwd_ms``,
    ``send_bwd_ms``) leave the sender's compute and run on their link, one at a time in
    micro-batch order, as asynchronous isend/irecv do; without it (transfers that block
    both ends) they stay in the stage times.  Equal stages without sends give Eq. 5;
    unequal ones end earlier where a stage's warm-up forwards overlap its neighbours'
    (Eq. 5 charges every stage's whole first forward and backward) or later where the
    forward and backward bottlenecks are different stages.  Cost: see
    :func:`one_f_one_b_played`."""
    return one_f_one_b_played(costs, lbs, mbs, sends_overlap)[0]


JUMP_PERIODS = 4
"""The longest period of the steady 1F1B rounds :func:`one_f_one_b_played` looks for."""
JUMP_TOLERANCE = 1e-12
"""Relative spread of a state's shift over a period that still counts as uniform."""


def one_f_one_b_played(costs, lbs: int, mbs: int, sends_overlap: bool = True,
                       jump: bool = True) -> tuple[list[float], int]:
    """:func:`one_f_one_b_end_times` and the number of 1F1B rounds it played.

    After its warm-up forwards, stage j plays round i = 0..M-1 as B(j, i) and then, while
    there is one, F(j, S - j + i); a round's inputs come from round i of stage j + 1 (the
    gradient) and round i - 1 of stage j - 1 (the activation), so rounds are played in
    order, stages last to first.  While every stage plays a whole round (i < M - S) a round
    is one fixed max-plus map of the state (each stage's free time and its two links' free
    times): once the state has moved by the same amount in every entry over c <= 
    :data:`JUMP_PERIODS` rounds it moves by that amount every c rounds from then on, so
    with ``jump`` the remaining whole rounds are skipped by adding it (the periodic
    regime of a max-plus system; exact up to :data:`JUMP_TOLERANCE`), and the last
    rounds are played.  A pipeline of 16 stages and 1000 micro-batches then plays a few
    dozen rounds instead of 1000."""
    S, m = len(costs), lbs // mbs if lbs > 0 else 0
    if m <= 0:
        return [0.0] * S, 0
    sf = [c.send_fwd_ms if sends_overlap else 0.0 for c in costs]
    sb = [c.send_bwd_ms if sends_overlap else 0.0 for c in costs]
    fwd = [c.fwd_ms - s for c, s in zip(costs, sf)]
    bwd = [c.bwd_ms - s for c, s in zip(costs, sb)]
    free, last = [0.0] * S, [0.0] * S
    link_f, link_b = [0.0] * S, [0.0] * S           # when j -> j+1, j -> j-1 are free
    f_at = [0.0] * S                                # F(j, x) there at stage j: the one it needs next
    loss = 0.0                                      # F(S-1, x) done: B(S-1, x) may start
    warm_out: list[list[float]] = []
    for j in range(S):                              # warm-up forwards, first stage to last
        t, arrivals, prev = 0.0, [], warm_out[j - 1] if j else None
        for x in range(min(S - j, m)):
            r = prev[x] if prev is not None else 0.0
            t = (t if t > r else r) + fwd[j]
            if j + 1 < S:
                lk = link_f[j]
                link_f[j] = (t if t > lk else lk) + sf[j]
                arrivals.append(link_f[j])
            else:
                loss = t
        free[j] = t
        warm_out.append(arrivals)
    for j in range(1, S):                           # the activation of F(j, S - j), round 0's
        f_at[j] = warm_out[j - 1][S - j] if S - j < m else 0.0
    history: list[list[float]] = []
    whole = max(0, m - S)                           # rounds every stage plays whole
    i = played = 0
    while i < m:
        grad = 0.0
        for j in range(S - 1, -1, -1):
            t = free[j]
            r = loss if j == S - 1 else grad
            last[j] = t = (t if t > r else r) + bwd[j]              # B(j, i)
            if j:
                lk = link_b[j]
                grad = link_b[j] = (t if t > lk else lk) + sb[j]
            if S - j + i < m:                                       # F(j, S - j + i)
                r = f_at[j]
                t = (t if t > r else r) + fwd[j]
                if j + 1 < S:
                    lk = link_f[j]
                    f_at[j + 1] = link_f[j] = (t if t > lk else lk) + sf[j]
                else:
                    loss = t
            free[j] = t
        i += 1
        played += 1
        if jump and i < whole:
            state = free + link_f[:S - 1] + link_b[1:] + [loss]
            history.append(state)
            del history[:-JUMP_PERIODS - 1]
            for c in range(1, len(history)):
                moved = [a - b for a, b in zip(state, history[-1 - c])]
                if max(moved) - min(moved) <= JUMP_TOLERANCE * max(1.0, abs(state[0]), abs(state[-1])):
                    skip = (whole - i) // c
                    if skip:
                        shift = skip * sum(moved) / len(moved)
                        free = [v + shift for v in free]
                        link_f = [v + shift for v in link_f[:S - 1]] + [0.0]
                        link_b = [0.0] + [v + shift for v in link_b[1:]]
                        f_at = [0.0] + [v + shift for v in f_at[1:]]
                        loss += shift
                        i += skip * c
                        history.clear()
                    break
    return last, played


STEP_ALLREDUCES = 3
"""All-reduces over every rank in each training step after the backward
(``megatron.hpp.training.loop.Trainer.step``): the gradient norm's, and the statistics' sum
and max."""


def eq6_allreduce_ms(grad_bytes: float, n: int, gbps: float) -> float:
    """Eq. 6: 2 * Gra * (N - 1) / (N * BW), BW in Gbit/s, result in ms."""
    if n <= 1 or grad_bytes <= 0:
        return 0.0
    bytes_per_ms = gbps * 1e9 / 8 / 1e3
    return 2 * grad_bytes * (n - 1) / (n * bytes_per_ms)
