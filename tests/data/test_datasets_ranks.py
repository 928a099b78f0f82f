"""build_sources under a process group (2 gloo ranks): rank 0 builds the index cache,
both ranks read the same samples as a build without a process group; a cache directory
that the ranks do not share ends every rank with the same one-line error."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from _rt_spawn import rendezvous  # noqa: E402  (the runtime tests' race-free rendezvous)

PROBE = Path(__file__).with_name("_ranks_probe.py")


def _launch(caches):
    with rendezvous() as meet:
        procs = []
        for rank, cache in enumerate(caches):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(caches)), OMP_NUM_THREADS="1",
                       PYTHONWARNINGS="ignore", XDG_CACHE_HOME=str(cache), **meet)
            procs.append(subprocess.Popen([sys.executable, str(PROBE)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        try:
            return [(p.wait(timeout=180), p.stdout.read(), p.stderr.read()) for p in procs]
        finally:
            for p in procs:
                p.kill()


def _expected(tmp_path, monkeypatch) -> str:
    from megatron.hpp.data.datasets import DataConfig, build_sources, shipped_corpus

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "alone"))
    src = build_sources(DataConfig((shipped_corpus(),), seq_len=32, vocab=256, seed=9), gbs=8,
                        train_iters=4, progress=False).train
    digest = hashlib.sha256()
    for t in range(4):
        for i in range(8):
            digest.update(bytes(src.sample(t, i).tolist()))
    return digest.hexdigest()


@pytest.mark.slow
def test_two_ranks_share_one_cache_and_read_the_same_samples(tmp_path, monkeypatch):
    results = _launch([tmp_path / "shared", tmp_path / "shared"])
    outs = []
    for rc, out, err in results:
        assert rc == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0]["digest"] == outs[1]["digest"] == _expected(tmp_path, monkeypatch)
    assert outs[0]["mmap"] == outs[1]["mmap"] == "memmap"
    built = [p for p in (tmp_path / "shared" / "hpp-eth" / "datasets").iterdir() if p.is_dir()]
    assert len(built) == 1 and not built[0].name.endswith("partial")


@pytest.mark.slow
def test_unshared_cache_is_one_line_on_every_rank(tmp_path):
    results = _launch([tmp_path / "node0", tmp_path / "node1"])  # each rank its own cache folder
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 2, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        root = tmp_path / f"node{rank}" / "hpp-eth" / "datasets"
        assert lines == [f"error: rank {rank}: data index cache {root} is not one folder that every rank "
                         f"sees: --data-cache-path must be on a file system all nodes share"], err
    assert not any(p.is_dir() for p in (tmp_path / "node0" / "hpp-eth" / "datasets").iterdir())


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="gloo ranks on one Linux machine")
