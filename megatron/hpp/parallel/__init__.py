"""How a plan's ranks are laid out and run: ``topology`` (plan -> one immutable Topology
per rank with every process group; ``python -m megatron.hpp.parallel.topology --dry-run``),
``launch`` (the start-up check of hosts against the plan's node-major rank order),
``schedule`` (per-pipeline 1F1B, stage-boundary resharding, CPU speed emulation).
Imports megatron.hpp.data and eth."""
