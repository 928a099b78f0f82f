"""Plan at start-up (``pretrain_gpt.py --hpp-cluster FLEET.yaml``): the plan is made for
the processes the launcher actually started, not written beforehand.

1. Every rank finds its device type (:func:`device_type`): ``HPP_DEVICE_TYPE`` if set
   (a comma-separated list: the entry of its LOCAL_RANK, for one host emulating several
   types), else the fleet's type every part of whose name the CUDA device's product name
   contains ("A100-40GB" in "NVIDIA A100-SXM4-40GB"; the longest such name), else the
   fleet's only type; and its host (``HPP_HOST`` as the launch scripts set it, else the
   host name).  One ``all_gather_object`` collects them.
2. Rank 0 builds the cluster of what is present (:func:`present_cluster`): the fleet
   file's device types and links, one node per run of consecutive ranks on one host with
   one device type, in rank order, so the plan's ranks are the launcher's.
3. With ``--save DIR``, a plan stored there (:data:`PLANS_DIR`, one file per membership
   and request, :func:`made_for`) made for the same membership and the same request (model, global batch,
   training setup, profiles, fleet file) is used again -- a fleet that shrinks and grows
   back returns to its earlier plan, its ranks moved where a rendezvous admitted the same
   nodes in another order; otherwise rank 0 searches
   (``eth.planner.job.plan_job``, the planner of tools/search_hpp.py) and, with
   ``--save``, writes the plan there atomically, its membership and request in
   ``plan.search["startup"]``.  The plan of the latest start is also :data:`PLAN_FILE`,
   and every start appends one line to :data:`HISTORY_FILE` (time, membership,
   predicted iteration time, whether the plan was reused, its file, the checkpoint it
   resumes from and the iterations lost since it: rank 0 records each completed
   iteration in :data:`PROGRESS_FILE`); rank 0 prints the membership, the previous
   start's when it differs, the predicted time and the iterations lost.
4. Rank 0 broadcasts the plan (or the one-line error: every rank raises it, exit 2).

A rank whose type cannot be found, or a type the fleet file does not list, is one line
naming the rank, its host and what to set.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eth.errors import SpecError
from eth.planner.fleet import FleetOptions
from eth.spec.plan_history import (HISTORY_FILE, PLAN_FILE, PLANS_DIR, PROGRESS_FILE, describe_membership,
                                   read_history)


@dataclass(frozen=True)
class Member:
    """One rank as the launcher started it."""

    rank: int
    host: str
    device_type: str | None
    """None: not found (:func:`device_type`)."""
    device_name: str | None = None
    """The CUDA product name, if any."""


@dataclass(frozen=True)
class PlanRequest:
    """What the plan is searched for, besides the membership (pretrain_gpt.py's flags)."""

    cluster: str
    """The fleet YAML: device types and links (its nodes are not read)."""
    model: str
    """Preset name, model YAML or HuggingFace config.json."""
    gbs: int
    model_overrides: dict = field(default_factory=dict)
    """Megatron's model flags ({argparse dest: value})."""
    profiles: str | None = None
    """Profile file or folder (None: analytic profiles)."""
    precision: str = "bf16"
    zero_stage: int = 0
    grad_reduce: str = "fp32"
    time_limit: float = 0.0
    """Seconds for the search, 0 = none."""
    objective: str = ""
    """The fleet choice (``eth.planner.fleet``): "throughput" or "cost" lets the plan leave
    nodes out (their ranks exit, :func:`regroup`); "" plans for every rank started."""
    min_throughput: float = 0.0
    max_cost_per_hour: float = 0.0

    def identity(self) -> dict:
        """What a stored plan must have been made for to be used again: the request with
        the fleet file's content (not its path)."""
        out = asdict(self)
        out["cluster"] = Path(self.cluster).read_text()
        out.pop("time_limit")
        return out


def device_type(fleet, env=os.environ, name: str | None = None) -> str | None:
    """This rank's device type among ``fleet.types`` (module docstring, step 1); None when
    nothing tells."""
    given = env.get("HPP_DEVICE_TYPE")
    if given and "," in given:        # one entry per local rank (one host emulating several types)
        entries = [t.strip() for t in given.split(",")]
        local = int(env.get("LOCAL_RANK", "0") or 0)
        ranks = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
        if ranks and len(entries) != ranks:   # every rank of the host says it, not only the one left out
            raise SpecError(f"HPP_DEVICE_TYPE={given} names {len(entries)} device types for the "
                            f"{ranks} ranks on this host (LOCAL_WORLD_SIZE): give one per local rank")
        if local >= len(entries):
            raise SpecError(f"HPP_DEVICE_TYPE={given} names {len(entries)} device types, LOCAL_RANK is {local}")
        return entries[local]
    if given:
        return given
    if name:   # every part of the type's name ("A100", "40GB") in the product name, the longest such type
        have = re.sub(r"[^a-z0-9]", "", name.lower())
        matches = [t for t in fleet.types if all(part in have for part in re.split(r"[^a-z0-9]+", t.lower()) if part)]
        if matches:
            return max(matches, key=len)
    if len(fleet.types) == 1:
        return next(iter(fleet.types))
    return None


def local_member(fleet, rank: int, name: str | None = None) -> Member:
    host = os.environ.get("HPP_HOST") or socket.gethostname()
    return Member(rank, host, device_type(fleet, name=name), name)


def present_cluster(fleet, members):
    """The eth.spec.cluster.Cluster of ``members`` (sorted by rank): the fleet's types and
    links, one node per run of consecutive ranks with one host and one type."""
    from eth.spec.cluster import Cluster

    members = sorted(members, key=lambda m: m.rank)
    for m in members:
        if m.device_type is None:
            raise SpecError(f"rank {m.rank} on host {m.host}: its device type is not known"
                            + (f" (device {m.device_name})" if m.device_name else "")
                            + f"; set HPP_DEVICE_TYPE to one of the fleet's types "
                              f"({', '.join(sorted(fleet.types))})")
        if m.device_type not in fleet.types:
            raise SpecError(f"rank {m.rank} on host {m.host} is a {m.device_type}, which the fleet file "
                            f"does not list (its types: {', '.join(sorted(fleet.types))})")
    nodes: list[list] = []
    for m in members:
        if nodes and nodes[-1][0] == (m.host, m.device_type):
            nodes[-1][1] += 1
        else:
            nodes.append([(m.host, m.device_type), 1])
    data = dict(fleet.to_dict(), name=f"{fleet.name}-present",
                nodes=[{"type": t, "devices_per_node": n, "count": 1} for (_, t), n in nodes])
    return Cluster.from_dict(data)


def membership(members) -> list[list]:
    """[host, device type, ranks] per node of :func:`present_cluster`, for the record."""
    out: list[list] = []
    for m in sorted(members, key=lambda m: m.rank):
        if out and out[-1][:2] == [m.host, m.device_type]:
            out[-1][2] += 1
        else:
            out.append([m.host, m.device_type, 1])
    return out


def made_for(request: PlanRequest, members) -> tuple[dict, str]:
    """What a plan is made for ({"membership", "request"}, recorded in
    ``plan.search["startup"]``) and its short name: the file of :data:`PLANS_DIR` holding
    its plan.  The name is of the set of nodes, not of their rank order: the same devices
    admitted in another order by a rendezvous find the same file.  The request's
    identity reads the fleet file: call it once per start."""
    made = {"membership": membership(members), "request": request.identity()}
    key = {"membership": sorted(made["membership"]), "request": made["request"]}
    return made, hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def stored_plan(save: str | None, made: dict, key: str, cluster=None):
    """The plan in ``save`` made for ``made`` (:func:`made_for`), or None.  A plan made for
    the same nodes in another rank order has its ranks moved to where those nodes are now
    (:func:`moved_ranks`) and ``cluster`` (the present one) as its cluster."""
    from eth.spec.plan import load_plan

    path = Path(save) / PLANS_DIR / f"{key}.json" if save is not None else None
    if path is None or not path.exists():
        return None
    try:
        plan = load_plan(path)
    except (SpecError, ValueError, OSError):
        return None
    startup = plan.search.get("startup") or {}
    if startup == made:
        return plan
    if (cluster is None or plan.search.get("fleet")   # a fleet's nodes are chosen in rank order: search again
            or startup.get("request") != made["request"]
            or sorted(startup.get("membership") or []) != sorted(made["membership"])):
        return None
    return moved_ranks(plan, startup["membership"], made, cluster)


def moved_ranks(plan, before: list[list], made: dict, cluster):
    """``plan``, made for the nodes ``before`` ([host, type, ranks] in rank order), on the
    same nodes in the order of ``made["membership"]``: each node's k-th rank becomes the
    k-th rank of the same node now (nodes of one host and type paired in order), the
    stages otherwise unchanged, ``cluster`` its cluster; the prediction stands (the same
    devices and links)."""
    from dataclasses import replace

    from eth.spec.plan import Plan

    def ranges(nodes):
        out, start = {}, 0
        for host, device_type, n in nodes:
            out.setdefault((host, device_type, n), []).append(range(start, start + n))
            start += n
        return out

    now = ranges(made["membership"])
    moved = {}
    for node, old in ranges(before).items():
        for was, new in zip(old, now[node]):
            moved.update(zip(was, new))
    pipelines = [replace(p, stages=[replace(st, ranks=[moved[r] for r in st.ranks]) for st in p.stages])
                 for p in plan.pipelines]
    search = dict(plan.search, startup=made)
    return Plan(plan.model, cluster, plan.gbs, pipelines, dict(plan.predicted), search, plan.version,
                plan.training).validate()


def plan_for(request: PlanRequest, members, save: str | None):
    """Rank 0's part: the stored plan or a new search (module docstring, steps 2-3);
    returns (plan, reused, the membership of the previous start or None, iterations lost)."""
    from eth.spec.cluster import load_cluster

    cluster = present_cluster(load_cluster(request.cluster), members)
    made, key = made_for(request, members)
    plan = stored_plan(save, made, key, cluster)
    reused = plan is not None
    if plan is None:
        plan = search_for(request, cluster)
        plan.search["startup"] = made
        if save is not None:
            (Path(save) / PLANS_DIR).mkdir(parents=True, exist_ok=True)
            plan.save(Path(save) / PLANS_DIR / f"{key}.json")
    before = read_history(save) if save is not None else []
    previous = before[-1]["membership"] if before else None
    resumes, lost = resume_point(save)
    if save is not None:
        plan.save(Path(save) / PLAN_FILE)
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "membership": made["membership"],
                "predicted_ms": round(plan.predicted["iteration_ms"], 3), "reused": reused,
                "plan": f"{PLANS_DIR}/{key}.json", "resumes_at": resumes, "lost": lost}
        with (Path(save) / HISTORY_FILE).open("a") as fh:
            fh.write(json.dumps(line) + "\n")
    return plan, reused, previous, lost


