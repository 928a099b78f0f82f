"""How the launcher started the ranks: their environment (:func:`env_int`), the default
process group (:func:`init_default_group`), and the start-up check that they were
placed where the plan expects them.

A plan's global ranks follow its cluster's device order, node-major: the cluster YAML's
node groups in order, every node's devices consecutively (eth/spec/cluster.py).  torchrun
numbers ranks by node rank (``--node-rank`` or the rendezvous order) times
``--nproc-per-node`` plus the local rank.  If the hosts join in another order than the
YAML lists the node types, the A100 stages land on the RTX 3090s: training still runs,
but at the speed of the wrong plan.  :func:`check_rank_order` (pure, no torch) compares
every rank's host with the plan's node layout; :func:`gather_hosts` collects the hosts
(one ``all_gather_object``).  Rules:

* the ranks of one host are consecutive (each host one contiguous block);
* no cluster node is split over hosts (a node's ranks all on one host);
* one host may hold several consecutive whole nodes (a single machine emulating a
  cluster, as the CPU demo does);
* on each host, LOCAL_RANK counts up by one in rank order, from 0 (from where the ranks start
  when a fleet choice left the first ones of a host out); local rank i drives device i.

The device *type* of each rank is compared with the plan separately (a warning in
megatron.hpp.parallel.topology.build_topology).

Launch helper (examples/slurm/), pure Python:

    python -m megatron.hpp.parallel.launch order --plan plan.json --hosts h1,h2,h3
        # which ranks and device type each host gets; error unless one host per node
    eval "$(python -m megatron.hpp.parallel.launch node --plan plan.json --hosts h1,h2,h3)"
        # NNODES, NODE_RANK, NPROC_PER_NODE, WORLD_SIZE of this host for torchrun
"""
from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import Sequence

from eth.errors import SpecError


@dataclass(frozen=True)
class RankHost:
    rank: int
    """Global rank (RANK)."""
    host: str
    """Host name of the process."""
    local_rank: int
    """LOCAL_RANK (the device index on its host)."""


def _span(ranks) -> str:
    ranks = sorted(ranks)
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}" \
        if ranks[-1] - ranks[0] == len(ranks) - 1 else ",".join(map(str, ranks))


def host_blocks(hosts: Sequence[RankHost]) -> list[tuple[str, list[int]]]:
    """Consecutive runs of ranks on one host, in rank order."""
    blocks: list[tuple[str, list[int]]] = []
    for h in sorted(hosts, key=lambda h: h.rank):
        if blocks and blocks[-1][0] == h.host:
            blocks[-1][1].append(h.rank)
        else:
            blocks.append((h.host, [h.rank]))
    return blocks


def check_rank_order(cluster, hosts: Sequence[RankHost], where: str = "the plan's cluster") -> None:
    """Raise SpecError (one line, numbers named) unless ``hosts`` place the ranks as the
    node-major order of ``cluster`` (an eth.spec.cluster.Cluster) expects (module docstring)."""
    world = len(hosts)
    ranks = sorted(h.rank for h in hosts)
    if ranks != list(range(world)):
        raise SpecError(f"ranks reported at start-up are {_span(ranks)}, expected 0-{world - 1}")
    if world > cluster.world_size:
        raise SpecError(f"WORLD_SIZE is {world}, {where} has {cluster.world_size} devices")
    seen: dict[str, list[int]] = {}
    for host, block in host_blocks(hosts):
        if host in seen:
            raise SpecError(f"host {host} holds ranks {_span(seen[host])} and {_span(block)}: a host's "
                            f"ranks must be consecutive (node-major order, one torchrun per host)")
        seen[host] = block
    by_rank = {h.rank: h for h in hosts}
    nodes: dict[int, list[int]] = {}
    for dev in cluster.devices[:world]:
        nodes.setdefault(dev.node, []).append(dev.rank)
    for node, node_ranks in nodes.items():
        on = {}
        for r in node_ranks:
            on.setdefault(by_rank[r].host, []).append(r)
        if len(on) > 1:
            dev = cluster.devices[node_ranks[0]]
            split = ", ".join(f"{_span(rs)} on {h}" for h, rs in on.items())
            raise SpecError(f"node {node} of {where} ({dev.type} x {len(node_ranks)}, ranks "
                            f"{_span(node_ranks)}) is split over hosts: {split}; start one torchrun "
                            f"per node with --nproc-per-node {len(node_ranks)}, nodes in the order "
                            f"the cluster YAML lists them")
    for host, block in seen.items():   # from 0, or from where the ranks a fleet kept start
        local = [by_rank[r].local_rank for r in block]
        first = min(local)
        if local != list(range(first, first + len(block))):
            raise SpecError(f"host {host}: ranks {_span(block)} have LOCAL_RANK {local}, expected "
                            f"{first}-{first + len(block) - 1} in rank order")


def expected_node_order(cluster) -> list[str]:
    """One line per node: which ranks and device type it must hold (for launch scripts)."""
    lines, nodes = [], {}
    for dev in cluster.devices:
        nodes.setdefault(dev.node, []).append(dev)
    for node, devs in nodes.items():
        lines.append(f"node {node}: {devs[0].type} x {len(devs)}, ranks {devs[0].rank}-{devs[-1].rank}")
    return lines


