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

Fleet fields (``eth.planner.fleet`` chooses which of the listed devices a plan uses):
a device type may carry ``price_per_hour`` (USD per device-hour) and a node group its own
(a zone's price); a node group's ``count`` is what is available; a node group may carry a
``zone``, and links between zones are ``inter_zone_gbps`` / ``egress_usd_per_gb`` (every
pair) or ``zone_links`` (one pair each)::

    device_types: {A100: {price_per_hour: 3.67}}
    nodes:
      - {type: A100, devices_per_node: 4, count: 8, zone: us-central1-a}
      - {type: A100, devices_per_node: 4, count: 8, zone: us-west1-b, price_per_hour: 3.75}
    inter_zone_gbps: 10
    egress_usd_per_gb: 0.01
    zone_links:
      - {zones: [us-central1-a, us-west1-b], gbps: 5, egress_usd_per_gb: 0.02}

``emulate_speed`` (CPU runs only) tells the runtime to stretch the compute of ranks
of that type by 1/emulate_speed, so heterogeneity can be shown on one machine.
"""
from __future__ import annotations

import functools
import itertools
import math
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
    price_per_hour: float = 0.0
    """USD per device-hour (0: not given; a cost objective then names the type)."""

    def __post_init__(self):
        for name in ("tflops", "memory_gb", "link_gbps", "mem_bw_gbs"):
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise SpecError(f"device type {self.name}: {name} must be a positive number, got {value!r}")
        if not is_number(self.overhead_gb) or not 0 <= self.overhead_gb < self.memory_gb:
            raise SpecError(f"device type {self.name}: overhead_gb must be >= 0 and below memory_gb "
                            f"{self.memory_gb}, got {self.overhead_gb!r}")
        if not is_number(self.price_per_hour) or not 0 <= self.price_per_hour < math.inf:
            raise SpecError(f"device type {self.name}: price_per_hour must be a number of USD >= 0, "
                            f"got {self.price_per_hour!r}")
        if not is_number(self.emulate_speed) or self.emulate_speed < 0:
            raise SpecError(f"device type {self.name}: emulate_speed must be >= 0, got {self.emulate_speed!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def overhead_bytes(self) -> float:
        return self.overhead_gb * 1e9


_TYPE_FIELDS = {f.name for f in fields(DeviceType)} - {"name"}
_OPTIONAL_ZERO = ("overhead_gb", "price_per_hour")
_NODE_OPTIONAL = ("nic_gbps", "zone", "price_per_hour")
"""Fields a resolved cluster leaves out at 0 (so that plans written before they existed
keep their hash); likewise a node group's optional fields."""


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
    zone: str = ""
    """Where the nodes are (a cloud zone, a site); "" = the cluster's one zone."""
    price_per_hour: float = 0.0
    """USD per device-hour of these nodes (0: the device type's ``price_per_hour``)."""


@dataclass(frozen=True)
class ZoneLink:
    """The network between two zones: bandwidth and what a GB sent across costs."""

    zones: tuple[str, str]
    gbps: float
    egress_usd_per_gb: float = 0.0


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
    inter_zone_gbps: float = 0.0
    """Between nodes of different zones, every pair not in :attr:`zone_links` (0: none given;
    needed when the nodes lie in more than one zone and a pair is not listed)."""
    egress_usd_per_gb: float = 0.0
    """USD per GB sent between zones, every pair not in :attr:`zone_links`."""
    zone_links: list[ZoneLink] = field(default_factory=list)
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
        self.zones = [g.zone for g in self.nodes for _ in range(g.count)]
        """Zone of every node, by node index."""
        self._check_zones()
        self.types = {name: t for name, t in self.types.items() if name in {g.type for g in self.nodes}}

    def _check_zones(self) -> None:
        for key in ("inter_zone_gbps", "egress_usd_per_gb"):
            value = getattr(self, key)
            if not is_number(value) or not 0 <= value < math.inf:
                raise SpecError(f"cluster.{key} must be a number >= 0, got {value!r}")
        for i, group in enumerate(self.nodes):
            if not isinstance(group.zone, str):
                raise SpecError(f"cluster.nodes[{i}].zone must be a name, got {group.zone!r}")
            if not is_number(group.price_per_hour) or not 0 <= group.price_per_hour < math.inf:
                raise SpecError(f"cluster.nodes[{i}].price_per_hour must be a number of USD >= 0, "
                                f"got {group.price_per_hour!r}")
        named = [i for i, g in enumerate(self.nodes) if g.zone]
        if named and len(named) < len(self.nodes):
            i = next(i for i, g in enumerate(self.nodes) if not g.zone)
            raise SpecError(f"cluster.nodes[{i}] has no zone while nodes[{named[0]}] is in "
                            f"{self.nodes[named[0]].zone!r}: give every node group a zone, or none")
        self._zone_links = {}
        for i, link in enumerate(self.zone_links):
            a, b = link.zones
            if a == b or (a, b) in self._zone_links:
                raise SpecError(f"cluster.zone_links[{i}].zones {[a, b]} must name two different zones, "
                                f"each pair once")
            for key in ("gbps", "egress_usd_per_gb"):
                value = getattr(link, key)
                if not is_number(value) or not 0 <= value < math.inf or (key == "gbps" and value == 0):
                    raise SpecError(f"cluster.zone_links[{i}].{key} must be a {'positive ' if key == 'gbps' else ''}"
                                    f"number{'' if key == 'gbps' else ' >= 0'}, got {value!r}")
            self._zone_links[a, b] = self._zone_links[b, a] = link
        zones = sorted(set(self.zones))
        if not self.inter_zone_gbps:
            for a, b in itertools.combinations(zones, 2):
                if (a, b) not in self._zone_links:
                    raise SpecError(f"cluster: nodes lie in zones {a!r} and {b!r} with no link between them; "
                                    f"give inter_zone_gbps, or zone_links with zones [{a}, {b}]")

    def zone_link(self, a: str, b: str) -> tuple[float, float]:
        """(Gbit/s, USD per GB) between zones ``a`` and ``b`` (a != b)."""
        link = self._zone_links.get((a, b))
        if link is not None:
            return link.gbps, link.egress_usd_per_gb
        return self.inter_zone_gbps, self.egress_usd_per_gb

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def zone_of(self, rank: int) -> str:
        return self.zones[self.devices[rank].node]

    def price_of(self, rank: int) -> float:
        """USD per hour of device ``rank`` (0: no price given)."""
        return self._prices[self.devices[rank].node]

    @functools.cached_property
    def _prices(self) -> list[float]:
        return [self.group_price(g) for g in self.nodes for _ in range(g.count)]

    def group_price(self, group: NodeGroup) -> float:
        """USD per device-hour of a node group's devices: its own price, else its type's (0: none)."""
        return group.price_per_hour or self.types[group.type].price_per_hour

    def unpriced_types(self) -> list[str]:
        """The device types some of whose nodes have no price (sorted)."""
        return sorted({g.type for g in self.nodes if not self.group_price(g)})

    def devices_per_hour_usd(self) -> float:
        """USD per hour of every device of the cluster."""
        return sum(g.count * g.devices_per_node * self.group_price(g) for g in self.nodes)

    def subset(self, counts) -> "Cluster":
        """The cluster with ``counts[i]`` of node group i's nodes (the first ones; 0 drops
        the group): what a plan that leaves devices out trains on."""
        if len(counts) != len(self.nodes) or not any(counts):
            raise SpecError(f"a subset needs one node count per group ({len(self.nodes)}), not all 0; got {list(counts)}")
        nodes = []
        for i, (group, k) in enumerate(zip(self.nodes, counts)):
            if not 0 <= k <= group.count:
                raise SpecError(f"cluster.nodes[{i}] has {group.count} nodes; a subset cannot take {k}")
            if k:
                nodes.append(replace(group, count=k))
        return replace(self, nodes=nodes, types=dict(self.types), zone_links=list(self.zone_links))

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
        zones = sorted({self.zones[n] for n in nodes})
        if len(zones) > 1:   # a ring over the set crosses the slowest of its zones' links
            gbps = min([gbps] + [self.zone_link(a, b)[0] for a, b in itertools.combinations(zones, 2)])
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
            "nodes": [{k: v for k, v in asdict(g).items() if not (k in _NODE_OPTIONAL and not v)}
                      for g in self.nodes],
        } | ({"inter_zone_gbps": self.inter_zone_gbps} if self.inter_zone_gbps else {}) \
          | ({"egress_usd_per_gb": self.egress_usd_per_gb} if self.egress_usd_per_gb else {}) \
          | ({"zone_links": [{"zones": list(z.zones), "gbps": z.gbps, "egress_usd_per_gb": z.egress_usd_per_gb}
                             for z in self.zone_links]} if self.zone_links else {})

    @classmethod
    def from_dict(cls, data: dict, where: str = "cluster") -> "Cluster":
        if not isinstance(data, dict):
            raise SpecError(f"{where} must be a mapping, got {type(data).__name__}")
        known = {"version", "name", "inter_node_gbps", "inter_type_gbps", "intra_node_gbps",
                 "device_types", "nodes", "inter_zone_gbps", "egress_usd_per_gb", "zone_links"}
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
            bad = sorted(set(entry) - {"type", "devices_per_node", "count", "nic_gbps", "zone", "price_per_hour"})
            if bad:
                raise SpecError(f"{where}.nodes[{i}] has unknown field(s) {bad}; known: count, "
                                f"devices_per_node, nic_gbps, price_per_hour, type, zone")
            zone = entry.get("zone", "")
            nodes.append(NodeGroup(str(entry["type"]), entry["devices_per_node"], entry.get("count", 1),
                                   entry.get("nic_gbps", 0.0), "" if zone is None else str(zone),
                                   entry.get("price_per_hour", 0.0)))
        return cls(name=str(data.get("name", "cluster")), nodes=nodes, types=types,
                   inter_node_gbps=data["inter_node_gbps"],
                   inter_type_gbps=data.get("inter_type_gbps", 0.0),
                   intra_node_gbps=data.get("intra_node_gbps", 0.0) or 0.0,
                   inter_zone_gbps=data.get("inter_zone_gbps", 0.0),
                   egress_usd_per_gb=data.get("egress_usd_per_gb", 0.0),
                   zone_links=_zone_links(data.get("zone_links") or [], where))


def _zone_links(raw, where: str) -> list[ZoneLink]:
    """The ``zone_links`` entries of a cluster mapping (their numbers are checked by the cluster)."""
    if not isinstance(raw, list):
        raise SpecError(f"{where}.zone_links must be a list of {{zones: [a, b], gbps, egress_usd_per_gb}}")
    links = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or "zones" not in entry or "gbps" not in entry:
            raise SpecError(f"{where}.zone_links[{i}] needs zones and gbps, got {entry!r}")
        bad = sorted(set(entry) - {"zones", "gbps", "egress_usd_per_gb"})
        if bad:
            raise SpecError(f"{where}.zone_links[{i}] has unknown field(s) {bad}; known: egress_usd_per_gb, "
                            f"gbps, zones")
        zones = entry["zones"]
        if not isinstance(zones, list) or len(zones) != 2 or not all(isinstance(z, str) and z for z in zones):
            raise SpecError(f"{where}.zone_links[{i}].zones must be two zone names, got {zones!r}")
        links.append(ZoneLink((zones[0], zones[1]), entry["gbps"], entry.get("egress_usd_per_gb", 0.0)))
    return links


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
