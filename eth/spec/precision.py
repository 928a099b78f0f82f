"""Training precision and optimizer sharding: what a plan is made for and trained with.

A :class:`TrainSetup` fixes the bytes behind every parameter and gradient element,
for the cost model (memory, Eq. 6) and for the runtime (tensor dtypes).  The plan
records it (``plan.training``) and the runtime takes it from there.

Bytes per parameter element held by a rank (the runtime's tensors, ``megatron.hpp``):

    weights      w  = 2 (bf16, fp16) or 4 (fp32)        the model's parameters
    gradients    g  = 4 (fp32 accumulation and reduction; Megatron's default for
                      bf16), or 2 with ``grad_reduce="bf16"``
    optimizer    12 = fp32 main weights + AdamW's two moments, kept for the elements
                      a rank steps: all the rank's elements with ZeRO 0, its 1/N
                      shard of each gradient buffer with ZeRO 1 and 2 (N = the
                      buffer's participants)
    ZeRO 2       keeps only its gradient shard after the reduce-scatter; the full
                 gradient buffer still exists during the backward pass (pipelines of
                 different micro-batch counts cannot reduce per micro-batch), so it
                 does not lower the 1F1B peak that the planner checks

so ZeRO 0 is w + g + 12 (18 in bf16) and ZeRO 1/2 is w + g + 12/N at the peak.

fp32 weights need no fp32 main copy: frameworks that step fp32 weights in place
(DeepSpeed's and Megatron-LM's fp32 Adam) hold 8 bytes of optimizer state per element,
4 + 4 + 8 = 16 with ZeRO 0.  ``fp32_master`` false describes such a run
(:attr:`TrainSetup.optimizer_bytes`), for plans and predictions of runs of those
frameworks (bench/measured_runs.py); this runtime keeps the fp32 main copy and refuses
such a plan (``megatron.hpp.training.loop``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from eth.errors import PlanError

PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_REDUCE = ("fp32", "bf16")
ZERO_STAGES = (0, 1, 2)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_BYTES = 12
"""fp32 main weight + AdamW exp_avg + exp_avg_sq per stepped element."""


@dataclass(frozen=True)
class TrainSetup:
    precision: str = "bf16"
    """Dtype of weights and activations: fp32, bf16 or fp16 (fp16 with dynamic loss
    scaling); the optimizer always keeps fp32 main weights."""
    zero_stage: int = 0
    """0: every rank keeps optimizer state for all its elements; 1: optimizer state
    sharded over each gradient buffer's participants; 2: also the gradients."""
    grad_reduce: str = "fp32"
    """Dtype gradients are accumulated and reduced in (fp32, or bf16 as Megatron's
    --grad-reduce-in-bf16 offers)."""
    fp32_master: bool = True
    """The optimizer keeps fp32 main weights beside the model's (this runtime, always);
    false only with fp32 weights, stepped in place (module docstring)."""

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise PlanError(f"zero_stage {self.zero_stage!r} is not one of 0, 1, 2")
        if self.grad_reduce not in GRAD_REDUCE:
            raise PlanError(f"grad_reduce {self.grad_reduce!r} is not one of {', '.join(GRAD_REDUCE)}")
        if not isinstance(self.fp32_master, bool):
            raise PlanError(f"fp32_master must be true or false, got {self.fp32_master!r}")
        if not self.fp32_master and self.precision != "fp32":
            raise PlanError(f"fp32_master false needs fp32 weights, precision is {self.precision}: "
                            f"{self.precision} weights cannot be stepped in place")

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer bytes per stepped element: fp32 main weight + AdamW's two moments,
        or the moments alone when fp32 weights are stepped in place."""
        return OPTIMIZER_BYTES if self.fp32_master else OPTIMIZER_BYTES - ELEMENT_BYTES["fp32"]

    @property
    def weight_bytes(self) -> int:
        return ELEMENT_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return ELEMENT_BYTES[self.grad_reduce]

    def state_bytes_per_param(self, participants: float = 1.0) -> float:
        """Peak model-state bytes per held element when each gradient buffer has
        ``participants`` holders (the ZeRO shard count)."""
        shard = participants if self.zero_stage > 0 else 1.0
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes / shard

    def sync_bytes_per_element(self) -> float:
        """Bytes that Eq. 6's ``Gra`` counts per gradient element: an All-Reduce moves
        2 x g (N-1)/N; ZeRO's reduce-scatter of g-byte gradients plus all-gather of
        w-byte weights moves (g + w)(N-1)/N, i.e. Eq. 6 with Gra = (g + w) / 2."""
        return self.grad_bytes if self.zero_stage == 0 else (self.grad_bytes + self.weight_bytes) / 2

    def to_dict(self) -> dict:
        """The fields; ``fp32_master`` only when false (plans written before it existed
        keep their hash)."""
        data = asdict(self)
        if self.fp32_master:
            del data["fp32_master"]
        return data

    @classmethod
    def from_dict(cls, data, where: str = "plan.training") -> "TrainSetup":
        if not isinstance(data, dict):
            raise PlanError(f"{where} must be an object, got {data!r}")
        unknown = sorted(set(data) - {"precision", "zero_stage", "grad_reduce", "fp32_master"})
        if unknown:
            raise PlanError(f"{where} has unknown field(s) {unknown}; known: fp32_master, grad_reduce, "
                            f"precision, zero_stage")
        try:
            return cls(**data)
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
