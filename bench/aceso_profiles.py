"""HPP on Aceso's own V100 profiles: whole-layer stages and stages cut inside layers.

Aceso (microsoft/SuperScaler, branch Aceso) publishes the op profiles it planned with,
under ``profiler/profiled-time-eurosys/``.  This bench imports them through our importer
(``eth.profiles.aceso``) with Aceso's GPT shapes (1.3B: 24 layers, hidden 2048, 32 heads;
13B: 40 layers, hidden 5120, 40 heads, ffn 20480; vocabulary 51200, sequence 2048), plans
Aceso's two settings (1.3B on 1 node x 4 V100, 13B on 4 nodes x 8 V100; global batch
1024; fp16 with 16 bytes of model state per parameter, no ZeRO; 28000 MB per GPU, as its
search script; between nodes the bandwidth Aceso measured, its ``p2p_inter_node.csv``) with
and without ``--op-boundaries``, and prints the predicted iteration (our cost model) and the
search time of each:

    python bench/aceso_profiles.py --aceso-dir <SuperScaler checkout>/profiler/profiled-time-eurosys
        [--aceso-repo <SuperScaler checkout>]

With ``--aceso-repo <SuperScaler checkout>`` each plan of one pipeline is also converted
to Aceso's config format (:func:`aceso_config`) and scored by Aceso's own cost model, run
from that checkout (``search/aceso_cost_model.py``, pure Python): its iteration time and
its largest stage memory against the 28000 MB limit.  ``--memory-mb`` plans for less
memory than Aceso's limit (the two memory models differ: docs/EVALUATION.md).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from eth.profiles.aceso import import_aceso, read_p2p_csv  # noqa: E402
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


def inter_node_gbps(aceso_dir) -> float:
    """Aceso's measured bandwidth between two V100 nodes (Gbit/s): the largest message of
    the last run in its ``p2p_inter_node.csv`` (5.44 GB/s of 1024 MB in the published one)."""
    nbytes, ms = read_p2p_csv(Path(aceso_dir) / "p2p_inter_node.csv")[-1]
    return nbytes * 8 / (ms * 1e6)


def cluster(nodes: int, per_node: int, memory_gb: float = MEMORY_GB, inter_gbps: float = 100.0) -> Cluster:
    return Cluster.from_dict({"name": f"aceso-v100-{nodes}x{per_node}", "inter_node_gbps": inter_gbps,
                              "device_types": {"V100": {"memory_gb": memory_gb}},
                              "nodes": [{"type": "V100", "devices_per_node": per_node, "count": nodes}]})


def aceso_config(plan, model_size: str) -> dict:
    """``plan`` (one pipeline) in Aceso's config format (``search/aceso_utils.py``
    ``read_config_from_json``): per stage its op count and, per op, tp, dp, recompute
    (0/1) and algorithm 0, over Aceso's GPT op list (embedding, 13 ops per layer, final
    layernorm and head).  Our layer ops are Aceso's, one for one and in the same order."""
    if len(plan.pipelines) != 1:
        raise ValueError(f"Aceso's config holds one pipeline, the plan has {len(plan.pipelines)}")
    spec, pipe = plan.model, plan.pipelines[0]
    keys = ("num_gpus", "checkpoint_activations", "resharding_stages", "num_ops_in_each_stage",
            "model_parallel_size_of_each_op", "data_parallel_size_of_each_op", "recompute_ops", "algo_of_each_op")
    cfg = {"model_name": "gpt", "model_size": model_size, "num_layers": spec.num_layers,
           "seq_length": spec.seq_len, "max_position_embeddings": spec.seq_len,
           "num_attention_heads": spec.heads, "hidden_size": spec.hidden, "global_batch_size": plan.gbs,
           "micro_batch_size": pipe.mbs, "num_stages": len(pipe.stages), **{k: [] for k in keys}}
    for j, st in enumerate(pipe.stages):
        recompute = [0] if j == 0 else []                       # the embedding
        for layer in range(*st.layers):
            redo = {op for op in st.recompute if layer in st.recompute_layers(spec, op)}
            recompute += [int(op in redo) for op in st.held_ops(spec, layer)]
        recompute += [0, 0] if j == len(pipe.stages) - 1 else []  # final layernorm, head
        n = len(recompute)
        for key, value in zip(keys, (len(st.ranks), any(recompute), False, n, [st.tp] * n, [st.dp] * n,
                                     recompute, [0] * n)):
            cfg[key].append(value)
    return cfg