def resume_point(save: str | None) -> tuple[int | None, int | None]:
    """(iteration of the newest intact checkpoint in ``save``, iterations the last run
    completed beyond it by :data:`PROGRESS_FILE`); None where unknown."""
    from megatron.hpp.training.checkpoint import find

    if save is None or not Path(save).is_dir():
        return None, None
    at = find(save).iteration
    try:
        reached = json.loads((Path(save) / PROGRESS_FILE).read_text())["iteration"]
    except (OSError, ValueError, KeyError, TypeError):
        reached = None
    if at is None or reached is None:
        return at, None
    return at, max(0, reached - at)


def record_progress(save: str, iteration: int) -> None:
    """Rank 0, after each iteration of a run planned at start-up (:data:`PROGRESS_FILE`)."""
    from eth.fileio import atomic_write_text

    atomic_write_text(Path(save) / PROGRESS_FILE, json.dumps({"iteration": iteration}) + "\n")


def search_for(request: PlanRequest, cluster):
    from eth.planner.job import plan_job
    from eth.planner.options import SearchOptions
    from eth.spec.model_source import apply_overrides, load_model
    from eth.spec.precision import TrainSetup

    model = apply_overrides(load_model(request.model, request.model_overrides.get("seq_length")),
                            request.model_overrides)
    options = SearchOptions(gbs=request.gbs, time_limit=request.time_limit, progress=False,
                            setup=TrainSetup(request.precision, request.zero_stage, request.grad_reduce))
    fleet = None
    if request.objective:
        fleet = FleetOptions(request.objective, min_throughput=request.min_throughput,
                             max_cost_per_hour=request.max_cost_per_hour)
        cluster = merged_nodes(cluster)
    return plan_job(model, cluster, request.profiles, options, flag="--hpp-profiles",
                    instead="or drop --hpp-profiles (analytic estimates)", fleet=fleet)


