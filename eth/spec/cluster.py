"""Device catalog and cluster specification.

A cluster YAML lists groups of identical nodes; global ranks follow the listed
order, node-major (rank = devices of all earlier nodes + local index)::

    version: 1
    name: b2b4-64
    inter_node_gbps: 200      # between nodes of the same device type
    inter_type_gbps: 100      # between nodes of different types (default: inter_node_gbps)
    intra_node_gbps: 1536     # optional; default: each type's catalog link_gbps
    device_types:             # optional: override catalog fields or define new types
      910B4: {memory_gb: 32}
      cpu-slow: {base: cpu, emulate_speed: 0.25}
    nodes:
      - {type: 910B2, devices_per_node: 8, count: 4}
      - {type: 910B4, devices_per_node: 8, count: 4, nic_gbps: 400}   # optional: one card per node

``nic_gbps`` (optional, per node group) is a node's network card, shared by its devices
that talk to other nodes at the same time (:meth:`Cluster.link_gbps`); a device type may
carry ``overhead_gb``, the memory a rank holds beyond its tensors (driver context,
communicator buffers, the allocator's cache), which the cost model adds to every stage.

``emulate_speed`` (CPU runs only) tells the runtime to stretch the compute of ranks
of that type by 1/emulate_speed, so heterogeneity can be shown on one machine.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from types import MappingProxyType

import yaml

from eth.errors import SpecError, is_count, is_number
from eth.fileio import read_yaml

CLUSTER_VERSION = 1


MAX_DEVICES = 1 << 17
"""The most devices a cluster file may hold (131072: 32x the largest cluster the planner
is measured on, docs/EVALUATION.md "Search time"): one Device object per rank, and the
planner's work grows with them."""


