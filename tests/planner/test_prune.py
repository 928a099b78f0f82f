"""Phase 1's floor pruning (SearchOptions.prune): the floor is a lower bound of every
configuration of a stage group (checked against all of them), and pruning changes no
result, alternative or plan."""
import itertools
import math
import random
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from eth.cost.model import CostModel
from eth.cost.activations import LayerKeep
from eth.cost.floors import _recompute_hull
from eth.spec.model import OpFlow
from eth.planner import bounds
from eth.spec.model import LAYER_OPS
from eth.planner.bounds import split_floor, split_floors, stage_group_floor, sum_floors
from eth.planner.balance import warm_start
from eth.planner.enumerate import make_blocks, stage_groups
from eth.planner.evaluate import PipeState, StageState
from eth.planner.options import SearchOptions
from eth.planner.pipeline import optimise_pipeline, stage_ranks
from eth.planner.recompute_runs import RunEvaluator
from eth.planner.search import search

from _planner_data import M4, M6, make_cluster, profiles_for

NODES = [{"type": "A100", "devices_per_node": 2}, {"type": "RTX3090", "devices_per_node": 2},
         {"type": "V100", "devices_per_node": 2}]


def _cluster(memory):
    types = {"A100": {"memory_gb": memory[0]}, "RTX3090": {"memory_gb": memory[1]}, "V100": {"memory_gb": memory[2]}}
    return make_cluster(NODES, device_types=types)


def _compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0,) + cuts + (total,)
        yield [y - x for x, y in zip(b, b[1:])]


