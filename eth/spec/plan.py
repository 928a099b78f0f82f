"""The HPP plan: dataclasses, versioned JSON (de)serialisation and validation.

A plan is self-contained: it embeds the model spec and the resolved cluster, so the
runtime needs only the plan file.  JSON layout (version 1; version 2 adds a stage's ``ops``)::

    {"version": 1, "model": {...ModelSpec...}, "cluster": {...Cluster.to_dict()...},
     "gbs": 1024, "seq_len": 2048,
     "pipelines": [{"mbs": 4, "lbs": 344, "predicted": {...},
                    "stages": [{"ranks": [0, 1, 2, 3], "device_type": "910B4",
                                "tp": 4, "dp": 1, "layers": [0, 4],
                                "recompute": {"softmax": 4}, "predicted": {...}}]}],
     "training": {"precision": "bf16", "zero_stage": 1, "grad_reduce": "fp32"},
     "predicted": {"iteration_ms": ...}, "search": {...}, "hash": "..."}

``training`` (``eth.spec.precision.TrainSetup``) is what the plan's memory and All-Reduce
times were computed for and what the runtime trains with; a plan without it (written
before it existed) means fp32, ZeRO 0, fp32 gradients.

Conventions (the runtime relies on them):
  * global rank order = cluster device order (node-major);
  * inside a stage, dp replica d holds ``ranks[d * tp:(d + 1) * tp]`` (tp is the fastest
    dimension) and its tp rank t is the t-th smallest of them (``StagePlan.replica``;
    torch orders a process group by global rank);
  * pipeline i trains on samples [sum(lbs[:i]), sum(lbs[:i+1])) of each global batch;
  * ``recompute[op] = n`` recomputes ``op`` in the first n of the stage's layers that
    run ``op``.

Boundaries inside a layer (version 2): a stage's ``"ops": [first, last]`` says that it
starts in layer ``layers[0]`` at op ``first`` and ends in layer ``layers[1] - 1`` after op
``last`` (both inclusive; ``layers`` are the layers it touches).  The next stage then
starts in that same layer at the op after ``last``.  A stage without ``ops`` holds whole
layers; a plan none of whose stages has ``ops`` is written as version 1, as before.  The
tensors that cross such a boundary are ``eth.spec.model.cut_tensors``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from eth.spec.cluster import Cluster
from eth.errors import PlanError, SpecError
from eth.fileio import atomic_write_text, read_json
from eth.spec.model import ModelSpec, cut_tensors, layer_ops
from eth.spec.precision import TrainSetup

PLAN_VERSION = 2
"""The newest plan version this release reads and writes (plans without ``ops``: 1)."""
WHOLE_LAYER_VERSION = 1
LEGACY_TRAINING = TrainSetup("fp32", 0, "fp32")
"""The setup of a plan file without a ``training`` field (the runtime's only one before)."""


@dataclass
class StagePlan:
    ranks: list[int]
    """Global ranks of the stage: dp replica d is ranks[d * tp:(d + 1) * tp], its tp rank
    t the t-th smallest of those (:meth:`replica`); any order is accepted."""
    device_type: str
    """Device type of every rank in the stage."""
    tp: int
    dp: int
    layers: tuple[int, int]
    """Transformer layers [start, end)."""
    recompute: dict[str, int] = field(default_factory=dict)
    """Op name -> number of the stage's layers (the first ones) in which it is recomputed."""
    predicted: dict = field(default_factory=dict)
    """Cost-model predictions (fwd_ms, bwd_ms, memory_gb, ...), informational."""
    ops: tuple[str, str] | None = None
    """(first op of the first layer, last op of the last layer) of a stage that starts or
    ends inside a layer; None: whole layers (module docstring)."""

    @property
    def num_layers(self) -> int:
        """Layers the stage touches, whole or in part."""
        return self.layers[1] - self.layers[0]

    def span(self, spec: ModelSpec) -> tuple[int, int]:
        """The stage's ops [a, b) in model order, op i of layer l at position l * k + i (k
        layer ops)."""
        names = layer_ops(spec)
        first, last = self.ops or (names[0], names[-1])
        return (self.layers[0] * len(names) + names.index(first),
                (self.layers[1] - 1) * len(names) + names.index(last) + 1)

    def held_ops(self, spec: ModelSpec, layer: int) -> tuple[str, ...]:
        """The ops of ``layer`` this stage runs (all of them in its whole layers)."""
        names, (a, b) = layer_ops(spec), self.span(spec)
        lo, hi = max(a - layer * len(names), 0), min(b - layer * len(names), len(names))
        return names[lo:hi] if lo < hi else ()

    def recompute_layers(self, spec: ModelSpec, op: str) -> list[int]:
        """The layers in which ``op`` is recomputed: the first ``recompute[op]`` of the
        stage's layers that run it."""
        held = [layer for layer in range(*self.layers) if op in self.held_ops(spec, layer)]
        return held[:self.recompute.get(op, 0)]

    def replica(self, dp_rank: int) -> tuple[int, ...]:
        """Ranks of dp replica ``dp_rank`` (``ranks[dp_rank * tp:(dp_rank + 1) * tp]``) in
        tp-rank order, i.e. ascending: torch's ``new_group`` orders a group by global
        rank and megatron-core's layers take their tp rank from the group, so the
        runtime defines tp rank t as the t-th smallest rank of the replica."""
        return tuple(sorted(self.ranks[dp_rank * self.tp:(dp_rank + 1) * self.tp]))

    def rank(self, tp_rank: int, dp_rank: int) -> int:
        return self.replica(dp_rank)[tp_rank]

    def to_dict(self) -> dict:
        out = {"ranks": list(self.ranks), "device_type": self.device_type, "tp": self.tp,
               "dp": self.dp, "layers": list(self.layers), "recompute": dict(self.recompute),
               "predicted": dict(self.predicted)}
        if self.ops is not None:
            out["ops"] = list(self.ops)
        return out


@dataclass
class PipelinePlan:
    mbs: int
    """Micro-batch size of the pipeline (split over each stage's dp replicas)."""
    lbs: int
    """Local batch size: samples of each global batch this pipeline trains on."""
    stages: list[StagePlan]
    predicted: dict = field(default_factory=dict)

    @property
    def num_microbatches(self) -> int:
        return self.lbs // self.mbs

    @property
    def ranks(self) -> list[int]:
        return [r for s in self.stages for r in s.ranks]

    def to_dict(self) -> dict:
        return {"mbs": self.mbs, "lbs": self.lbs, "predicted": dict(self.predicted),
                "stages": [s.to_dict() for s in self.stages]}


@dataclass
class Plan:
    model: ModelSpec
    cluster: Cluster
    gbs: int
    pipelines: list[PipelinePlan]
    predicted: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    version: int = PLAN_VERSION
    training: TrainSetup = field(default_factory=lambda: LEGACY_TRAINING)
    """Precision, ZeRO stage and gradient dtype the plan is made for."""

    @property
    def world_size(self) -> int:
        return sum(len(s.ranks) for p in self.pipelines for s in p.stages)

    def content_hash(self) -> str:
        """Hash of model + cluster + pipelines (not of predictions or search metadata)."""
        body = json.dumps([self.model.to_dict(compact=True), self.cluster.to_dict(), self.gbs, self.training.to_dict(),
                           [p.to_dict() | {"predicted": {}, "stages": [s.to_dict() | {"predicted": {}}
                                                                      for s in p.stages]}
                            for p in self.pipelines]], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    @property
    def cuts_layers(self) -> bool:
        """A stage starts or ends inside a layer (the plan needs version 2)."""
        return any(s.ops is not None for p in self.pipelines for s in p.stages)

    def to_dict(self) -> dict:
        version = PLAN_VERSION if self.cuts_layers else WHOLE_LAYER_VERSION
        return {"version": version, "model": self.model.to_dict(),
                "cluster": self.cluster.to_dict(), "gbs": self.gbs,
                "seq_len": self.model.seq_len,
                "pipelines": [p.to_dict() for p in self.pipelines],
                "training": self.training.to_dict(),
                "predicted": dict(self.predicted), "search": dict(self.search),
                "hash": self.content_hash()}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """Parse the JSON form; every field is type-checked and unknown keys are rejected."""
        _fields(data, ("version", "model", "cluster", "gbs", "pipelines"),
                ("seq_len", "predicted", "search", "hash", "training"), "plan")
        version = data["version"]
        if not _is_int(version) or version not in (WHOLE_LAYER_VERSION, PLAN_VERSION):
            raise PlanError(f"plan.version is {version!r}, this release reads versions "
                            f"{WHOLE_LAYER_VERSION} and {PLAN_VERSION}")
        model = ModelSpec.from_dict(data["model"], where="plan.model")
        if "seq_len" in data and data["seq_len"] != model.seq_len:
            raise PlanError(f"plan.seq_len {data['seq_len']} != plan.model.seq_len {model.seq_len}")
        cluster = Cluster.from_dict(data["cluster"], where="plan.cluster")
        if not isinstance(data["pipelines"], list) or not data["pipelines"]:
            raise PlanError("plan.pipelines must be a non-empty list")
        pipelines = []
        for i, p in enumerate(data["pipelines"]):
            where = f"plan.pipelines[{i}]"
            _fields(p, ("mbs", "lbs", "stages"), ("predicted",), where)
            if not isinstance(p["stages"], list) or not p["stages"]:
                raise PlanError(f"{where}.stages must be a non-empty list")
            stages = []
            for j, st in enumerate(p["stages"]):
                sw = f"{where}.stages[{j}]"
                _fields(st, ("ranks", "device_type", "tp", "dp", "layers"), ("recompute", "predicted", "ops"), sw)
                layers, ranks = st["layers"], st["ranks"]
                if not (isinstance(layers, list) and len(layers) == 2 and all(map(_is_int, layers))):
                    raise PlanError(f"{sw}.layers must be [start, end) integers, got {layers!r}")
                if not (isinstance(ranks, list) and ranks and all(map(_is_int, ranks))):
                    raise PlanError(f"{sw}.ranks must be a non-empty list of integers, got {ranks!r}")
                if not isinstance(st["device_type"], str):
                    raise PlanError(f"{sw}.device_type must be a string, got {st['device_type']!r}")
                recompute = _mapping(st.get("recompute", {}), f"{sw}.recompute")
                ops = st.get("ops")
                if ops is not None:
                    if version < PLAN_VERSION:
                        raise PlanError(f"{sw}.ops needs plan version {PLAN_VERSION}, the plan is "
                                        f"version {version}")
                    if not (isinstance(ops, list) and len(ops) == 2 and all(isinstance(o, str) for o in ops)):
                        raise PlanError(f"{sw}.ops must be [first op, last op] names, got {ops!r}")
                    ops = (ops[0], ops[1])
                stages.append(StagePlan(list(ranks), st["device_type"], st["tp"], st["dp"],
                                        (layers[0], layers[1]), recompute,
                                        _mapping(st.get("predicted", {}), f"{sw}.predicted"), ops))
            pipelines.append(PipelinePlan(p["mbs"], p["lbs"], stages,
                                          _mapping(p.get("predicted", {}), f"{where}.predicted")))
        training = TrainSetup.from_dict(data["training"]) if "training" in data else LEGACY_TRAINING
        return cls(model, cluster, data["gbs"], pipelines, _mapping(data.get("predicted", {}), "plan.predicted"),
                   _mapping(data.get("search", {}), "plan.search"), version, training)

    def validate(self) -> "Plan":
        """Raise PlanError naming the field and numbers for the first inconsistency."""
        _positive_int(self.gbs, "plan.gbs")
        used: dict[int, str] = {}
        world = self.cluster.world_size
        ops = layer_ops(self.model)
        k = len(ops)
        for i, p in enumerate(self.pipelines):
            where = f"plan.pipelines[{i}]"
            _positive_int(p.mbs, f"{where}.mbs")
            _positive_int(p.lbs, f"{where}.lbs")
            if p.lbs % p.mbs:
                raise PlanError(f"{where}: lbs {p.lbs} is not a multiple of mbs {p.mbs}")
            expect = 0
            for j, s in enumerate(p.stages):
                sw = f"{where}.stages[{j}]"
                _positive_int(s.tp, f"{sw}.tp")
                _positive_int(s.dp, f"{sw}.dp")
                if s.tp * s.dp != len(s.ranks):
                    raise PlanError(f"{sw}: tp {s.tp} x dp {s.dp} = {s.tp * s.dp} "
                                    f"but the stage has {len(s.ranks)} ranks")
                if p.mbs % s.dp:
                    raise PlanError(f"{sw}: pipeline mbs {p.mbs} is not divisible by stage dp {s.dp}")
                try:
                    self.model.check_tp(s.tp)
                except SpecError as exc:
                    raise PlanError(f"{sw}: {exc}") from None
                start, end = s.layers
                if not (_is_int(start) and _is_int(end)):
                    raise PlanError(f"{sw}.layers must be integers, got {list(s.layers)}")
                expect = self._check_span(s, sw, expect, ops)
                for op, n in s.recompute.items():
                    if op not in ops:
                        raise PlanError(f"{sw}.recompute names unknown op {op!r}; model "
                                        f"{self.model.name}'s layer ops: {', '.join(ops)}")
                    held = sum(op in s.held_ops(self.model, layer) for layer in range(start, end))
                    if not _is_int(n) or not 0 <= n <= held:
                        cut = (f" (the stage runs {op} in {held} of its {s.num_layers} layers, "
                               f"ops {s.ops[0]} .. {s.ops[1]}: a recompute run cannot cross a stage "
                               f"boundary)" if s.ops is not None and held < s.num_layers else "")
                        raise PlanError(f"{sw}.recompute[{op!r}] is {n!r}, must be in "
                                        f"[0, {held}] (the stage's layers){cut}")
                for r in s.ranks:
                    if not _is_int(r) or not 0 <= r < world:
                        raise PlanError(f"{sw}.ranks has {r!r}, cluster ranks are 0..{world - 1}")
                    if r in used:
                        raise PlanError(f"rank {r} is used twice: {used[r]} and {sw}")
                    used[r] = sw
                    actual = self.cluster.devices[r].type
                    if actual != s.device_type:
                        raise PlanError(f"{sw}.device_type is {s.device_type!r} but cluster rank {r} "
                                        f"is a {actual!r}")
            if expect != self.model.num_layers * k:
                covered = (f"layers [0, {expect // k})" if expect % k == 0 else
                           f"up to op {ops[expect % k - 1]} of layer {expect // k}")
                raise PlanError(f"{where} covers {covered} but the model has "
                                f"{self.model.num_layers} layers")
        if len(used) != world:
            missing = sorted(set(range(world)) - set(used))
            raise PlanError(f"plan uses {len(used)} ranks but the cluster has {world}; "
                            f"unused ranks: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        total = sum(p.lbs for p in self.pipelines)
        if total < self.gbs:
            raise PlanError(f"sum of pipeline lbs {total} is below gbs {self.gbs}")
        return self

    def _check_span(self, s: StagePlan, sw: str, expect: int, ops: tuple[str, ...]) -> int:
        """Check that stage ``s`` starts at op position ``expect`` and holds at least one op;
        returns where the next stage must start."""
        k, (start, end) = len(ops), s.layers
        if s.ops is not None:
            for what, op in zip(("first", "last"), s.ops):
                if op not in ops:
                    raise PlanError(f"{sw}.ops {what} op {op!r} is not a layer op of model "
                                    f"{self.model.name}: {', '.join(ops)}")
        a, b = (start * k, end * k) if s.ops is None else s.span(self.model)
        if a != expect:
            at = f"layer {expect // k}" + (f" at op {ops[expect % k]}" if expect % k else "")
            got = f"layer {start}" + (f" at op {s.ops[0]}" if s.ops is not None else "")
            raise PlanError(f"{sw} starts at {got} but must start at {at} (where the previous "
                            f"stage ends)")
        if b <= a:
            what = f"layers [{start}, {end})" + (f" ops {s.ops[0]} .. {s.ops[1]}" if s.ops else "")
            raise PlanError(f"{sw} holds no op: {what}")
        if s.ops is not None and s.tp > self.model.kv_heads:
            cut = {t.name for pos in (a, b) if pos % k
                   for t in cut_tensors(self.model, ops[pos % k - 1]) if t.name in ("qkv", "qkv_r")}
            if cut:
                raise PlanError(f"{sw}: tp {s.tp} > kv_heads {self.model.kv_heads} replicates key/value "
                                f"heads inside the qkv output, which a boundary there cannot carry; "
                                f"cut after another op")
        return b

    def save(self, path) -> None:
        """Validate, then write atomically (temp file + rename)."""
        self.validate()
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")


def stage_holding(pipeline, layer: int) -> int:
    """Index of the stage of ``pipeline`` (a PipelinePlan or alike) that holds ``layer``."""
    for j, st in enumerate(pipeline.stages):
        if st.layers[0] <= layer < st.layers[1]:
            return j
    raise PlanError(f"no stage holds layer {layer}")


def load_plan(path) -> Plan:
    """Read, parse and validate a plan JSON file."""
    return Plan.from_dict(read_json(path, "plan", PlanError)).validate()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fields(obj, required, optional, where) -> None:
    if not isinstance(obj, dict):
        raise PlanError(f"{where} must be an object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise PlanError(f"{where} is missing field(s) {missing}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise PlanError(f"{where} has unknown field(s) {unknown}; known: {sorted(required + optional)}")


def _mapping(value, where) -> dict:
    if not isinstance(value, dict):
        raise PlanError(f"{where} must be an object, got {value!r}")
    return dict(value)


def _positive_int(value, where):
    if not _is_int(value) or value <= 0:
        raise PlanError(f"{where} must be a positive integer, got {value!r}")