@dataclass(frozen=True)
class DeviceType:
    """Facts about one accelerator type, as the planner sees it."""

    name: str
    tflops: float
    """Dense fp16/bf16 peak, TFLOP/s."""
    memory_gb: float
    """Device memory, GB (10^9 bytes)."""
    link_gbps: float
    """Intra-node interconnect per device, Gbit/s."""
    mem_bw_gbs: float
    """Memory bandwidth, GB/s (used for memory-bound ops in analytic profiles)."""
    source: str = ""
    """Where the numbers come from."""
    emulate_speed: float = 0.0
    """CPU emulation only: relative speed (1 = native); 0 = no emulation."""
    overhead_gb: float = 0.0
    """Device memory every rank holds beyond its tensors, GB: the driver context, the
    communicators' buffers, the allocator's cached blocks (what ``nvidia-smi`` shows
    above the tensors).  The cost model adds it to every stage's memory."""

    def __post_init__(self):
        for name in ("tflops", "memory_gb", "link_gbps", "mem_bw_gbs"):
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise SpecError(f"device type {self.name}: {name} must be a positive number, got {value!r}")
        if not is_number(self.overhead_gb) or not 0 <= self.overhead_gb < self.memory_gb:
            raise SpecError(f"device type {self.name}: overhead_gb must be >= 0 and below memory_gb "
                            f"{self.memory_gb}, got {self.overhead_gb!r}")
        if not is_number(self.emulate_speed) or self.emulate_speed < 0:
            raise SpecError(f"device type {self.name}: emulate_speed must be >= 0, got {self.emulate_speed!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def overhead_bytes(self) -> float:
        return self.overhead_gb * 1e9


_TYPE_FIELDS = {f.name for f in fields(DeviceType)} - {"name"}
_OPTIONAL_ZERO = ("overhead_gb",)
"""Fields a resolved cluster leaves out at 0 (so that plans written before they existed
keep their hash)."""


@functools.lru_cache(maxsize=1)
def catalog() -> MappingProxyType:
    """The shipped device catalog (eth/data/devices.yaml), read-only."""
    text = resources.files("eth").joinpath("data/devices.yaml").read_text()
    data = yaml.safe_load(text)
    return MappingProxyType({name: DeviceType(name=name, **entry) for name, entry in data["devices"].items()})


@dataclass(frozen=True)
class NodeGroup:
    type: str
    devices_per_node: int
    count: int = 1
    nic_gbps: float = 0.0
    """Network card bandwidth of one node, shared by all its devices that communicate
    with other nodes at once (Gbit/s); 0: no shared limit (each device has the cluster's
    inter-node bandwidth of its own)."""


@dataclass(frozen=True)
class Device:
    rank: int
    node: int
    local: int
    type: str


@dataclass
class Cluster:
    """A validated cluster: node groups, device types and bandwidths."""

    name: str
    nodes: list[NodeGroup]
    types: dict[str, DeviceType]
    inter_node_gbps: float
    inter_type_gbps: float = 0.0
    intra_node_gbps: float = 0.0
    devices: list[Device] = field(init=False, repr=False)

    def __post_init__(self):
        if not self.nodes:
            raise SpecError("cluster.nodes is empty")
        if self.inter_type_gbps == 0.0:
            self.inter_type_gbps = self.inter_node_gbps
        for key in ("inter_node_gbps", "inter_type_gbps", "intra_node_gbps"):
            value = getattr(self, key)
            if not is_number(value) or value < 0 or (value == 0 and key != "intra_node_gbps"):
                raise SpecError(f"cluster.{key} must be a positive number, got {value!r}")
        devices, node = [], 0
        for i, group in enumerate(self.nodes):
            if group.type not in self.types:
                raise SpecError(f"cluster.nodes[{i}].type {group.type!r} is not in the device catalog "
                                f"or cluster.device_types (known: {', '.join(sorted(self.types))})")
            for key in ("devices_per_node", "count"):
                value = getattr(group, key)
                if not is_count(value):
                    raise SpecError(f"cluster.nodes[{i}].{key} must be a positive integer, got {value!r}")
            if not is_number(group.nic_gbps) or group.nic_gbps < 0:
                raise SpecError(f"cluster.nodes[{i}].nic_gbps must be a positive number (Gbit/s), "
                                f"got {group.nic_gbps!r}")
            if len(devices) + group.count * group.devices_per_node > MAX_DEVICES:
                raise SpecError(f"cluster.nodes[{i}] ({group.count} x {group.devices_per_node} {group.type}) takes "
                                f"the cluster to {len(devices) + group.count * group.devices_per_node} devices; "
                                f"at most {MAX_DEVICES} are supported")
            for _ in range(group.count):
                for local in range(group.devices_per_node):
                    devices.append(Device(len(devices), node, local, group.type))
                node += 1
        self.devices = devices
        self.nic_gbps = [g.nic_gbps for g in self.nodes for _ in range(g.count)]
        """Network card bandwidth of every node (0: none shared), by node index."""
        self.types = {name: t for name, t in self.types.items() if name in {g.type for g in self.nodes}}

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def type_of(self, rank: int) -> DeviceType:
        return self.types[self.devices[rank].type]

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for d in self.devices:
            counts[d.type] = counts.get(d.type, 0) + 1
        return counts

    def link_gbps(self, ranks) -> float:
        """Bandwidth of the slowest link a collective over ``ranks`` crosses (Gbit/s): the
        intra-node link inside one node; between nodes the inter-node (one type) or
        inter-type bandwidth, and at most a node's ``nic_gbps`` shared by the set's ranks
        on that node."""
        ranks = list(ranks)
        nodes = {self.devices[r].node for r in ranks}
        if len(nodes) <= 1:
            kind = self.type_of(ranks[0])
            return self.intra_node_gbps or kind.link_gbps
        gbps = self.inter_node_gbps if len({self.devices[r].type for r in ranks}) == 1 else self.inter_type_gbps
        if any(self.nic_gbps[n] for n in nodes):
            # every rank of the set on a node streams through that node's card at once
            # (the tp shards of a gradient block are reduced concurrently)
            on = {}
            for r in ranks:
                on[self.devices[r].node] = on.get(self.devices[r].node, 0) + 1
            gbps = min([gbps] + [self.nic_gbps[n] / k for n, k in on.items() if self.nic_gbps[n]])
        return gbps

    def to_dict(self) -> dict:
        """Self-contained form (device types resolved); embedded in plans."""
        return {
            "version": CLUSTER_VERSION,
            "name": self.name,
            "inter_node_gbps": self.inter_node_gbps,
            "inter_type_gbps": self.inter_type_gbps,
            "intra_node_gbps": self.intra_node_gbps,
            "device_types": {n: {k: v for k, v in asdict(t).items()
                                 if k != "name" and not (k in _OPTIONAL_ZERO and v == 0)}
                             for n, t in sorted(self.types.items())},
            "nodes": [{k: v for k, v in asdict(g).items() if not (k == "nic_gbps" and v == 0)}
                      for g in self.nodes],
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "cluster") -> "Cluster":
        if not isinstance(data, dict):
            raise SpecError(f"{where} must be a mapping, got {type(data).__name__}")
        known = {"version", "name", "inter_node_gbps", "inter_type_gbps", "intra_node_gbps",
                 "device_types", "nodes"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"{where} has unknown field(s) {unknown}; known: {sorted(known)}")
        version = data.get("version", CLUSTER_VERSION)
        if version != CLUSTER_VERSION:
            raise SpecError(f"{where}.version is {version}, this release reads version {CLUSTER_VERSION}")
        if "inter_node_gbps" not in data:
            raise SpecError(f"{where}.inter_node_gbps is missing")
        types = dict(catalog())
        for name, entry in (data.get("device_types") or {}).items():
            if not isinstance(entry, dict):
                raise SpecError(f"{where}.device_types.{name} must be a mapping")
            entry = dict(entry)
            base_name = entry.pop("base", name)
            bad = sorted(set(entry) - _TYPE_FIELDS)
            if bad:
                raise SpecError(f"{where}.device_types.{name} has unknown field(s) {bad}; "
                                f"known: {sorted(_TYPE_FIELDS | {'base'})}")
            if base_name in types:
                types[name] = replace(types[base_name], name=name, **entry)
            else:
                missing = sorted({"tflops", "memory_gb", "link_gbps", "mem_bw_gbs"} - set(entry))
                if missing:
                    raise SpecError(f"{where}.device_types.{name} is not in the catalog and lacks {missing}")
                types[name] = DeviceType(name=name, **entry)
        nodes_raw = data.get("nodes")
        if not isinstance(nodes_raw, list):
            raise SpecError(f"{where}.nodes must be a list of {{type, devices_per_node, count}}")
        nodes = []
        for i, entry in enumerate(nodes_raw):
            if not isinstance(entry, dict) or "type" not in entry or "devices_per_node" not in entry:
                raise SpecError(f"{where}.nodes[{i}] needs type and devices_per_node, got {entry!r}")
            bad = sorted(set(entry) - {"type", "devices_per_node", "count", "nic_gbps"})
            if bad:
                raise SpecError(f"{where}.nodes[{i}] has unknown field(s) {bad}; known: count, "
                                f"devices_per_node, nic_gbps, type")
            nodes.append(NodeGroup(str(entry["type"]), entry["devices_per_node"], entry.get("count", 1),
                                   entry.get("nic_gbps", 0.0)))
        return cls(name=str(data.get("name", "cluster")), nodes=nodes, types=types,
                   inter_node_gbps=data["inter_node_gbps"],
                   inter_type_gbps=data.get("inter_type_gbps", 0.0),
                   intra_node_gbps=data.get("intra_node_gbps", 0.0) or 0.0)


def load_cluster(path) -> Cluster:
    """Read and validate a cluster YAML file."""
    path = Path(path)
    data = read_yaml(path, "cluster")
    for name, entry in ((data or {}).get("device_types") or {}).items() if isinstance(data, dict) else ():
        if isinstance(entry, dict) and "emulate_speed" in entry and entry["emulate_speed"] == 0:
            # 0 is the field's "not emulated" default: written out, it is a typo or a misunderstanding,
            # and a CPU type would then be planned and trained as a device of its own, not emulated
            raise SpecError(f"cluster {path.name}: device_types.{name}.emulate_speed is 0; an emulated type "
                            f"runs at a fraction of one core, e.g. 0.25 (leave the field out to not emulate)")
    cluster = Cluster.from_dict(data, where=f"cluster {path.name}")
    if cluster.name == "cluster":
        cluster.name = path.stem
    return cluster