def merged_nodes(cluster):
    """``cluster`` (one node group per node, :func:`present_cluster`) with runs of alike
    consecutive nodes in one group each: the same ranks, and the fleet choice weighs how
    many of a run to use instead of each node on its own."""
    from dataclasses import replace

    groups = []
    for g in cluster.nodes:
        if groups and replace(groups[-1], count=1) == replace(g, count=1):
            groups[-1] = replace(groups[-1], count=groups[-1].count + g.count)
        else:
            groups.append(g)
    return replace(cluster, nodes=groups, types=dict(cluster.types), zone_links=list(cluster.zone_links))


def kept_ranks(plan, world: int) -> list[int]:
    """The ranks started (0 .. ``world`` - 1) that ``plan`` uses, in its rank order: every
    rank when the plan has no fleet record, else the first ``used`` nodes of each node
    group (``plan.search.fleet.groups``, in the order of the ranks started)."""
    groups = (plan.search.get("fleet") or {}).get("groups")
    if not groups or plan.world_size == world:
        return list(range(world))
    kept, start = [], 0
    for g in groups:
        kept += range(start, start + g["used"] * g["devices_per_node"])
        start += g["available"] * g["devices_per_node"]
    return kept


_STORE = []
"""The rendezvous store of the ranks a plan keeps (:func:`regroup`), served by their first
rank's process for as long as it lives."""


