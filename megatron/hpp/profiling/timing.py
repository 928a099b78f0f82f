"""What every measurement of the profiler stands on: a clock of one region (CUDA events on
a GPU, the thread's CPU time on a one-thread CPU) and process groups that let one process
build and run a tp rank's shard of the model (a fake tp group; a one-rank fake default
group while megatron-core needs one)."""
from __future__ import annotations

import contextlib
import time

import torch


class Clock:
    """Elapsed milliseconds of a region: CUDA events on a GPU; on the CPU the thread's CPU
    time when torch runs one thread (what the op costs on a dedicated core, whatever else
    runs on the machine; the runtime's ``schedule.ComputeClock`` counts the same), else
    perf_counter (always for collectives: ``cpu_time=False``, waiting is their cost)."""

    def __init__(self, device: torch.device, cpu_time: bool = True):
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if cpu_time and torch.get_num_threads() == 1 else time.perf_counter

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            self._a, self._b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            self._t = self.now()

    def stop(self) -> float:
        if self.cuda:
            self._b.record()
            self._b.synchronize()
            return float(self._a.elapsed_time(self._b))
        return (self.now() - self._t) * 1e3


def fake_tp_group(tp: int):
    """A process group of size ``tp`` whose collectives do nothing (we are its rank 0)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    make = getattr(FakeProcessGroup, "_create_internal", None)
    return make(0, tp) if make is not None else FakeProcessGroup(0, tp)


@contextlib.contextmanager
def initialised_default_group():
    """megatron-core reads group sizes only once torch.distributed is initialised; without
    a real default group, a one-rank fake one is created for the duration."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
