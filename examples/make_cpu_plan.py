"""Write examples/plans/cpu-a100-3090.json: a hand-made HPP plan for the 4-rank CPU
cluster examples/clusters/cpu-a100-3090.yaml (2 "A100" + 2 emulated "RTX3090" ranks).

    python examples/make_cpu_plan.py [-o examples/plans/cpu-a100-3090.json]

Pipeline 0: the two A100 ranks as one stage (tp 1, dp 2), all layers, lbs 24.
Pipeline 1: the two RTX3090 ranks as two stages (tp 1, dp 1) of half the layers, lbs 8.
The faster pipeline gets the larger local batch (per rank: 2 ranks share pipeline 0's
4 layers x 24 samples; each emulated rank of pipeline 1 does 2 layers x 8 samples at
0.256 speed plus a 2-stage bubble).  A later change replaces this plan
with planner output (tools/search_hpp.py).
"""
import argparse
from pathlib import Path

from eth.cluster import load_cluster
from eth.model import get_model
from eth.plan import PipelinePlan, Plan, StagePlan

ROOT = Path(__file__).resolve().parent


def make_plan() -> Plan:
    cluster = load_cluster(ROOT / "clusters" / "cpu-a100-3090.yaml")
    model = get_model("tiny")
    half = model.num_layers // 2
    fast = PipelinePlan(mbs=4, lbs=24, stages=[
        StagePlan([0, 1], "A100", tp=1, dp=2, layers=(0, model.num_layers))])
    slow = PipelinePlan(mbs=2, lbs=8, stages=[
        StagePlan([2], "RTX3090", tp=1, dp=1, layers=(0, half)),
        StagePlan([3], "RTX3090", tp=1, dp=1, layers=(half, model.num_layers))])
    return Plan(model=model, cluster=cluster, gbs=32, pipelines=[fast, slow],
                search={"source": "hand-made by examples/make_cpu_plan.py"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default=str(ROOT / "plans" / "cpu-a100-3090.json"))
    args = parser.parse_args()
    make_plan().save(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
