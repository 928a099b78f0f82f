"""Memory per rank does not grow with the corpus: a generated ~200 MB corpus, read through
megatron/hpp/data/datasets.py in a fresh process, adds a few MB of private memory (the old
byte-file source held the whole file as int64: 8x the file).

What is measured: RssAnon, the process's own memory.  Pages of the memory-mapped .bin
that sampling touches (with the kernel's read-ahead) show up as RssFile: page cache,
shared by every rank on the node and reclaimable, so they are not counted here.  The
index build reads only the .idx, so the peak RSS right after it bounds its temporary
arrays."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from _data_helpers import write_docs

CORPUS_BYTES = 200 * 2 ** 20
DOC_TOKENS = 50_000


def _probe(prefix, cache):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_rss_probe.py")), str(prefix),
                           str(cache)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_rss_stays_flat_on_a_200mb_corpus(tmp_path):
    rng = numpy.random.default_rng(0)
    n_docs = CORPUS_BYTES // 2 // DOC_TOKENS
    prefix = write_docs(tmp_path / "big", (rng.integers(1, 50000, DOC_TOKENS, dtype=numpy.uint16)
                                           for _ in range(n_docs)), dtype=numpy.uint16)
    size = os.path.getsize(prefix + ".bin")
    assert size == n_docs * DOC_TOKENS * 2 and size > 190 * 2 ** 20
    first = _probe(prefix, tmp_path / "cache")   # builds the indices (cache miss)
    second = _probe(prefix, tmp_path / "cache")  # what every other rank does: cache hit
    assert first["checksum"] == second["checksum"] and first["samples"] == second["samples"] >= 6400
    for run in (first, second):
        grown = max(run["built_anon"], run["sampled_anon"]) - run["anon"]
        assert grown < 0.08 * size, (run, size)                  # < 16 MB for 200 MB of text
        assert run["built_peak"] - run["base"] < 0.15 * size, (run, size)