def _one_micro_floor(ev, stages, ranks, batch):
    """The floor without a shared Mbs and the fill (issue 11's first floor): each stage's
    best (B / Mbs) x T_j-floor over its own Mbs, the split floor of those."""
    rows = np.stack([bounds._stage_floor(ev, t, n, j, len(stages), ranks, batch) for j, (t, n) in enumerate(stages)])
    scale = np.array([batch // m for m in bounds._divisors(batch)], dtype=float)[None, :, None]
    return split_floor(list(np.min(rows * scale, axis=1)), ev.model.num_layers)


def test_floors_of_many_groups_at_once_equal_each_alone():
    """bounds.stage_group_floors (phase 1: every stage group of a pipeline in one array per
    stage count) gives each group bit for bit what it gives the group alone, for groups
    of several stage counts, some with an inf floor (nothing fits, or no tp's dp divides
    the batch)."""
    counts, kinds = set(), set()
    for memory, batch in (((80, 24, 32), 8), ((4, 3, 3), 16), ((80, 24, 32), 6), ((80, 0.001, 32), 8)):
        cluster = _cluster(memory)
        ev = RunEvaluator(CostModel(M4, cluster, profiles_for(M4, cluster)))
        blocks = make_blocks(cluster, 8)
        groups = [(g.stages, stage_ranks(ev, blocks, g))
                  for g in stage_groups(blocks.types, blocks.devices(blocks.count), M4.num_layers, 4)]
        alone = [bounds.stage_group_floors(ev, [g], batch)[0] for g in groups]
        counts |= {len(s) for s, _ in groups}
        kinds |= {math.isinf(f) for f in alone}
        assert bounds.stage_group_floors(ev, groups, batch) == alone
    assert len(counts) > 1 and kinds == {True, False}


# batch 4 on 4 layers: Mbs 1, 2 or 4, so 1 to 4 micro-batches, and the fill term
# (sum_j T_j) is as large as the (B / Mbs - 1) x max_j T_j term or larger
@pytest.mark.parametrize("memory, batch", [((80, 24, 32), 8), ((4, 3, 3), 16), ((80, 24, 32), 4)])
def test_floor_is_below_every_configuration_of_each_stage_group(memory, batch):
    cluster = _cluster(memory)
    model = M4
    ev = RunEvaluator(CostModel(model, cluster, profiles_for(model, cluster)))
    blocks = make_blocks(cluster, 8)
    tight, raised = [], 0
    for g in stage_groups(blocks.types, blocks.devices(blocks.count), model.num_layers, 4):
        ranks = stage_ranks(ev, blocks, g)
        floor = stage_group_floor(ev, g.stages, ranks, batch)
        looser = _one_micro_floor(ev, g.stages, ranks, batch)
        assert looser <= floor * (1 + 1e-12) or math.isinf(looser) and math.isinf(floor)
        raised += floor > looser * (1 + 1e-9)
        best = math.inf
        tps = [ev.valid_tps(t, n, ranks[j]) for j, (t, n) in enumerate(g.stages)]
        for choice in itertools.product(*tps):
            dps = [n // tp for (_, n), tp in zip(g.stages, choice)]
            base = math.lcm(*dps)
            for layers in _compositions(model.num_layers, len(g.stages)):
                stages = tuple(StageState(t, n, tp, nl) for (t, n), tp, nl in zip(g.stages, choice, layers))
                for mbs in range(base, batch + 1, base):
                    if batch % mbs == 0:
                        best = min(best, ev.evaluate(PipeState(stages, mbs), batch, ranks).ms)
        assert floor <= best * (1 + 1e-12), (g.stages, floor, best)
        if best < math.inf:
            assert floor > 0
            tight.append(floor / best)
    assert tight and max(tight) > 0.5   # not a vacuous bound
    assert raised > 0                   # the shared Mbs and the fill raised some floors


@pytest.mark.parametrize("memory, batch", [((80, 24, 32), 8), ((4, 3, 3), 16), ((80, 24, 32), 4)])
def test_floor_configuration_lies_in_the_planners_space_near_its_optimum(memory, batch):
    """bounds.floor_configuration, phase 1's warm start (balance.warm_start): a configuration
    of the planner's space (layers summing to L, tps valid on the ranks, Mbs = lcm of the
    dps x a power of two dividing the batch), its Eq. 1 time at least the group's floor and
    near the best of every configuration of that space (measured: median 0.9-4.7%, max
    7.9% over the 24 stage groups of each case; the floors leave out the optimizer step
    after each stage's backward, which grows with the stage's layers and is a large part
    of these 4-layer pipelines at 1-4 micro-batches; a wrong split, tp or Mbs choice is
    far off), and warm_start's evaluated state."""
    cluster = _cluster(memory)
    model = M4
    ev = RunEvaluator(CostModel(model, cluster, profiles_for(model, cluster)))
    blocks = make_blocks(cluster, 8)
    gaps = []
    for g in stage_groups(blocks.types, blocks.devices(blocks.count), model.num_layers, 4):
        ranks = stage_ranks(ev, blocks, g)
        mbs, parts = bounds.floor_configuration(ev, g.stages, ranks, batch)
        dps = [n // tp for (_, n), (tp, _) in zip(g.stages, parts)]
        q = mbs // math.lcm(*dps)
        assert batch % mbs == 0 and mbs % math.lcm(*dps) == 0 and q & (q - 1) == 0, (g.stages, mbs, parts)
        assert sum(nl for _, nl in parts) == model.num_layers and min(nl for _, nl in parts) >= 1
        assert all(tp in ev.valid_tps(t, n, ranks[j]) for j, ((t, n), (tp, _)) in enumerate(zip(g.stages, parts)))
        state = PipeState(tuple(StageState(t, n, tp, nl) for (t, n), (tp, nl) in zip(g.stages, parts)), mbs)
        ms = ev.evaluate(state, batch, ranks).ms
        assert ms >= stage_group_floor(ev, g.stages, ranks, batch) * (1 - 1e-12)
        start = warm_start(ev, g.stages, batch, ranks)
        assert start[0] == state and start[1].ms == ms
        best = math.inf
        tps = [ev.valid_tps(t, n, ranks[j]) for j, (t, n) in enumerate(g.stages)]
        for choice in itertools.product(*tps):
            base = math.lcm(*(n // tp for (_, n), tp in zip(g.stages, choice)))
            for layers in _compositions(model.num_layers, len(g.stages)):
                stages = tuple(StageState(t, n, tp, nl) for (t, n), tp, nl in zip(g.stages, choice, layers))
                m = base
                while batch % m == 0:
                    best = min(best, ev.evaluate(PipeState(stages, m), batch, ranks).ms)
                    m *= 2
        assert best < math.inf
        gaps.append(ms / best - 1)
    assert len(gaps) == 24 and statistics.median(gaps) <= 0.05 and max(gaps) <= 0.08, sorted(gaps)


@pytest.mark.parametrize("memory, batch", [((80, 24, 32), 8), ((4, 3, 3), 16)])
def test_pure_tp_floor_is_below_every_pure_tp_configuration(memory, batch):
    """stage_group_floors(pure_tp=True), HexiScale-strong's floors: every stage at tp = its
    devices (dp 1), inf where that is no valid tp; at least the floor over every tp, and
    below every configuration of the group with those tps (layer splits x Mbs)."""
    cluster = _cluster(memory)
    ev = RunEvaluator(CostModel(M4, cluster, profiles_for(M4, cluster)))
    blocks = make_blocks(cluster, 8)
    groups = [(g.stages, stage_ranks(ev, blocks, g))
              for g in stage_groups(blocks.types, blocks.devices(blocks.count), M4.num_layers, 4)]
    pure = bounds.stage_group_floors(ev, groups, batch, pure_tp=True)
    every = bounds.stage_group_floors(ev, groups, batch)
    finite = tight = 0
    for (stages, ranks), p, e in zip(groups, pure, every):
        assert p >= e * (1 - 1e-12)
        if not all(n in ev.valid_tps(t, n) for t, n in stages):
            assert math.isinf(p)
            continue
        best = math.inf
        for layers in _compositions(M4.num_layers, len(stages)):
            state = tuple(StageState(t, n, n, nl) for (t, n), nl in zip(stages, layers))
            for mbs in range(1, batch + 1):
                if batch % mbs == 0:
                    best = min(best, ev.evaluate(PipeState(state, mbs), batch, ranks).ms)
        assert p <= best * (1 + 1e-12), (stages, p, best)
        finite += best < math.inf
        tight += p > e * (1 + 1e-9)
    assert finite and tight          # some groups fit, and fixing tp raised some floors


def test_stage_time_floors_are_below_every_recompute_set_that_fits():
    # random stages and recompute sets, memory tight enough that many need recompute
    cluster = _cluster((5, 3, 4))
    model = M6
    cost = CostModel(model, cluster, profiles_for(model, cluster))
    ops = [op for op in cost.profiles.layer_costs("A100", model, 1, 1)[0] if op in LAYER_OPS]
    rng = random.Random(7)
    layers = np.arange(1, model.num_layers + 1, dtype=float)
    fit = unfit = 0
    for _ in range(400):
        t = rng.choice(["A100", "RTX3090", "V100"])
        tp, dp, micro = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2, 4])
        first, last, inflight = rng.random() < 0.3, rng.random() < 0.3, rng.randint(1, 4)
        links = (rng.choice([100.0, 300.0]), rng.choice([25.0, 100.0]), rng.choice([25.0, 100.0]))
        row = cost.stage_time_floors(t, first, last, [(tp, dp, micro, links, inflight)], layers)[0]
        nl = rng.randint(1, model.num_layers)
        rec = {op: rng.randint(1, nl) for op in rng.sample(ops, rng.randint(0, len(ops)))}
        c = cost.stage_cost_at(t, tp, dp, nl, first, last, dp * micro, rec, inflight, links)
        if c.fits:
            fit += 1
            assert row[nl - 1] <= c.total_ms * (1 + 1e-12), (t, tp, dp, micro, nl, rec)
        else:
            unfit += 1
    assert fit > 50 and unfit > 50


def _random_layer(rng, k):
    """A chain of k ops (op i reads t{i-1}, "x" for the first, sometimes an earlier tensor
    too, and makes t{i}), each keeping a random part of what it reads and makes and some
    bytes of its own: its dataflow and op costs."""
    flow, ops, sizes, kept = [], {}, {"x": rng.uniform(0, 6)}, set()
    for i in range(k):
        inputs = ("x" if i == 0 else f"t{i - 1}",)
        if i > 1 and rng.random() < 0.3:
            inputs += (rng.choice(["x"] + [f"t{j}" for j in range(i - 1)]),)
        sizes[f"t{i}"] = rng.uniform(0, 6)
        saves = tuple(t for t in inputs + (f"t{i}",) if rng.random() < 0.4)
        own = rng.choice([0.0, rng.uniform(0, 4)])
        act = own + sum(sizes[t] for t in saves if t not in kept)
        kept.update(saves)
        flow.append(OpFlow(f"op{i}", inputs, f"t{i}", saves))
        ops[f"op{i}"] = SimpleNamespace(fwd_ms=rng.uniform(0, 3), act_bytes=act,
                                        input_bytes=sum(sizes[t] for t in inputs), output_bytes=sizes[f"t{i}"])
    return tuple(flow), ops


def test_recompute_hull_is_below_every_recompute_set_of_a_layer():
    # random layers of 1-7 ops: for every bytes-to-free x, the hull is at most the least
    # forward ms of the sets that free x (LayerKeep.freed, one set at a time), exact at the
    # most bytes, and at least the fractional knapsack (each op frees at most its act)
    rng = random.Random(13)
    tighter = 0
    for _ in range(150):
        k = rng.randint(1, 7)
        flow, ops = _random_layer(rng, k)
        keep = LayerKeep(flow, ops)
        order = tuple(ops)
        heads, slopes, most = _recompute_hull(flow, ops)
        points = [(keep.freed(set(r)), sum(ops[o].fwd_ms for o in r))
                  for n in range(k + 1) for r in itertools.combinations(order, n)]
        assert math.isclose(most, max(f for f, _ in points), abs_tol=1e-12)
        for x in [rng.uniform(0, most) for _ in range(20)] + [f for f, _ in points if f >= 0]:
            hull = max(h + s * x for h, s in zip(heads, slopes))
            least = min(t for f, t in points if f >= x)
            assert hull <= least * (1 + 1e-12) + 1e-12, (x, hull, least)
            frac, left = 0.0, x
            for ratio, act in sorted((o.fwd_ms / o.act_bytes, o.act_bytes) for o in ops.values() if o.act_bytes > 0):
                frac += ratio * min(act, max(left, 0.0))
                left -= act
            assert hull >= frac * (1 - 1e-12) - 1e-12
            tighter += hull > frac * (1 + 1e-6)
        top = max(h + s * most for h, s in zip(heads, slopes))
        assert math.isclose(top, min(t for f, t in points if f >= most * (1 - 1e-12)), rel_tol=1e-9, abs_tol=1e-12)
    assert tighter > 100


def test_split_floor_matches_brute_force_over_splits():
    rng = random.Random(5)
    for _ in range(200):
        S, total = rng.randint(1, 4), rng.randint(4, 9)
        if S > total:
            continue
        rows = [np.sort(np.array([rng.choice([rng.uniform(0, 10), math.inf]) if rng.random() < 0.1
                                  else rng.uniform(0, 10) for _ in range(total)])) for _ in range(S)]
        brute = min(max(row[n - 1] for row, n in zip(rows, split)) for split in _compositions(total, S))
        assert split_floor(rows, total) == brute


def test_sum_floors_are_below_every_split_and_exact_on_convex_rows():
    rng = random.Random(11)
    exact = 0
    for _ in range(300):
        S, total, k = rng.randint(1, 4), rng.randint(4, 9), rng.randint(1, 3)
        if S > total:
            continue
        convex = rng.random() < 0.5
        rows = np.empty((S, k, total))
        for j, c in itertools.product(range(S), range(k)):
            steps = sorted(rng.uniform(0, 5) for _ in range(total)) if convex else \
                [rng.uniform(0, 5) for _ in range(total)]
            rows[j, c] = np.cumsum(steps)
            if rng.random() < 0.15:     # nothing fits from some layer count on
                rows[j, c, rng.randrange(total):] = math.inf
        got, maxes = sum_floors(rows, total), split_floors(rows, total)
        for c in range(k):
            splits = list(_compositions(total, S))
            brute = min(sum(rows[j, c, n - 1] for j, n in enumerate(split)) for split in splits)
            assert got[c] <= brute * (1 + 1e-12) or math.isinf(brute) and math.isinf(got[c])
            assert maxes[c] == min(max(rows[j, c, n - 1] for j, n in enumerate(split)) for split in splits)
            if convex and not np.isinf(rows[:, c]).any():
                assert math.isclose(got[c], brute)
                exact += 1
    assert exact > 50


def _same(a, b):
    return (a.group.stages, a.state, a.evaluation.key, a.evaluation.recompute, a.ranks) == \
        (b.group.stages, b.state, b.evaluation.key, b.evaluation.recompute, b.ranks)


@pytest.mark.parametrize("memory", [(80, 24, 32), (6, 3, 4)])
def test_pruned_phase1_returns_the_same_result_and_alternatives(memory):
    cluster = _cluster(memory)
    model = M6
    blocks = make_blocks(cluster, 8)
    db = profiles_for(model, cluster)
    plain = RunEvaluator(CostModel(model, cluster, db))
    pruned = RunEvaluator(CostModel(model, cluster, db))
    fewer = 0
    vecs = [v for v in itertools.product(*[range(c + 1) for c in blocks.count]) if sum(v)]
    for vec, batch in itertools.product(vecs, (4, 16, 64)):
        before = plain.evaluations
        want = optimise_pipeline(plain, blocks, vec, batch, 150, 0, 16, prune=False)
        plain_spent, before = plain.evaluations - before, pruned.evaluations
        got = optimise_pipeline(pruned, blocks, vec, batch, 150, 0, 16, prune=True)
        if want is None:
            assert got is None
            continue
        assert _same(got, want), (vec, batch)
        spent = pruned.evaluations - before
        alternatives = got.alternatives   # completes the pruned groups that may rank
        assert len(alternatives) == len(want.alternatives)
        assert all(_same(a, b) for a, b in zip(alternatives, want.alternatives)), (vec, batch)
        fewer += spent < plain_spent
    assert pruned.evaluations <= plain.evaluations
    assert fewer > 0   # the floor cut some stage groups


@pytest.mark.parametrize("model, memory, gbs", [(M4, (80, 24, 32), 16), (M6, (6, 3, 4), 8)])
def test_search_with_and_without_pruning_gives_the_same_plan(model, memory, gbs):
    cluster = _cluster(memory)
    db = profiles_for(model, cluster)
    plans = [search(model, cluster, db, SearchOptions(gbs=gbs, seeds=False, prune=p)) for p in (False, True)]
    assert [p.to_dict()["pipelines"] for p in plans[1:]] == [plans[0].to_dict()["pipelines"]]
    assert plans[1].search["cost_evaluations"] <= plans[0].search["cost_evaluations"]