def env_int(name: str, default: int = 0) -> int:
    """The integer environment variable ``name`` the launcher set (``default`` when unset);
    SpecError when it is not an integer."""
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"environment {name}={value!r} is not an integer") from None


def init_default_group(backend_name: str, rank: int, world: int, timeout_minutes: float) -> None:
    """The default process group with the run's timeout.  A one-rank run without
    MASTER_ADDR/MASTER_PORT (``python pretrain_gpt.py`` without torchrun) gets an
    in-process store: no port is opened, so none can be busy."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(minutes=timeout_minutes)
    if world == 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        dist.init_process_group(backend_name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend_name, rank=rank, world_size=world, timeout=timeout)


def local_host(rank: int | None = None) -> RankHost:
    """This process as torchrun started it (``rank`` or RANK, LOCAL_RANK, host name: the
    launch scripts' HPP_HOST when set, as examples/slurm/node.sh names its node, else
    the machine's host name)."""
    host = os.environ.get("HPP_HOST") or socket.gethostname()
    return RankHost(env_int("RANK") if rank is None else rank, host, env_int("LOCAL_RANK"))


def gather_hosts(group=None) -> list[RankHost]:
    """Every rank's :class:`RankHost` (collective over the default group)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local_host(dist.get_rank()), group=group)
    return out


def check_launch(cluster) -> None:
    """Collective start-up check: gather the hosts, raise the same SpecError on every rank
    when they do not match ``cluster``'s node-major order."""
    check_rank_order(cluster, gather_hosts())


def node_assignment(cluster, hosts: Sequence[str]) -> list[tuple[str, int, int, str]]:
    """(host, node rank, processes, device type) per cluster node, hosts in YAML node order."""
    per_node: dict[int, list] = {}
    for dev in cluster.devices:
        per_node.setdefault(dev.node, []).append(dev)
    if len(hosts) != len(per_node):
        raise SpecError(f"--hosts names {len(hosts)} hosts, the plan's cluster has {len(per_node)} nodes "
                        f"({', '.join(expected_node_order(cluster))})")
    if len(set(hosts)) != len(hosts):
        raise SpecError(f"--hosts names a host twice: {','.join(hosts)}")
    return [(h, n, len(devs), devs[0].type) for h, (n, devs) in zip(hosts, sorted(per_node.items()))]


def fleet_hosts(plan, hosts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the hosts the plan uses, the hosts it leaves out) of ``hosts`` given in the node
    order of the cluster file the plan's fleet was chosen from (``plan.search["fleet"]``:
    the first ``used`` nodes of each node group); ``hosts`` unchanged when they are as many
    as the plan's own nodes."""
    groups = (plan.search.get("fleet") or {}).get("groups")
    nodes = len({d.node for d in plan.cluster.devices})
    if not groups or len(hosts) == nodes or len(hosts) != sum(g["available"] for g in groups):
        return list(hosts), []
    used, out, at = [], [], 0
    for g in groups:
        used += hosts[at:at + g["used"]]
        out += hosts[at + g["used"]:at + g["available"]]
        at += g["available"]
    return used, out


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron.hpp.parallel.launch", allow_abbrev=False,
                                 description="Rank placement of a plan over hosts (see the module docstring).")
    ap.add_argument("what", choices=("order", "node"))
    ap.add_argument("--plan", required=True, help="plan JSON")
    ap.add_argument("--hosts", required=True, help="comma-separated hosts, in the cluster YAML's node order")
    ap.add_argument("--host", default=None, help="this host (node: default socket.gethostname())")
    args = ap.parse_args(argv)
    from eth.spec.plan import load_plan

    plan = load_plan(args.plan)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    hosts, left_out = fleet_hosts(plan, hosts)
    rows = node_assignment(plan.cluster, hosts)
    if args.what == "order":
        first = 0
        for host, node, nproc, dtype in rows:
            print(f"{host}: node {node}, {dtype} x {nproc}, ranks {first}-{first + nproc - 1}")
            first += nproc
        for host in left_out:
            print(f"{host}: not in the plan (its fleet leaves the node out)")
        return 0
    me = args.host or socket.gethostname()

    def same(host):
        return host == me or host.split(".")[0] == me.split(".")[0]

    mine = [r for r in rows if same(r[0])]
    if not mine and any(same(h) for h in left_out):
        print(f"HPP_LEFT_OUT=1 NNODES={len(rows)} NODE_RANK=-1 NPROC_PER_NODE=0 "
              f"WORLD_SIZE={plan.cluster.world_size} MASTER_HOST={rows[0][0]}")
        return 0
    if not mine:
        raise SpecError(f"host {me} is not in --hosts {','.join(hosts + left_out)}")
    _, node, nproc, _ = mine[0]
    print(f"HPP_LEFT_OUT=0 NNODES={len(rows)} NODE_RANK={node} NPROC_PER_NODE={nproc} "
          f"WORLD_SIZE={plan.cluster.world_size} MASTER_HOST={rows[0][0]}")
    return 0


def main(argv=None) -> int:
    from eth.cli.common import run_main

    return run_main(_main, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
