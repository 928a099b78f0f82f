"""ETH: the HPP planner.  Pure Python (numpy, pyyaml); never imports torch or megatron.

Packages, each importing only those above it in this list:
  errors, fileio  one-line errors for bad input; reading files, atomic writes
  spec/       the typed, versioned descriptions: device catalog + cluster, model, training
              setup (precision, ZeRO), the plan format
  layout/     the model's logical parameters and the block-wise All-Reduce layout of a plan
  profiles/   op costs per device type: the profile DB, analytic profiles, GEMM efficiency,
              the Aceso importer
  cost/       the cost model: Eq. 1, 5, 6, stage time and memory, gradient sync cost
  planner/    the HPP search (sections 4.2, 5) and the baselines (section 7)
  report/     what a plan does: text tables, the event-driven simulator, Gantt charts
  cli/        the bodies of the command-line tools (tools/*.py, console scripts)
"""
__version__ = "0.1.0"
