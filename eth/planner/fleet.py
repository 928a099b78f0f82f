"""Which of a cluster's devices to use: the fleet choice around the HPP search.

A cluster file lists what is available: node group i has ``count`` nodes.  A *fleet* is
a node count 0 <= k_i <= count_i per group (the first k_i nodes,
:meth:`eth.spec.cluster.Cluster.subset`); the plan of a fleet is the search's plan on that
sub-cluster, so it holds only the devices it uses and trains on them alone.

Objectives (:class:`FleetOptions`): ``throughput`` (most samples per second) or ``cost``
(fewest USD per sample, :func:`eth.cost.price.plan_rates`), under the constraints
``min_throughput`` (samples/s) and ``max_cost_per_hour`` (USD, devices plus egress).

Candidates: per group the counts {0, count} for the throughput objective without a budget
(leaving a whole type or zone out is what can make a job faster), else {0, 1, 2, 4, ...,
count} (what a budget or the cost per sample can favour).  Each gets, before any search,

    bound   = 1000 x sum over its devices of r_t / L          samples/s, an upper bound
    price   = sum over its devices of price_per_hour          USD/h, a lower bound of its cost

with r_t the most layer-samples per ms one device of type t can compute (:func:`device_rates`:
the profile's forward + backward op times of one layer at any micro-batch and tp,
micro / (tp x ms)): an iteration lasts at least as long as any device is busy, and the
devices together compute L layers for every sample.  Fleets whose bound is below
``min_throughput``, whose price is above ``max_cost_per_hour`` or whose memory cannot hold
the weights are not searched.  The rest are *screened* best-first (throughput: by bound;
cost: by price / bound) with a quick search (:meth:`FleetChoice.screen_options`: no seeds,
no symmetric phase, no polish, patience 8, at most 8 blocks; within 1-3 % of the full
search on the mixed4-256 fleets), and the loop stops at the first fleet that cannot beat
the best plan so far, a real plan (its bound not above the best samples/s; its price /
bound not below the best USD per sample).  For the cost objective a fleet is also passed
over when, 5 % more efficient (samples/s over bound) than the best screened fleet of the
same node groups, it would still not beat the best plan: fleets of the same groups and
price per bound differ mostly in how well they use their devices, and a larger one uses
them less well (a heuristic, unlike the bounds).  Then the full search runs on the screened
fleets within 2 % of the best (at most 3).  For the throughput objective the fleet of
every device is searched in full first, when it may meet the constraints, so that
objective never returns a plan slower than the search on every device.

The frontier (``pareto``): every candidate that no searched plan dominates by bound
(a plan at least as fast as the candidate's bound and no dearer than its price) is
screened; the points of the screened fleets that no other beats in both samples/s and
cost per hour form the throughput-cost frontier (``eth.report.fleet.frontier``).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace

from eth.cost.price import plan_rates
from eth.errors import InfeasibleError, ProfileError, SpecError
from eth.planner.options import SearchOptions
from eth.planner.progress import progress_bar
from eth.spec.cluster import Cluster
from eth.spec.model import ModelSpec, layer_ops

FLEET_OBJECTIVES = ("throughput", "cost")
MAX_CANDIDATES = 4096
"""Above this many count combinations every group gets {0, count} only."""
FINAL_MARGIN = 0.02
"""Screened fleets this close to the best screened one are searched in full."""
FINALS = 3
"""At most this many of them."""
EFFICIENCY_MARGIN = 0.05
"""Cost objective: a fleet is screened only if, 5 % more efficient than the best screened
fleet of the same node groups, it would beat the best plan (:meth:`FleetChoice._unpromising`)."""


@dataclass(frozen=True)
class FleetOptions:
    """What the fleet choice optimises and under which constraints."""

    objective: str = "throughput"
    """throughput: most samples/s; cost: fewest USD per sample."""
    use_all: bool = False
    """Every device of the cluster, no choice (the constraints are still checked)."""
    min_throughput: float = 0.0
    """Samples/s the plan must reach (0: no constraint)."""
    max_cost_per_hour: float = 0.0
    """USD per hour the plan may cost, devices plus egress (0: no constraint)."""
    pareto: bool = False
    """Search every fleet that may lie on the throughput-cost frontier."""

    def check(self, cluster: Cluster) -> None:
        """One line naming the field for a bad value or a cost that needs missing prices."""
        if self.objective not in FLEET_OBJECTIVES:
            raise SpecError(f"objective must be one of {', '.join(FLEET_OBJECTIVES)}, got {self.objective!r}")
        for name in ("min_throughput", "max_cost_per_hour"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise SpecError(f"{name} must be a number >= 0 (0: none), got {value}")
        needs = [what for what, on in (("objective cost", self.objective == "cost"),
                                       ("max_cost_per_hour", self.max_cost_per_hour > 0),
                                       ("the throughput-cost frontier", self.pareto)) if on]
        missing = cluster.unpriced_types()
        if needs and missing:
            raise SpecError(f"{needs[0]} needs a price_per_hour for every device type; {', '.join(missing)} "
                            f"ha{'s' if len(missing) == 1 else 've'} none (cluster device_types or nodes)")

    def check_plan(self, rates: dict) -> None:
        """One line if a plan's :func:`eth.cost.price.plan_rates` miss a constraint (``use_all``)."""
        if rates["samples_per_s"] < self.min_throughput * (1 - 1e-12):
            raise InfeasibleError(f"min_throughput {self.min_throughput:g} samples/s: the plan on every device "
                                  f"reaches {rates['samples_per_s']:.4g} samples/s")
        if self.max_cost_per_hour and rates["cost_per_hour"] > self.max_cost_per_hour * (1 + 1e-12):
            raise InfeasibleError(f"max_cost_per_hour {self.max_cost_per_hour:g} USD: the plan on every device "
                                  f"costs {rates['cost_per_hour']:.4g} USD/h")

    @property
    def constrained(self) -> bool:
        return self.min_throughput > 0 or self.max_cost_per_hour > 0