def aceso_score(plan, model_size: str, repo: Path, profiles: Path, nodes: int, per_node: int) -> tuple:
    """(iteration ms, largest stage memory MB) of ``plan`` in Aceso's cost model."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(aceso_config(plan, model_size)))
        out = subprocess.run([sys.executable, "aceso_cost_model.py", "--initial-point", str(cfg),
                              "--profiled-time-path", f"{profiles}/", "--num-gpus-per-node", str(per_node),
                              "--num-nodes", str(nodes), "--model-name", "gpt", "--model-size", model_size,
                              "--num-layers", str(plan.model.num_layers), "--global-batch-size", str(plan.gbs),
                              "--micro-batch-size", "1", "2", "4", "8", "--memory-limit", "28000"],
                             cwd=repo / "search", capture_output=True, text=True, check=True).stdout
    return (float(re.search(r"overall time = ([\d.]+) ms", out).group(1)),
            float(re.search(r"max allocated memory = ([\d.]+) MB", out).group(1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aceso-dir", required=True, help="Aceso's profiler/profiled-time-eurosys folder")
    ap.add_argument("--aceso-repo", type=Path, help="a SuperScaler checkout (branch Aceso): also score the plans "
                                                     "of one pipeline in Aceso's cost model")
    ap.add_argument("--memory-mb", type=float, default=28000,
                    help="device memory our planner plans for, MB of 2^20 bytes (Aceso's limit stays 28000)")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args(argv)
    print(f"{'model':10} {'cluster':18} {'whole layers ms':>16} {'search s':>9} "
          f"{'--op-boundaries ms':>19} {'search s':>9} {'stages':>7}")
    scored = []
    for aceso_model, model, nodes, per_node in CASES:
        db = ProfileDB({"V100": DeviceProfile(import_aceso(args.aceso_dir, "V100", model, aceso_model=aceso_model))})
        row = []
        for op_boundaries in (False, True):
            opt = SearchOptions(gbs=1024, setup=SETUP, op_boundaries=op_boundaries, jobs=args.jobs)
            t0 = time.perf_counter()
            plan = search(model, cluster(nodes, per_node, args.memory_mb * 2 ** 20 / 1e9,
                                         inter_node_gbps(args.aceso_dir)), db, opt)
            row.append((plan.predicted["iteration_ms"], time.perf_counter() - t0, plan))
        stages = "+".join(str(len(p.stages)) for p in row[1][2].pipelines)
        print(f"{aceso_model:10} {f'{nodes} x {per_node} V100':18} {row[0][0]:16.2f} {row[0][1]:9.2f} "
              f"{row[1][0]:19.2f} {row[1][1]:9.2f} {stages:>7}")
        if args.aceso_repo:
            size = aceso_model.split("_", 1)[1]
            for label, (_, _, plan) in zip(("whole layers", "--op-boundaries"), row):
                if len(plan.pipelines) > 1:
                    scored.append(f"{aceso_model:10} {label:16} {len(plan.pipelines)} pipelines: not expressible")
                    continue
                ms, mb = aceso_score(plan, size, args.aceso_repo, Path(args.aceso_dir), nodes, per_node)
                scored.append(f"{aceso_model:10} {label:16} {ms:12.2f} ms {mb:10.2f} MB"
                              f"{'  (over 28000 MB)' if mb > 28000 else ''}")
    if scored:
        print("\nin Aceso's cost model (search/aceso_cost_model.py):")
        print("\n".join(scored))
    return 0


if __name__ == "__main__":
    sys.exit(main())
