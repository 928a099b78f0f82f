"""Bodies of the planner's command-line tools, one module per tool, named as in tools/:
search_hpp, show_plan, make_profiles, fit_gemm_efficiency; common holds the one-line-error
plumbing (exit code 2) that the runtime's CLIs use too.  Nothing imports these but tools/
and the console scripts.
"""
