"""Write the paper's Table 2 cluster scales for every device pair to examples/clusters/.

    python examples/make_clusters.py          # rewrites the YAML files next to this script

Each file: N nodes x M devices of type A_i followed by N x M of type A_j (ranks of
A_i first), 200 Gbps between nodes of one type and 100 Gbps between nodes of
different types (paper section 7.1); intra-node links from the device catalog.
"""
from pathlib import Path

import yaml

PAIRS = {"b2b3": ("910B2", "910B3"), "b2b4": ("910B2", "910B4"),
         "b3b4": ("910B3", "910B4"), "a100-3090": ("A100", "RTX3090")}
# model preset -> (nodes per type, devices per node), paper Table 2
SCALES = {"gpt3-350m": (1, 2), "gpt3-1.3b": (2, 2), "gpt3-2.6b": (2, 4), "gpt3-6.7b": (4, 4),
          "gpt3-13b": (4, 8), "llama2-70b": (32, 8), "gpt3-175b": (64, 8)}


def cluster(pair: str, nodes: int, per_node: int) -> dict:
    a, b = PAIRS[pair]
    return {"version": 1, "name": f"{pair}-{2 * nodes * per_node}",
            "inter_node_gbps": 200, "inter_type_gbps": 100,
            "nodes": [{"type": a, "devices_per_node": per_node, "count": nodes},
                      {"type": b, "devices_per_node": per_node, "count": nodes}]}


def main() -> None:
    out = Path(__file__).resolve().parent / "clusters"
    out.mkdir(exist_ok=True)
    for pair in PAIRS:
        for model, (nodes, per_node) in SCALES.items():
            spec = cluster(pair, nodes, per_node)
            path = out / f"{spec['name']}.yaml"
            header = (f"# {model} scale of the paper's Table 2: {nodes}x{per_node}x{PAIRS[pair][0]}"
                      f" + {nodes}x{per_node}x{PAIRS[pair][1]}\n")
            path.write_text(header + yaml.safe_dump(spec, sort_keys=False, default_flow_style=None))
    print(f"wrote {len(PAIRS) * len(SCALES)} cluster files to {out}")


if __name__ == "__main__":
    main()
