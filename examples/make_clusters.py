"""Write the example clusters to examples/clusters/: the paper's Table 2 scales for every
device pair, and mixed fleets of three to six device types (MIXES).

    python examples/make_clusters.py          # rewrites the YAML files next to this script

Each file: N nodes x M devices of type A_i followed by N x M of type A_j (ranks of
A_i first), 200 Gbps between nodes of one type and 100 Gbps between nodes of
different types (paper section 7.1); intra-node links from the device catalog.
A mix ``mixed<T>-<N>`` has T catalog types, 8 devices per node, in the order listed.
"""
from pathlib import Path

import yaml

PAIRS = {"b2b3": ("910B2", "910B3"), "b2b4": ("910B2", "910B4"),
         "b3b4": ("910B3", "910B4"), "a100-3090": ("A100", "RTX3090")}
# model preset -> (nodes per type, devices per node), paper Table 2
SCALES = {"gpt3-350m": (1, 2), "gpt3-1.3b": (2, 2), "gpt3-2.6b": (2, 4), "gpt3-6.7b": (4, 4),
          "gpt3-13b": (4, 8), "llama2-70b": (32, 8), "gpt3-175b": (64, 8)}

# Mixed fleets: name -> {device type: devices}.  The 48-64-device mixes are the many-type
# quality table of bench/paper_eval.py; the larger ones are bench/search_scaling.py's rows.
MIXES = {
    "mixed3-48": {"H100": 16, "A100-40GB": 16, "V100": 16},
    "mixed3-96": {"H100": 32, "A100-40GB": 32, "V100": 32},
    "mixed4-64": {"H100": 16, "A100": 16, "A100-40GB": 16, "RTX3090": 16},
    "mixed4-256": {"H100": 64, "A100": 64, "A100-40GB": 64, "RTX3090": 64},
    "mixed4-1024": {"H100": 256, "A100": 256, "A100-40GB": 256, "RTX3090": 256},
    "mixed6-48": {"H100": 8, "A100": 8, "A100-40GB": 8, "RTX3090": 8, "V100": 8, "L40S": 8},
    "mixed6-4096": {"H100": 1024, "A100": 1024, "A100-40GB": 512, "RTX3090": 512, "V100": 512, "L40S": 512},
}


def mix(name: str) -> dict:
    return {"version": 1, "name": name, "inter_node_gbps": 200, "inter_type_gbps": 100,
            "nodes": [{"type": t, "devices_per_node": 8, "count": n // 8} for t, n in MIXES[name].items()]}


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
    for name, types in MIXES.items():
        header = "# mixed fleet: " + " + ".join(f"{n // 8}x8x{t}" for t, n in types.items()) + "\n"
        (out / f"{name}.yaml").write_text(header + yaml.safe_dump(mix(name), sort_keys=False,
                                                                  default_flow_style=None))
    print(f"wrote {len(PAIRS) * len(SCALES) + len(MIXES)} cluster files to {out}")


if __name__ == "__main__":
    main()
