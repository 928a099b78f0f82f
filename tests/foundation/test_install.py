"""The installed package imports from any directory, next to megatron-core."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_megatron_is_a_namespace_portion():
    assert not (ROOT / "megatron" / "__init__.py").exists(), "megatron/__init__.py would hide megatron.core"


def test_imports_from_another_directory(tmp_path):
    code = ("import eth, eth.planner, megatron.core, megatron.hpp, pretrain_gpt; "
            "print(eth.__file__); print(megatron.core.__file__); print(megatron.hpp.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    eth_file, core_file, hpp_file = proc.stdout.split()
    assert Path(eth_file).is_relative_to(ROOT) and Path(hpp_file).is_relative_to(ROOT)
    assert "site-packages" in core_file


def test_planner_never_imports_torch(tmp_path):
    code = ("import sys, eth.spec.cluster, eth.spec.model, eth.profiles.db, eth.cost.model, eth.spec.plan, eth.planner; "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
