"""HPP on Aceso's own V100 profiles: whole-layer stages and stages cut inside layers.

Aceso (microsoft/SuperScaler, branch Aceso) publishes the op profiles it planned with,
under ``profiler/profiled-time-eurosys/``.  This bench imports them through our importer
(``eth.profiles.aceso``) with Aceso's GPT shapes (1.3B: 24 layers, hidden 2048, 32 heads;
13B: 40 layers, hidden 5120, 40 heads, ffn 20480; vocabulary 51200, sequence 2048), plans
Aceso's two settings (1.3B on 1 node x 4 V100, 13B on 4 nodes x 8 V100; global batch
1024; fp16 with 16 bytes of model state per parameter, no ZeRO; 28000 MB per GPU, as its
search script) with and without ``--op-boundaries``, and prints the predicted iteration
(our cost model) and the search time of each:

    python bench/aceso_profiles.py --aceso-dir <SuperScaler checkout>/profiler/profiled-time-eurosys
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from eth.profiles.aceso import import_aceso  # noqa: E402
from eth.profiles.db import DeviceProfile, ProfileDB  # noqa: E402
from eth.planner.options import SearchOptions  # noqa: E402
from eth.planner.search import search  # noqa: E402
from eth.spec.cluster import Cluster  # noqa: E402
from eth.spec.model import get_model  # noqa: E402
from eth.spec.precision import TrainSetup  # noqa: E402

MEMORY_GB = 28000 * 2 ** 20 / 1e9   # Aceso's --memory-limit 28000 (MB of 2^20 bytes)
SETUP = TrainSetup("fp16", 0, "bf16")   # 2 + 2 + 12 = 16 bytes per parameter
CASES = (  # (Aceso model, our model, nodes, devices per node)
    ("gpt_1_3B", get_model("gpt3-1.3b", heads=32, kv_heads=32, vocab=51200), 1, 4),
    ("gpt_13B", get_model("gpt3-13b", vocab=51200, ffn=20480), 4, 8),
)


def cluster(nodes: int, per_node: int) -> Cluster:
    return Cluster.from_dict({"name": f"aceso-v100-{nodes}x{per_node}", "inter_node_gbps": 100,
                              "device_types": {"V100": {"memory_gb": MEMORY_GB}},
                              "nodes": [{"type": "V100", "devices_per_node": per_node, "count": nodes}]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aceso-dir", required=True, help="Aceso's profiler/profiled-time-eurosys folder")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"{'model':10} {'cluster':18} {'whole layers ms':>16} {'search s':>9} "
          f"{'--op-boundaries ms':>19} {'search s':>9} {'stages':>7}")
    for aceso_model, model, nodes, per_node in CASES:
        db = ProfileDB({"V100": DeviceProfile(import_aceso(args.aceso_dir, "V100", model, aceso_model=aceso_model))})
        row = []
        for op_boundaries in (False, True):
            opt = SearchOptions(gbs=1024, setup=SETUP, op_boundaries=op_boundaries, jobs=args.jobs)
            t0 = time.perf_counter()
            plan = search(model, cluster(nodes, per_node), db, opt)
            row.append((plan.predicted["iteration_ms"], time.perf_counter() - t0, plan))
        stages = "+".join(str(len(p.stages)) for p in row[1][2].pipelines)
        print(f"{aceso_model:10} {f'{nodes} x {per_node} V100':18} {row[0][0]:16.2f} {row[0][1]:9.2f} "
              f"{row[1][0]:19.2f} {row[1][1]:9.2f} {stages:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
