"""HPP planner (paper sections 4.2, 5, 6): pure Python, never imports torch.

Entry point: :func:`eth.planner.search.search` with :class:`eth.planner.options.SearchOptions`.
Modules: enumerate (search space), evaluate (Eq. 1 + recompute fitting), recompute_runs
(whole-run recompute), balance (stage balancer), pipeline (phase 1/3, adaptive budgets),
allocate (Eq. 2-5), polish (group-level steps and final polish), symmetric (k identical
pipelines), bounds (section 5.2, Eq. 7-9), dynprog (Eq. 10), search (driver), finish (the
search's end: symmetric phase + polish), workers (--jobs), progress (clock and progress
bar), bruteforce (exhaustive reference for tests), baselines/ (section 7 baselines).

Imports eth.spec, eth.layout, eth.profiles and eth.cost; text views of plans are in
eth.report.tables.
"""
