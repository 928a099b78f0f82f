"""Gradient reduction across every replica of a parameter, on the layout of ``eth.layout.blocks``.

:class:`GradReducer` owns one flat gradient buffer per :class:`eth.layout.blocks.Buffer` this
rank participates in (fp32 by default, bf16 with ``grad_reduce="bf16"``), with every
piece at the offset the layout gives, so the buffers are reduced as they are -- no
packing copy.  Accumulation follows Megatron's DDP: a post-accumulate-grad hook adds
each parameter's ``.grad`` (compute dtype) into its pieces' places in the buffers
(fp32 main gradients) and drops ``.grad``.  The schedule calls
:meth:`GradReducer.final_backward` before a rank's last micro-batch backward; from
then on a buffer is launched (async collective) as soon as every parameter that adds
to it has had its last gradient, in the rank's fixed launch order (descending model
position, identical on every participant), so the reduction of late layers overlaps
the backward of early ones.  :meth:`finish` launches what is left and waits.

Collectives per ZeRO stage (``eth.spec.precision.TrainSetup``): stage 0 all-reduces the
buffer; stages 1 and 2 reduce-scatter the buffer padded to N equal shards (in place:
participant i's shard is its own slice of the buffer).  Stage 2 allocates the full
buffer only for the backward pass of a step and keeps just its shard afterwards.

Losses are normalised by the global batch (see training), so the reduced sum is the
gradient of the whole global batch.  :func:`global_grad_norm` sums the squares of
each rank's shard of every buffer (the shards partition the model: each element
counted once).  :func:`gather_parameters` collects full parameters on rank 0 (tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eth.layout.params import all_specs
from megatron.hpp import compat

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def piece_view(flat: torch.Tensor, offset: int, piece) -> torch.Tensor:
    """The piece at ``offset`` of a flat buffer, shaped as the piece."""
    return flat[offset:offset + piece.numel].view(piece.shape)


def region_views(piece_tensor: torch.Tensor, local: torch.Tensor, region):
    """(piece part, local part) of a :class:`eth.layout.blocks.Region`."""
    if region.dim is None:
        return piece_tensor, local
    return (piece_tensor.narrow(region.dim, region.piece_start, region.length),
            local.narrow(region.dim, region.local_start, region.length))


@dataclass
class Bucket:
    """One layout buffer on this rank: its gradient storage and collective state."""

    buf: object
    """eth.layout.blocks.Buffer."""
    group: object
    """ProcessGroup of the participants (None: this rank alone)."""
    index: int
    """This rank's position among the participants."""
    held: list = field(default_factory=list)
    """(local param, offset, piece, region) of every piece part this rank holds."""
    adders: set = field(default_factory=set)
    """Local parameter names whose gradients this rank adds to the bucket."""
    data: torch.Tensor | None = None
    shard_grad: torch.Tensor | None = None
    """ZeRO 2: this rank's reduced shard, kept after the full buffer is freed."""
    remaining: int = 0
    work: object = None

    @property
    def step_range(self) -> tuple[int, int]:
        """[lo, hi): this rank's shard of the buffer (``Buffer.shard``).  It steps it with
        ZeRO 1/2, and counts it in the global norm and writes it in checkpoints with any
        ZeRO stage (the shards partition the buffer)."""
        return self.buf.shard(self.buf.ranks[self.index])