@dataclass
class FleetPoint:
    """One candidate fleet: node counts per group, its bounds and, once searched, its plan's figures."""

    counts: tuple[int, ...]
    bound: float
    """Samples/s no plan on these devices can beat."""
    price: float
    """USD per hour of the devices."""
    samples_per_s: float = 0.0
    cost_per_hour: float = 0.0
    iteration_ms: float = 0.0
    status: str = "not searched"
    """not searched, infeasible (why), or searched."""
    plan: object = field(default=None, repr=False)

    def record(self, cluster: Cluster) -> dict:
        return {"devices": fleet_devices(cluster, self.counts), "nodes": list(self.counts),
                "bound_samples_per_s": round(self.bound, 4), "status": self.status}\
            | ({"samples_per_s": round(self.samples_per_s, 4), "cost_per_hour": round(self.cost_per_hour, 4),
                "iteration_ms": round(self.iteration_ms, 4)} if self.plan is not None else {})


def fleet_devices(cluster: Cluster, counts) -> dict[str, int]:
    """Devices per group label (type, and @zone where zones are given) of a fleet."""
    out: dict[str, int] = {}
    for group, k in zip(cluster.nodes, counts):
        label = group.type + (f"@{group.zone}" if group.zone else "")
        out[label] = out.get(label, 0) + k * group.devices_per_node
    return out


def device_rates(model: ModelSpec, cluster: Cluster, profiles, gbs: int) -> dict[str, float]:
    """Per device type, the most layer-samples per ms one device computes: the max over
    micro-batches 1 .. min(gbs, 64) and every power-of-two tp up to the type's devices per node
    (dividing the heads) of micro / (tp x (forward + backward ms of one layer's ops + the
    profile's per-layer overheads where positive))."""
    rates = {}
    ops = layer_ops(model)
    for name in cluster.types:
        per_node = max(g.devices_per_node for g in cluster.nodes if g.type == name)
        tps = [t for t in (1 << k for k in range(per_node.bit_length())) if t <= per_node and model.heads % t == 0]
        best = 0.0
        for tp, micro in itertools.product(tps, range(1, min(gbs, 64) + 1)):
            try:
                costs, _ = profiles.layer_costs(name, model, micro, tp)
                oh = profiles.overheads(name, model, micro, tp)
            except (ProfileError, SpecError, KeyError):
                continue
            ms = sum(costs[op].fwd_ms + costs[op].bwd_ms for op in ops) + max(oh[0], 0.0) + max(oh[1], 0.0)
            if ms > 0:
                best = max(best, micro / (tp * ms))
        if best == 0.0:
            raise ProfileError(f"no layer time of {model.name} on {name} in the profiles")
        rates[name] = best
    return rates


