"""Collective tables of a measured profile (``tools/profile_ops.py --collectives``).

:func:`measure_collectives` (world size >= 2) times all_reduce, all_gather,
reduce_scatter (group sizes 2..world, ranks 0..n-1) and p2p (ranks 0 and 1, half a
round trip) over message sizes: ``{kind: {"n": [[bytes, ms], ...]}}`` where bytes is the
full (unsharded) buffer, as ``eth.profiles.db.collective_ms`` reads it; each time is the
median over repeats, then the maximum over the group's ranks.
"""
from __future__ import annotations

import statistics

import torch

from eth.errors import SpecError
from megatron.hpp import compat
from megatron.hpp.profiling.timing import Clock

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
DEFAULT_COLLECTIVE_SIZES = tuple(2 ** k for k in range(10, 27, 2))  # 1 KiB .. 64 MiB
GROUP_WARMUP = 20
"""Untimed small all-reduces on each new group before its first timed size (without them
the first size's median held the group's connection set-up: gloo, 2-4 ranks on this
2-core machine, 64 B above 1 KiB)."""


def measure_collectives(device: torch.device, sizes=DEFAULT_COLLECTIVE_SIZES, repeats: int = 10,
                        warmup: int = 3) -> dict:
    """{kind: {"n": [[bytes, ms], ...]}} for group sizes 2..world (every rank must call)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise SpecError(f"--collectives needs a world size >= 2 (torchrun), WORLD_SIZE is {world}")
    clock, out = Clock(device, cpu_time=False), {k: {} for k in COLLECTIVE_KINDS}

    def timed(run):
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            clock.start()
            run()
            times.append(clock.stop())
        return statistics.median(times)

    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))
        if rank < n:
            for _ in range(GROUP_WARMUP):   # a new group's first collectives connect its ranks
                dist.all_reduce(torch.ones(n, device=device), group=group)
            rows = {k: [] for k in COLLECTIVE_KINDS}
            for nbytes in sizes:
                numel = max(n, nbytes // 4 // n * n)  # fp32, divisible by n
                full = torch.ones(numel, device=device)
                part = torch.empty(numel // n, device=device)
                rows["all_reduce"].append([numel * 4, timed(lambda: dist.all_reduce(full, group=group))])
                rows["all_gather"].append(
                    [numel * 4, timed(lambda: dist.all_gather_into_tensor(full, part, group=group))])
                rows["reduce_scatter"].append(
                    [numel * 4, timed(lambda: compat.reduce_scatter(part, full, group=group))])
                if n == 2:
                    rows["p2p"].append([numel * 4, timed(lambda: _ping_pong(full, rank)) / 2])
            for kind, table in rows.items():
                if table:
                    worst = torch.tensor([ms for _, ms in table], dtype=torch.float64, device=device)
                    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
                    out[kind][str(n)] = [[b, float(ms)] for (b, _), ms in zip(table, worst.tolist())]
        dist.barrier()
    return {k: v for k, v in out.items() if v}


def _ping_pong(buf: torch.Tensor, rank: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)
