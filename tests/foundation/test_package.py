"""The package as pip builds it: every module and data file in the wheel, the console
entry points importable, and the CLI behaviour that item 5 of issue 9 asks for."""
import configparser
import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"hpp-search", "hpp-show", "hpp-profiles", "hpp-profile", "hpp-preprocess", "hpp-run"}


def _source_files() -> set[str]:
    """Every file the wheel must hold, as wheel paths."""
    files = {"pretrain_gpt.py"}
    for top in ("eth", "megatron/hpp"):
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.add(path.relative_to(ROOT).as_posix())
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build the wheel from a copy of the sources (the checkout's build/ stays untouched)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "setup.py", src)
    shutil.copy(ROOT / "pretrain_gpt.py", src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "eth", src / "eth", ignore=ignore)
    shutil.copytree(ROOT / "megatron" / "hpp", src / "megatron" / "hpp", ignore=ignore)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("hpp_eth-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(wheel.namelist())
    expected = _source_files()
    assert "eth/planner/baselines/__init__.py" in expected and "eth/data/devices.yaml" in expected
    assert any(f.startswith("megatron/hpp/corpus/") and f.endswith(".bin") for f in expected)
    missing = sorted(expected - names)
    assert not missing, missing
    assert "megatron/__init__.py" not in names  # the namespace portion stays one


def test_wheel_entry_points_are_importable_mains(wheel):
    (ep_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(ep_name).decode())
    scripts = dict(parser["console_scripts"])
    assert set(scripts) == ENTRY_POINTS
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_thin_tools_wrap_the_package_mains():
    for tool, module in [("search_hpp", "eth.cli.search_hpp"), ("show_plan", "eth.cli.show_plan"),
                         ("make_profiles", "eth.cli.make_profiles"), ("profile_ops", "megatron.hpp.cli.profile_ops"),
                         ("preprocess_data", "megatron.hpp.cli.preprocess_data"), ("run", "megatron.hpp.cli.run")]:
        text = (ROOT / "tools" / f"{tool}.py").read_text()
        assert f"from {module} import" in text and len(text.splitlines()) < 20, tool


def _run(module: str, *args):
    return subprocess.run([sys.executable, "-c", f"import sys, {module} as m; sys.exit(m.main())", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_search_refuses_a_directory_output_before_searching(tmp_path):
    # a 64-rank search would take minutes: the refusal comes first, on one line
    proc = _run("eth.cli.search_hpp", "--model", "gpt3-13b", "--cluster", "examples/clusters/b2b4-64.yaml",
                "--gbs", "1024", "-o", str(tmp_path), "--no-progress")
    assert proc.returncode == 2
    assert proc.stderr == f"error: -o {tmp_path} is a directory; give a file name (e.g. {tmp_path / 'plan.json'})\n"
    assert proc.stdout == ""


def test_show_legend_explains_every_heading_and_op():
    from eth.spec.model import LAYER_OPS
    from eth.report.tables import OP_ABBREV

    proc = _run("eth.cli.show_plan", "--legend")
    assert proc.returncode == 0, proc.stderr
    for word in ["Mbs", "Lbs", "TP/DP", "#L", "Recomp. Operator", "Fwd ms", "Mem GB", "Bubble", "Busy %"]:
        assert f"  {word} " in proc.stdout, word
    for op in LAYER_OPS:
        assert f"  {OP_ABBREV[op]:<5} {op} " in proc.stdout, op
    assert _run("eth.cli.show_plan").returncode == 2


def _profile_models(path):
    import json
    return sorted(m["name"] for m in json.loads(path.read_text())["models"])


def test_make_profiles_merges_and_refuses_empty(tmp_path, capsys):
    from eth.cli.make_profiles import main

    out = tmp_path / "p"
    assert main(["--devices", "A100,RTX3090", "--models", "tiny,small", "-o", str(out)]) == 0
    assert main(["--devices", "A100", "--models", "tiny", "--mbs", "1", "-o", str(out)]) == 0
    assert _profile_models(out / "A100.json") == ["small", "tiny"]      # merged, not replaced
    import json
    tiny = [m for m in json.loads((out / "A100.json").read_text())["models"] if m["name"] == "tiny"]
    assert len(tiny) == 1 and {e["mbs"] for e in tiny[0]["entries"]} == {1}  # same shape: replaced
    assert "merged into 1 existing files" in capsys.readouterr().out
    before = (out / "RTX3090.json").read_text()
    assert main(["--devices", "RTX3090,A100", "--models", "gpt3-13b", "--tp", "3", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tp 3" in err and "heads 40" in err and "nothing written" in err
    assert (out / "RTX3090.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["A100.json", "RTX3090.json"]
    # an existing file of another device is not merged into
    (out / "A100.json").rename(out / "V100.json")
    assert main(["--devices", "V100", "--models", "tiny", "-o", str(out)]) == 2
    assert "holds device 'A100', not 'V100'" in capsys.readouterr().err


def test_make_profiles_refuses_an_unwritable_output_and_a_flag_it_would_ignore(tmp_path, capsys):
    """One line and exit 2 before any work (and nothing written to the default folder)."""
    from eth.cli.make_profiles import main

    (tmp_path / "file").write_text("x")
    for argv, said in (
            (["-o", str(tmp_path / "file" / "sub")], f"-o {tmp_path / 'file' / 'sub'} cannot be written: "
                                                     f"{tmp_path / 'file'} is a file, not a folder"),
            (["-o", "/proc/nope"], "-o /proc/nope cannot be written"),
            (["--size-unit-bytes", "0", "-o", str(tmp_path / "p")], "--size-unit-bytes only applies with --import-aceso"),
            (["--import-aceso", str(tmp_path), "--device", "V100", "--model", "tiny", "--size-unit-bytes", "nan",
              "-o", str(tmp_path / "v.json")], "--size-unit-bytes must be a positive number of bytes, got nan"),
            (["--import-aceso", str(tmp_path), "--device", "V100", "--model", "tiny",
              "-o", str(tmp_path / "file" / "v.json")], "cannot be written")):
        assert main(["--devices", "A100", "--models", "tiny", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and said in err, (argv, err)
    assert not (tmp_path / "p").exists()


def test_hpp_run_says_where_it_waits_and_summarises_a_failure(monkeypatch, capsys):
    """hpp-run (megatron/hpp/cli/run.py) around torch's launcher (stubbed here): the
    rendezvous it waits at on several nodes, and one line per kind of failure."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from megatron.hpp.cli.run import main

    outcome = {}

    def fake_run(args):
        if "raise" in outcome:
            raise outcome["raise"]

    monkeypatch.setattr(torchrun, "run", fake_run)
    elastic = ["--nnodes", "3:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400", "--rdzv-id", "job7",
               "train.py"]
    assert main(elastic) == 0
    assert capsys.readouterr().err == "hpp-run: waiting at the rendezvous host:29400 (run id job7) for 3 to 4 nodes\n"
    assert main(["--nproc-per-node", "2", "train.py"]) == 0 and capsys.readouterr().err == ""
    for code, line, exit_code in ((2, "", 2), (1, "error: rank 3 exited with code 1 (its output is above)\n", 1),
                                  (-9, "error: rank 3 was killed by SIGKILL\n", 137)):
        failure = ProcessFailure(local_rank=3, pid=1234, exitcode=code, error_file="")
        outcome["raise"] = ChildFailedError("train.py", {3: failure})
        assert main(["--nproc-per-node", "4", "train.py"]) == exit_code
        assert capsys.readouterr().err == line
    outcome["raise"] = SignalException("stopped", sigval=15)
    assert main(["--nproc-per-node", "4", "train.py"]) == 143
    assert capsys.readouterr().err == "hpp-run: stopped by SIGTERM\n"
