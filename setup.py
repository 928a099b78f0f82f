"""HPP: data-balanced heterogeneous pipeline parallelism on Megatron-core.

Install torch first (pinned) so that pip does not pull a CUDA build:
    pip install torch==2.13.0 && pip install -e .[runtime,test]
"""
from setuptools import setup

setup(
    name="hpp-eth",
    version="0.1.0",
    description="Data-balanced heterogeneous pipeline parallelism (ETH planner + Megatron runtime)",
    python_requires=">=3.10",
    # `megatron` is a namespace portion: it has no __init__.py and merges with the
    # installed megatron-core (megatron.core).  Never add megatron/__init__.py.
    packages=["eth", "eth.planner", "megatron.hpp"],
    package_data={"eth": ["data/*.yaml"]},
    py_modules=["pretrain_gpt"],
    install_requires=["numpy>=1.24", "pyyaml>=6", "networkx>=3", "tqdm>=4.60", "matplotlib>=3.7"],
    extras_require={
        "runtime": ["torch>=2.6", "megatron-core>=0.16.1,<0.20"],
        "gpu": ["transformer-engine[pytorch]", "apex"],
        "test": ["pytest>=7"],
    },
)