class FleetChoice:
    """The candidates of one cluster and the best-first loop over them (module docstring)."""

    def __init__(self, model: ModelSpec, cluster: Cluster, profiles, options: SearchOptions, fleet: FleetOptions):
        self.model, self.cluster, self.profiles, self.opt, self.fleet = model, cluster, profiles, options, fleet
        self.rates = device_rates(model, cluster, profiles, options.gbs)
        state = model.num_params() * options.setup.weight_bytes   # every weight, once, at least
        levels = [self._levels(g.count) for g in cluster.nodes]
        if math.prod(len(v) for v in levels) > MAX_CANDIDATES:
            levels = [[0, g.count] for g in cluster.nodes]
        self.points, self.unfit = [], 0
        for counts in itertools.product(*levels):
            if not any(counts):
                continue
            memory = sum(k * g.devices_per_node * (cluster.types[g.type].memory_bytes - cluster.types[g.type].overhead_bytes)
                         for g, k in zip(cluster.nodes, counts))
            if memory < state:
                self.unfit += 1
                continue
            self.points.append(FleetPoint(counts, self._bound(counts), self._price(counts)))

    def _levels(self, count: int) -> list[int]:
        if self.fleet.objective == "throughput" and not self.fleet.max_cost_per_hour and not self.fleet.pareto:
            return [0, count]
        return sorted({0, count} | {1 << k for k in range(count.bit_length()) if 1 << k < count})

    def _bound(self, counts) -> float:
        per_ms = sum(k * g.devices_per_node * self.rates[g.type] for g, k in zip(self.cluster.nodes, counts))
        return 1e3 * per_ms / self.model.num_layers

    def _price(self, counts) -> float:
        return sum(k * g.devices_per_node * self.cluster.group_price(g) for g, k in zip(self.cluster.nodes, counts))

    # ------------------------------------------------------------------ ranking
    def _key(self, p: FleetPoint) -> tuple:
        """Best-first order: most promising first."""
        if self.fleet.objective == "cost":
            return (p.price / p.bound, p.bound)
        return (-p.bound, p.price)

    def _value(self, p: FleetPoint) -> tuple:
        """What a searched point scores (smaller is better)."""
        if self.fleet.objective == "cost":
            return (p.cost_per_hour / p.samples_per_s, -p.samples_per_s)
        return (-p.samples_per_s, p.cost_per_hour)

    def _can_beat(self, p: FleetPoint, best: FleetPoint) -> bool:
        if self.fleet.objective == "cost":
            return p.price / p.bound < best.cost_per_hour / best.samples_per_s * (1 - 1e-12)
        return p.bound > best.samples_per_s * (1 + 1e-12)

    def _unpromising(self, p: FleetPoint, incumbent: FleetPoint) -> bool:
        """Cost objective: ``p``'s cost per sample, were it to reach the efficiency (samples/s
        over bound) of the best screened fleet of the same node groups (taking a share of
        each group alone differs) plus :data:`EFFICIENCY_MARGIN`, would not beat ``incumbent``."""
        support = tuple(k > 0 for k in p.counts)
        seen = [q.samples_per_s / q.bound for q in self.points
                if q.plan is not None and tuple(k > 0 for k in q.counts) == support]
        if self.fleet.objective != "cost" or not seen:
            return False
        reach = p.bound * min(1.0, max(seen) * (1 + EFFICIENCY_MARGIN))
        return p.price / reach >= incumbent.cost_per_hour / incumbent.samples_per_s

    def _meets(self, p: FleetPoint) -> bool:
        f = self.fleet
        return (p.samples_per_s >= f.min_throughput * (1 - 1e-12)
                and (not f.max_cost_per_hour or p.cost_per_hour <= f.max_cost_per_hour * (1 + 1e-12)))

    def _possible(self, p: FleetPoint) -> bool:
        f = self.fleet
        return (p.bound >= f.min_throughput * (1 - 1e-12)
                and (not f.max_cost_per_hour or p.price <= f.max_cost_per_hour * (1 + 1e-12)))

    # ------------------------------------------------------------------ search
    def evaluate(self, p: FleetPoint, options: SearchOptions, deadline: float, progress: bool = False) -> None:
        """Search ``p``'s sub-cluster with ``options`` (its progress bar with ``progress``);
        keep the plan if it is faster than the one ``p`` has."""
        from eth.planner.search import search

        left = max(deadline - time.perf_counter(), 1e-9) if self.opt.time_limit else 0.0
        try:
            plan = search(self.model, self.cluster.subset(p.counts), self.profiles,
                          replace(options, progress=progress and self.opt.progress, time_limit=left))
        except InfeasibleError as exc:
            if p.plan is None:
                p.status = f"infeasible: {exc}"
            return
        if p.plan is not None and plan.predicted["iteration_ms"] >= p.iteration_ms:
            return
        rates = plan_rates(plan)
        p.plan, p.iteration_ms = plan, plan.predicted["iteration_ms"]
        p.samples_per_s, p.cost_per_hour = rates["samples_per_s"], rates.get("cost_per_hour", 0.0)

    def screen_options(self) -> SearchOptions:
        """The quick search that ranks fleets: no seeds, no symmetric phase, no polish, a
        patience of 8 and at most 8 blocks over all types."""
        return replace(self.opt, seeds=False, symmetric=False, polish_top=0, patience=min(self.opt.patience or 8, 8),
                       max_blocks=min(self.opt.max_blocks or 8, 8), simulate_finalists=False)

    def run(self):
        """For the throughput objective, search every device in full first (the first
        incumbent); screen the other candidates best-first (a screened plan is a real plan,
        so each is an incumbent the bounds may prune against); then search in full the
        screened fleets within :data:`FINAL_MARGIN` of the best (at most :data:`FINALS`).
        The best fully searched fleet wins.  Returns it and the seconds taken."""
        start = time.perf_counter()
        deadline = start + self.opt.time_limit
        order = sorted((p for p in self.points if self._possible(p)), key=self._key)
        screen, incumbent = self.screen_options(), None
        bar = progress_bar(len(order), self.opt.progress, "fleets", unit="fleet")
        try:
            everything = self.everything()
            if everything is not None:   # searched in full anyway: the first incumbent
                self.evaluate(everything, self.opt, deadline, progress=True)
                everything.status = "searched" if everything.plan is not None else everything.status
                bar.update(1)
                if everything.plan is not None and self._meets(everything):
                    incumbent = everything
            for p in order:
                if self.opt.time_limit and time.perf_counter() >= deadline:
                    break
                if p is everything:
                    continue
                if self.fleet.pareto:
                    if any(q.plan is not None and q.samples_per_s >= p.bound and q.cost_per_hour <= p.price
                           for q in self.points):
                        continue
                elif incumbent is not None and not self._can_beat(p, incumbent):
                    break
                elif incumbent is not None and self._unpromising(p, incumbent):
                    p.status = "not searched (unpromising)"
                    continue
                self.evaluate(p, screen, deadline)
                p.status = "screened" if p.plan is not None else p.status
                bar.update(1)
                if p.plan is not None and self._meets(p) and (incumbent is None or self._value(p) < self._value(incumbent)):
                    incumbent = p
        finally:
            bar.close()
        if incumbent is None:
            raise InfeasibleError(self._nothing_meets())
        for p in self.finals(incumbent):
            self.evaluate(p, self.opt, deadline)
            p.status = "searched"
        best = min((p for p in self.points if p.status == "searched" and p.plan is not None and self._meets(p)),
                   key=self._value)
        return best, time.perf_counter() - start

    def everything(self) -> FleetPoint | None:
        """The fleet of every device, for the throughput objective where it may meet the constraints."""
        counts = tuple(g.count for g in self.cluster.nodes)
        if self.fleet.objective != "throughput":
            return None
        return next((p for p in self.points if p.counts == counts and self._possible(p)), None)

    def finals(self, incumbent: FleetPoint) -> list[FleetPoint]:
        """The screened fleets the full search runs on (:meth:`run`): those within
        :data:`FINAL_MARGIN` of the best, at most :data:`FINALS`, the best among them."""
        value = self._value(incumbent)[0]
        return sorted((p for p in self.points if p.status == "screened" and self._meets(p)
                       and self._value(p)[0] <= value + abs(value) * FINAL_MARGIN), key=self._value)[:FINALS]

    def _nothing_meets(self) -> str:
        f, searched = self.fleet, [p for p in self.points if p.plan is not None]
        if f.min_throughput and (not searched or max(p.samples_per_s for p in searched) < f.min_throughput):
            fastest = max(searched, key=lambda p: p.samples_per_s, default=None)
            within = [p for p in self.points if not f.max_cost_per_hour or p.price <= f.max_cost_per_hour]
            if fastest is not None:
                return (f"min_throughput {f.min_throughput:g} samples/s: the fastest plan searched reaches "
                        f"{fastest.samples_per_s:.4g} samples/s on {_devices_text(self.cluster, fastest.counts)}")
            top = max((p.bound for p in within), default=0.0)
            return (f"min_throughput {f.min_throughput:g} samples/s: no fleet{' within the budget' if f.max_cost_per_hour else ''} "
                    f"can reach it (at most {top:.4g} samples/s by the devices' compute alone)")
        if f.max_cost_per_hour:
            if searched:
                low = min(searched, key=lambda p: p.cost_per_hour)
                return (f"max_cost_per_hour {f.max_cost_per_hour:g} USD: the cheapest plan found costs "
                        f"{low.cost_per_hour:.4g} USD/h with egress, on {_devices_text(self.cluster, low.counts)}")
            low = min(self.points, key=lambda p: p.price, default=None)
            if low is not None:
                return (f"max_cost_per_hour {f.max_cost_per_hour:g} USD: the cheapest fleet that can hold the "
                        f"weights costs {low.price:.4g} USD/h for its devices "
                        f"({_devices_text(self.cluster, low.counts)})")
        everything = next((p for p in self.points if p.counts == tuple(g.count for g in self.cluster.nodes)), None)
        if everything is not None and everything.status.startswith("infeasible: "):
            return everything.status.removeprefix("infeasible: ")
        from eth.planner.search import search

        try:   # the search on every device says what does not fit, and by how much
            search(self.model, self.cluster, self.profiles, replace(self.opt, progress=False))
        except InfeasibleError as exc:
            return str(exc)
        return "no fleet of the cluster can hold the model"


