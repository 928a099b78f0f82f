"""The order of gradient collectives the simulator and the planner's objective assume
(docs/SIMULATOR.md, "Concurrent reduction"): a block's collective completes as soon as
its holders are ready, while a collective launched before it on the same rank still
waits for a late holder.  Three gloo ranks, store-signalled (_rt_concurrent.py)."""
import json

from _rt_spawn import REPO, launch


def test_a_ready_collective_completes_while_an_earlier_one_waits():
    results = launch(3, [], script=REPO / "tests" / "runtime" / "_rt_concurrent.py", preload=False, timeout=120)
    for r in results:
        assert r.returncode == 0, (r.rank, r.stderr[-2000:])
    got = {r.rank: json.loads(r.stdout.strip().splitlines()[-1]) for r in results}
    # B completed on rank 1 before rank 0 had joined A (it joins only after B), so A was pending
    assert got[1]["a_done_when_b_done"] is False
    assert got[0]["joined_a_s"] >= 0 and got[1]["b_done_s"] >= 0
    # and both sums are right: A = 1 + 2 on ranks 0 and 1, B = 20 + 10 on ranks 1 and 2
    assert got[0]["a"] == got[1]["a"] == [3.0] * 4
    assert got[1]["b"] == got[2]["b"] == [30.0] * 4