def regroup(plan, rank: int) -> bool:
    """Collective over the default group of every rank started: when ``plan`` leaves ranks
    out (:func:`kept_ranks`), the group is torn down, the ranks left out return False (they
    exit), and the ones kept are numbered as the plan numbers them (RANK, WORLD_SIZE) with a
    new rendezvous store served by the first of them (MASTER_ADDR, MASTER_PORT; the launcher's
    agent store flag on, so the default group joins it as a client); the training loop
    then starts its default group as usual.  True: this rank trains."""
    import torch.distributed as dist

    world = dist.get_world_size()
    kept = kept_ranks(plan, world)
    if len(kept) == world:
        return True
    where = None
    if rank == kept[0]:
        addr = _reachable_address()
        store = dist.TCPStore(addr, 0, len(kept), True, wait_for_workers=False)
        _STORE.append(store)
        where = (addr, store.port)
    found = [None] * world
    dist.all_gather_object(found, where)
    dist.destroy_process_group()
    if rank not in kept:
        return False
    os.environ.update(RANK=str(kept.index(rank)), WORLD_SIZE=str(len(kept)), MASTER_ADDR=found[kept[0]][0],
                      MASTER_PORT=str(found[kept[0]][1]), TORCHELASTIC_USE_AGENT_STORE="True")
    return True


def _reachable_address() -> str:
    """This host's address on the route to the launcher's MASTER_ADDR (the loopback
    address when that is this host)."""
    import socket

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(master), 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def startup_plan(request: PlanRequest, save: str | None, rank: int, device_name: str | None = None):
    """Collective over the default group (module docstring): every rank returns the same
    plan, or raises the same SpecError."""
    import torch.distributed as dist

    from eth.spec.cluster import load_cluster
    from eth.spec.plan import Plan

    me = local_member(load_cluster(request.cluster), rank, device_name)
    members = [None] * dist.get_world_size()
    dist.all_gather_object(members, me)
    payload = [None]
    if rank == 0:
        failure = None
        try:
            plan, reused, previous, lost = plan_for(request, members, save)
            payload[0] = ("plan", plan.to_dict(), (reused, previous, lost))
        except SpecError as exc:
            payload[0] = ("error", str(exc), False)
        except Exception as exc:             # the other ranks must not wait for a plan that never comes
            payload[0], failure = ("crash", f"{type(exc).__name__}: {exc}", False), exc
        if failure is not None:
            dist.broadcast_object_list(payload, src=0)
            raise failure
    dist.broadcast_object_list(payload, src=0)
    kind, value, extra = payload[0]
    if kind == "error":
        raise SpecError(value)
    if kind == "crash":
        raise RuntimeError(f"planning at start-up failed on rank 0 ({value})")
    plan = Plan.from_dict(value)
    if rank == 0:
        reused, previous, lost = extra
        how = "the stored plan for this membership" if reused else "a new plan"
        now = membership(members)
        change = "" if previous in (None, now) else f" (the last start had {describe_membership(previous)})"
        gone = "" if lost is None else f"; {lost} iteration(s) since the last checkpoint lost"
        print(f"plan at start-up: {how}, {describe_membership(now)}{change}, predicted "
              f"{plan.predicted['iteration_ms']:.1f} ms per iteration{gone}", flush=True)
        from eth.report.tables import format_ranks

        kept = kept_ranks(plan, len(members))
        if len(kept) < len(members):
            out = sorted(set(range(len(members))) - set(kept))
            print(f"plan at start-up: the fleet choice ({plan.search['fleet']['objective']}) uses "
                  f"{len(kept)} of {len(members)} ranks; ranks {format_ranks(out)} are left out and exit", flush=True)
    return plan


def plan_at_startup(request: PlanRequest, save: str | None, timeout_minutes: float):
    """The default group (the launcher's RANK / WORLD_SIZE / MASTER_*), then
    :func:`startup_plan` for the ranks present and :func:`regroup`: returns (the plan,
    whether this rank trains it)."""
    from megatron.hpp import compat
    from megatron.hpp.parallel.launch import env_int, init_default_group

    world, rank = env_int("WORLD_SIZE", 1), env_int("RANK", 0)
    if world > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise SpecError(f"WORLD_SIZE {world} needs MASTER_ADDR and MASTER_PORT (torchrun sets them)")
    backend = compat.select_backend(env_int("LOCAL_RANK", 0))
    init_default_group(backend.name, rank, world, timeout_minutes)
    plan = startup_plan(request, save, rank, compat.device_name(backend))
    return plan, regroup(plan, rank)
