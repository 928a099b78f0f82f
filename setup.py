"""HPP: data-balanced heterogeneous pipeline parallelism on Megatron-core.

Install torch first (pinned) so that pip does not pull a CUDA build:
    pip install torch==2.13.0 && pip install -e .[runtime,test]
"""
from setuptools import find_packages, setup

# `megatron` is a namespace portion: it has no __init__.py and merges with the installed
# megatron-core (megatron.core).  Never add megatron/__init__.py.  So `megatron.hpp` is
# named here and only its sub-packages (and all of eth's) are found automatically.
PACKAGES = (find_packages(include=["eth", "eth.*"])
            + ["megatron.hpp"] + [f"megatron.hpp.{p}" for p in find_packages("megatron/hpp")])

CLI = {
    "hpp-search": "eth.cli.search_hpp:main",        # tools/search_hpp.py
    "hpp-show": "eth.cli.show_plan:main",            # tools/show_plan.py
    "hpp-profiles": "eth.cli.make_profiles:main",    # tools/make_profiles.py
    "hpp-profile": "megatron.hpp.cli.profile_ops:main",        # tools/profile_ops.py
    "hpp-preprocess": "megatron.hpp.cli.preprocess_data:main",  # tools/preprocess_data.py
    "hpp-run": "megatron.hpp.cli.run:main",           # tools/run.py: torchrun, failures in one line
}

setup(
    name="hpp-eth",
    version="0.1.0",
    description="Data-balanced heterogeneous pipeline parallelism (ETH planner + Megatron runtime)",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_data={"eth": ["data/*.yaml"], "megatron.hpp": ["corpus/*"]},
    py_modules=["pretrain_gpt"],
    entry_points={"console_scripts": [f"{name} = {target}" for name, target in CLI.items()]},
    install_requires=["numpy>=1.24", "pyyaml>=6", "tqdm>=4.60", "matplotlib>=3.7"],
    extras_require={
        "runtime": ["torch>=2.6", "megatron-core>=0.16.1,<0.20"],
        # a local HuggingFace tokenizer.json for tools/preprocess_data.py --tokenizer-json
        "data": ["tokenizers>=0.15"],
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "test": ["pytest>=7", "tokenizers>=0.15"],
    },
)