def _devices_text(cluster: Cluster, counts) -> str:
    return " + ".join(f"{n} {label}" for label, n in fleet_devices(cluster, counts).items() if n)


def choose_fleet(model: ModelSpec, cluster: Cluster, profiles, options: SearchOptions, fleet: FleetOptions):
    """The plan of the best fleet of ``cluster`` by ``fleet`` and the :class:`FleetChoice`
    (its points for a frontier); ``plan.search["fleet"]`` records the choice."""
    choice = FleetChoice(model, cluster, profiles, options, fleet)
    best, seconds = choice.run()
    plan = best.plan
    searched = [p for p in choice.points if not p.status.startswith("not searched")]
    plan.search["fleet"] = {
        "objective": fleet.objective, "min_throughput": fleet.min_throughput,
        "max_cost_per_hour": fleet.max_cost_per_hour,
        "available": fleet_devices(cluster, [g.count for g in cluster.nodes]),
        "used": fleet_devices(cluster, best.counts),
        "groups": [{"type": g.type, "zone": g.zone, "devices_per_node": g.devices_per_node, "available": g.count,
                    "used": k} for g, k in zip(cluster.nodes, best.counts)],
        "candidates": len(choice.points), "cannot_hold_weights": choice.unfit, "searched": len(searched),
        "unpromising": sum(p.status == "not searched (unpromising)" for p in choice.points),
        "time_s": round(seconds, 3),
        "points": [p.record(cluster) for p in searched],
    }
    plan.search["time_s"] = round(seconds, 3)
    return plan, choice
