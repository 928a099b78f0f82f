"""HPP planner (paper sections 4.2, 5, 6): pure Python, never imports torch.

Entry point: :func:`eth.planner.search.search` with :class:`eth.planner.options.SearchOptions`.
Modules: enumerate (search space), evaluate (Eq. 1 + recompute fitting), balance (stage
balancer), pipeline (phase 1/3, adaptive budgets), allocate (Eq. 2-5), polish (group-level
steps and final polish), bounds (section 5.2, Eq. 7-9), dynprog (Eq. 10), search
(driver), bruteforce (exhaustive reference for tests), baselines/ (section 7 baselines).
Text views of plans are in eth.report.
"""
