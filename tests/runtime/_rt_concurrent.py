"""One rank of test_grad_sync_order.py: two gradient collectives as the runtime launches
them (``megatron.hpp.distributed.grad_sync``: one asynchronous all-reduce per holder
set), A over ranks {0, 1} and B over {1, 2}.  Rank 1 launches A first, then B; rank 0
joins A only once rank 1 has seen B complete (a store key), so B finishing while A
waits is the only order in which the run ends.  Each rank prints one JSON line."""
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WAIT = timedelta(seconds=60)

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=WAIT)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=WAIT)
group_a, group_b = dist.new_group([0, 1]), dist.new_group([1, 2])
out = {"rank": rank}
start = time.perf_counter()
if rank == 0:
    store.wait(["concurrent/b_done"])           # raises after WAIT if B waited for A
    out["joined_a_s"] = time.perf_counter() - start
    a = torch.full((4,), 1.0)
    dist.all_reduce(a, group=group_a)
    out["a"] = a.tolist()
elif rank == 1:
    a, b = torch.full((4,), 2.0), torch.full((4,), 20.0)
    work_a = dist.all_reduce(a, group=group_a, async_op=True)
    work_b = dist.all_reduce(b, group=group_b, async_op=True)
    work_b.wait()
    out["b_done_s"], out["a_done_when_b_done"] = time.perf_counter() - start, work_a.is_completed()
    store.set("concurrent/b_done", "1")
    work_a.wait()
    out["a"], out["b"] = a.tolist(), b.tolist()
else:
    b = torch.full((4,), 10.0)
    dist.all_reduce(b, group=group_b)
    out["b"] = b.tolist()
print(json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