class GradReducer:
    """Gradient buffers, accumulation hooks and the reduction of one stage model."""

    def __init__(self, model, topo, layout, setup, device):
        self.rank, self.zero, self.layout = topo.rank, setup.zero_stage, layout
        self.dtype, self.device = GRAD_DTYPES[setup.grad_reduce], device
        local = {model.shard_specs[n].name: p for n, p in model.named_parameters()}
        self.buckets: list[Bucket] = []
        self._targets: dict[str, list] = {name: [] for name in local}
        for i, buf in enumerate(layout.buffers_of(self.rank)):
            group = topo.groups[buf.ranks] if len(buf.ranks) > 1 else None
            b = Bucket(buf, group, buf.ranks.index(self.rank))
            for piece, offset in zip(buf.pieces, buf.offsets):
                region = layout.region(self.rank, piece)
                if region is None:
                    continue
                name = piece.spec.name
                b.held.append((local[name], offset, piece, region))
                if layout.contributes(self.rank, piece):
                    b.adders.add(name)
                    self._targets[name].append((i, offset, piece, region))
            if self.zero < 2:
                b.data = self._alloc(buf)
            self.buckets.append(b)
        # launched_early: collectives of the last step launched during its backward pass
        self.final, self._next, self._finishing, self.launched_early = False, 0, False, 0
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in local.items()]
        self.collectives: list = []
        """(participants, bytes) of every collective of the last step (diagnostics, tests)."""

    def _alloc(self, buf) -> torch.Tensor:
        size = buf.padded_numel if self.zero > 0 else buf.numel
        return torch.zeros(size, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ backward
    def start_step(self) -> None:
        """Zero the buffers (ZeRO 0/1; ZeRO 2 allocates them at the first gradient)."""
        for b in self.buckets:
            if b.data is not None:
                b.data.zero_()
            b.remaining, b.work, b.shard_grad = len(b.adders), None, None
        self.final, self._next, self.collectives = False, 0, []
        self._finishing, self.launched_early = False, 0

    def final_backward(self) -> None:
        """Called before this rank's last micro-batch backward of the step."""
        self.final = True
        self._launch_ready()

    def _hook(self, name):
        targets = self._targets[name]
        mine = sorted({i for i, *_ in targets})
        views = {}   # target -> its place in the bucket's current buffer (built once per buffer)

        def hook(param):
            grad = param.grad
            for k, (i, offset, piece, region) in enumerate(targets):
                b = self.buckets[i]
                if b.data is None:
                    b.data = self._alloc(b.buf)
                buffer, dst = views.get(k, (None, None))
                if buffer is not b.data:
                    dst = region_views(piece_view(b.data, offset, piece), grad, region)[0]
                    views[k] = (b.data, dst)
                dst.add_(grad if region.dim is None else
                         grad.narrow(region.dim, region.local_start, region.length))
            param.grad = None
            if self.final and mine:
                for i in mine:
                    self.buckets[i].remaining -= 1
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].remaining <= 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        if b.data is None:   # ZeRO 2 and no gradient added on this rank
            b.data = self._alloc(b.buf)
        if b.group is None:
            return
        self.launched_early += not self._finishing
        nbytes = b.data.numel() * b.data.element_size()
        self.collectives.append((b.buf.ranks, nbytes))
        if self.zero == 0:
            b.work = dist.all_reduce(b.data, group=b.group, async_op=True)
        else:
            s = b.buf.shard_size
            b.work = compat.reduce_scatter(b.data[b.index * s:(b.index + 1) * s], b.data, group=b.group,
                                           async_op=True)

    def finish(self) -> None:
        """Launch what is left (in order) and wait for every reduction."""
        self.final, self._finishing = True, True
        for b in self.buckets:
            b.remaining = 0
        self._launch_ready()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if self.zero == 2:
                s = b.buf.shard_size
                b.shard_grad = b.data[b.index * s:(b.index + 1) * s].clone()
                b.data = None

    # ------------------------------------------------------------------ reduced gradients
    def step_grad(self, b: Bucket) -> tuple[int, torch.Tensor]:
        """(first element, reduced gradient) of what this rank steps in bucket ``b``:
        the whole buffer with ZeRO 0, its shard with ZeRO 1/2."""
        if self.zero == 0:
            return 0, b.data[:b.buf.numel]
        lo, hi = b.step_range
        s = b.buf.shard_size
        shard = b.shard_grad if self.zero == 2 else b.data[b.index * s:(b.index + 1) * s]
        return lo, shard[:hi - lo]

    def norm_grads(self):
        """This rank's share of every buffer for the global norm (each element once)."""
        for b in self.buckets:
            lo, hi = b.step_range
            start, grad = self.step_grad(b)
            yield grad[lo - start:hi - start]

    def state_bytes(self) -> int:
        """Bytes of gradient storage alive now (buffers and ZeRO-2 shards)."""
        return sum(t.numel() * t.element_size() for b in self.buckets
                   for t in (b.data, b.shard_grad) if t is not None)

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


NORM_ROW = 1024
"""Elements per fp32 partial sum of a gradient norm (their squares are summed in fp64)."""


def squared_norm(grads, device) -> torch.Tensor:
    """fp64 sum of squares of ``grads``.  Each gradient is cut into rows of NORM_ROW
    elements whose fp32 norms come from one kernel; the rows' squares add in fp64, so a
    buffer of millions of elements is as accurate as a small one (on a CPU, one fp32 norm
    over 1.7 M elements is off by more than 1e-5 relative, the rows by less than 2e-7:
    tests/runtime/test_runtime_units.py::test_gradient_norm_is_fp64_accurate_on_large_buffers)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        flat = grad.detach().reshape(-1)
        full = flat.numel() // NORM_ROW * NORM_ROW
        if full:
            rows = torch.linalg.vector_norm(flat[:full].view(-1, NORM_ROW), dim=1, dtype=torch.float32)
            sq += rows.double().square().sum()
        if flat.numel() > full:
            sq += torch.linalg.vector_norm(flat[full:], dtype=torch.float32).double() ** 2
    return sq


def global_grad_norm(reducer: GradReducer, device) -> float:
    """L2 norm of the full reduced gradient, every element counted once (all ranks call):
    :func:`squared_norm` of this rank's pieces, summed over ranks."""
    sq = squared_norm(reducer.norm_grads(), device)
    dist.all_reduce(sq)
    return float(sq.sqrt())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch's clip_grad_norm_ factor: max_norm / (norm + 1e-6) when below 1, else 1."""
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            return coef
    return 1.0


def _owns(topo, spec) -> bool:
    return topo.pipeline == 0 and topo.dp_rank == 0 and (spec.dim is not None or topo.tp_rank == 0)


def gather_parameters(model, topo) -> dict | None:
    """Full fp32 parameters by logical name on rank 0 (None elsewhere); all ranks call."""
    local = {model.shard_specs[n].name: p for n, p in model.named_parameters()}
    device = next(model.parameters()).device
    out = {}
    for spec in all_specs(topo.plan.model):
        buf = torch.zeros(spec.full_shape, dtype=torch.float32, device=device)
        if spec.name in local and _owns(topo, spec):
            spec.local(buf, topo.tp_rank, topo.stage.tp).copy_(local[spec.name].detach())
        dist.reduce(buf, dst=0)
        if topo.rank == 0:
            out[spec.name] = buf.cpu()
    return out if topo.rank == 0 else None
