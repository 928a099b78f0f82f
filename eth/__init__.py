"""ETH: the HPP planner (pure Python; never imports torch).

Modules: cluster (devices), model (GPT shapes), profiles (op costs), cost (Eq. 1, 5, 6
and memory), plan (the plan format), planner/ (the search), simulate (1F1B simulator).
"""
__version__ = "0.1.0"
