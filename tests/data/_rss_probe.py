"""Run by test_datasets_memory.py in a fresh process: RSS around building and sampling."""
import json
import sys

import numpy


def status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(prefix: str, cache: str) -> None:
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    from megatron.hpp.data.datasets import DataConfig, build_sources

    base, anon = status("VmRSS"), status("RssAnon")
    cfg = DataConfig((prefix,), seq_len=256, vocab=50000, split="99,1,0", cache_path=cache)
    src = build_sources(cfg, gbs=64, train_iters=100, valid_iters=1, progress=False)
    built, built_anon, built_peak = status("VmRSS"), status("RssAnon"), status("VmHWM")
    rng = numpy.random.default_rng(0)
    total = 0
    for _ in range(2000):  # samples from all over the corpus
        total += int(src.train.sample(int(rng.integers(100)), int(rng.integers(64))).sum())
    print(json.dumps({"base": base, "built": built, "built_peak": built_peak, "sampled": status("VmRSS"),
                      "anon": anon, "built_anon": built_anon, "sampled_anon": status("RssAnon"),
                      "samples": len(src.train), "checksum": total}))


if __name__ == "__main__":
    main(*sys.argv[1:])
