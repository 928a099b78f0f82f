"""Run by test_datasets_ranks.py as one rank of a gloo world: build the sources, print a
digest of every sample of the first global batches."""
import hashlib
import json
import sys

import torch.distributed as dist


def main() -> int:
    from eth.errors import SpecError
    from megatron.hpp.data.datasets import DataConfig, build_sources, shipped_corpus
    from megatron.hpp.rank_exit import exit_rank

    dist.init_process_group("gloo")
    try:
        src = build_sources(DataConfig((shipped_corpus(),), seq_len=32, vocab=256, seed=9), gbs=8,
                            train_iters=4, progress=True)
    except SpecError as exc:
        print(f"error: rank {dist.get_rank()}: {exc}", file=sys.stderr, flush=True)
        # end without tearing gloo down (the peer may have left), as megatron.hpp.training.loop
        # does after a failure: rc -6 after the right line was seen in a CI run
        exit_rank(2)
    digest = hashlib.sha256()
    for t in range(4):
        for i in range(8):
            digest.update(bytes(src.train.sample(t, i).tolist()))
    print(json.dumps({"rank": dist.get_rank(), "digest": digest.hexdigest(),
                      "mmap": type(src.train.dataset.shuffle_index).__name__}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from megatron.hpp.rank_exit import exit_rank

    exit_rank(main())
