"""megatron/hpp/data/datasets.py: --data-path / --split parsing and checks, and the GPTSource
contract (deterministic, every sample of a global batch once, plan-independent) on
megatron-core's GPTDataset / BlendedDataset without a process group."""
import collections
import io

import numpy
import pytest
import torch

from _data_helpers import labelled_docs, write_docs
from eth.errors import SpecError
from megatron.hpp.data import datasets as ds
from megatron.hpp.data.datasets import DataConfig, build_sources, check_data, parse_data_path, shipped_corpus


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.mark.parametrize("tokens, prefixes, weights", [
    (["a"], ("a",), None),
    (["a", "b.bin"], ("a", "b"), None),
    (["0.7", "a", "0.3", "b.idx"], ("a", "b"), (0.7, 0.3)),
    (["3", "x"], ("x",), (3.0,)),
])
def test_parse_data_path(tokens, prefixes, weights):
    assert parse_data_path(tokens) == (prefixes, weights)


@pytest.mark.parametrize("tokens, message", [
    ([], "--data-path is empty"),
    (["0.7", "a", "b"], "a weight needs a prefix after it"),
    (["0.7", "a", "x", "b"], "'x' is not a weight"),
    (["0", "a"], "weight of a must be a positive number, got 0.0"),
    (["nan", "a", "1", "b"], "weight of a must be a positive number, got nan"),
    (["1", "2", "3", "4"], "weights and prefixes must alternate"),
])
def test_parse_data_path_errors(tokens, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(")):
        parse_data_path(tokens)


@pytest.mark.parametrize("split", ["98,2,0", "969,30,1", "1", "7, 3", "0.5/0.25/0.25", "100,0,1"])
@pytest.mark.parametrize("num_docs", [1, 7, 1907])
def test_split_ranges_match_megatron(split, num_docs):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    theirs = [None if m is None else (int(round(m[0] * num_docs)), int(round(m[1] * num_docs)))
              for m in matrix]
    assert ds.split_ranges(num_docs, ds.parse_split(split)) == theirs


@pytest.mark.parametrize("split", ["", "1,2,3,4", "0,1", "a,b", "98;2"])
def test_bad_split(split):
    with pytest.raises(SpecError, match="--split"):
        ds.parse_split(split)


def test_check_prefix_says_what_is_wrong(tmp_path):
    prefix = write_docs(tmp_path / "d" / "corpus", labelled_docs(4, 50))
    assert ds.check_prefix(prefix).num_tokens == 200
    with pytest.raises(SpecError, match=f"--data-path {tmp_path / 'd'} is a directory; .* such as {prefix}$"):
        ds.check_prefix(str(tmp_path / "d"))
    (tmp_path / "book.txt").write_text("text")
    with pytest.raises(SpecError, match="is a plain file; convert it first: tools/preprocess_data.py"):
        ds.check_prefix(str(tmp_path / "book.txt"))
    with pytest.raises(SpecError, match=r"nope.bin and .*nope.idx do not exist"):
        ds.check_prefix(str(tmp_path / "nope"))
    with open(prefix + ".bin", "r+b") as fh:  # a .bin cut short
        fh.truncate(150)
    with pytest.raises(SpecError, match="has 150 bytes, .* describes 200 tokens of 1 bytes"):
        ds.check_prefix(prefix)
    (tmp_path / "d" / "corpus.idx").write_bytes(b"not an index at all, no" * 3)
    with pytest.raises(SpecError, match="not a megatron-core index file"):
        ds.check_prefix(prefix)


def test_check_data_refuses_empty_splits_and_small_vocab(tmp_path):
    prefix = write_docs(tmp_path / "c", labelled_docs(10, 40))
    check_data(DataConfig((prefix,), seq_len=32, vocab=256, split="90,10,0"))
    with pytest.raises(SpecError, match=r"the valid part of .* is documents \[10, 10\) of 10, 0 tokens; "
                                        r"a sample needs 33"):
        check_data(DataConfig((prefix,), seq_len=32, vocab=256, split="98,2,0"))
    with pytest.raises(SpecError, match="holds byte tokens \\(0..255\\), the model's vocab is 128"):
        check_data(DataConfig((prefix,), seq_len=32, vocab=128, split="90,10,0"))


def _tokens(dataset, pos):
    item = dataset[pos]
    return torch.cat([item["tokens"], item["labels"][-1:]])


def test_shipped_corpus_samples_are_the_text_in_megatron_order():
    cfg = DataConfig((shipped_corpus(),), seq_len=32, vocab=256, seed=7)
    src = build_sources(cfg, gbs=16, train_iters=6, valid_iters=1, progress=False)
    corpus = open(shipped_corpus() + ".bin", "rb").read()
    positions, plain = [], 0
    for t in range(6):
        for i in range(16):
            s = src.train.sample(t, i)
            assert s.dtype == torch.int64 and s.shape == (33,)
            assert torch.equal(s, _tokens(src.train.dataset, t * 16 + i))  # sample i of batch t
            positions.append(int(src.train.dataset.shuffle_index[t * 16 + i]))
            if 0 not in s.tolist():  # inside one paragraph: a verbatim piece of the corpus
                assert bytes(s.tolist()) in corpus
                plain += 1
    assert plain > 48
    assert len(set(positions)) == 96  # no sample twice in the first 6 global batches
    assert isinstance(src.train.dataset.shuffle_index, numpy.memmap)  # indices memory-mapped
    assert src.valid is not None and bytes(src.valid.sample(0, 0).tolist()) in corpus


def test_samples_depend_on_seed_and_data_only(tmp_path, monkeypatch):
    cfg = DataConfig((shipped_corpus(),), seq_len=32, vocab=256, seed=3)
    first = build_sources(cfg, gbs=8, train_iters=3, progress=False).train
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other-cache"))  # rebuilt from scratch
    again = build_sources(cfg, gbs=8, train_iters=3, progress=False).train
    other = build_sources(DataConfig((shipped_corpus(),), seq_len=32, vocab=256, seed=4), gbs=8,
                          train_iters=3, progress=False).train
    same = [torch.equal(first.sample(t, i), again.sample(t, i)) for t in range(3) for i in range(8)]
    diff = [torch.equal(first.sample(t, i), other.sample(t, i)) for t in range(3) for i in range(8)]
    assert all(same) and sum(diff) < 3


def _plan(lbs_mbs_dp):
    from eth.spec.cluster import Cluster
    from eth.spec.model import get_model
    from eth.spec.plan import PipelinePlan, Plan, StagePlan

    n = sum(dp for _, _, dp in lbs_mbs_dp)
    cluster = Cluster.from_dict({"name": "t", "inter_node_gbps": 100,
                                 "nodes": [{"type": "A100", "devices_per_node": n}]})
    pipes, rank = [], 0
    for lbs, mbs, dp in lbs_mbs_dp:
        pipes.append(PipelinePlan(mbs, lbs, [StagePlan(list(range(rank, rank + dp)), "A100", 1, dp, (0, 4))]))
        rank += dp
    return Plan(model=get_model("tiny"), cluster=cluster, gbs=sum(x[0] for x in lbs_mbs_dp), pipelines=pipes)


@pytest.mark.parametrize("layout", [[(16, 4, 1)], [(10, 5, 1), (6, 2, 2)], [(8, 2, 2), (4, 4, 4), (4, 1, 1)]])
def test_every_plan_reads_each_sample_of_a_global_batch_once(layout):
    from megatron.hpp.data.batches import batch, sample_range

    plan = _plan(layout)
    src = build_sources(DataConfig((shipped_corpus(),), seq_len=32, vocab=256, seed=1), gbs=16,
                        train_iters=4, progress=False).train
    for t in (0, 3):
        whole = batch(src, t, 0, 16)
        seen = collections.Counter()
        for p, pipe in enumerate(plan.pipelines):
            dp = pipe.stages[0].dp
            for mb in range(pipe.num_microbatches):
                for d in range(dp):
                    start, end = sample_range(plan, p, mb, dp, d)
                    assert torch.equal(batch(src, t, start, end), whole[start:end])
                    seen.update(range(start, end))
        assert seen == collections.Counter(range(16))


def test_blend_weights_and_split_hold(tmp_path):
    # prefix a: documents 1..40 of byte 1..40, prefix b: bytes 101..140
    a = write_docs(tmp_path / "a", labelled_docs(40, 100, first_label=0))
    b = write_docs(tmp_path / "b", labelled_docs(40, 100, first_label=100))
    cfg = DataConfig(("0.7", a, "0.3", b), seq_len=16, vocab=256, seed=5, split="75,25,0")
    src = build_sources(cfg, gbs=20, train_iters=10, valid_iters=2, progress=False)
    assert type(src.train.dataset).__name__ == "BlendedDataset"
    from_a = 0
    for t in range(10):
        for i in range(20):
            values = set(src.train.sample(t, i).tolist()) - {0}
            assert values <= set(range(1, 31)) | set(range(101, 131))  # train: first 30 documents
            assert values <= set(range(1, 31)) or values <= set(range(101, 131))
            from_a += values <= set(range(1, 31))
            assert abs(from_a - 0.7 * (t * 20 + i + 1)) <= 1  # megatron blends greedily by weight
    for i in range(20):
        values = set(src.valid.sample(1, i).tolist()) - {0}
        assert values <= set(range(31, 41)) | set(range(131, 141))  # valid: the last 10


def test_sample_bounds_and_vocab(tmp_path):
    wide = write_docs(tmp_path / "w", [numpy.full(64, 300 + d, dtype=numpy.uint16) for d in range(8)],
                      dtype=numpy.uint16)
    src = build_sources(DataConfig((wide,), seq_len=8, vocab=1024, split="1"), gbs=4, train_iters=2,
                        progress=False).train
    assert set(src.sample(1, 3).tolist()) <= set(range(300, 308)) | {0}
    with pytest.raises(IndexError, match="need 0 <= index < gbs 4"):
        src.sample(0, 4)
    with pytest.raises(SpecError, match=f"global batch 500 needs sample 2000, the dataset was built for {len(src)}"):
        src.sample(500, 0)
    small = build_sources(DataConfig((wide,), seq_len=8, vocab=256, split="1"), gbs=4, train_iters=2,
                          progress=False).train
    with pytest.raises(SpecError, match=r"token id 30\d in sample \d+ is >= the model's vocab 256"):
        small.sample(0, 0)


def test_blend_by_size_needs_enough_samples(tmp_path):
    a = write_docs(tmp_path / "a", labelled_docs(4, 40))
    b = write_docs(tmp_path / "b", labelled_docs(4, 40))
    with pytest.raises(SpecError, match=r"yields 18 training samples of 17 tokens, 10 iterations x gbs 4 "
                                        r"need 40; give weights"):
        build_sources(DataConfig((a, b), seq_len=16, vocab=256, split="1"), gbs=4, train_iters=10,
                      progress=False)


def test_an_interrupted_index_build_is_never_used(tmp_path, monkeypatch):
    import torch.distributed as dist

    cfg = DataConfig((shipped_corpus(),), seq_len=32, vocab=256, split="98,2,0", seed=11)
    real = ds._build

    def dies(cfg_, cache_dir, sizes):  # write part of the indices, then die
        real(DataConfig((shipped_corpus(),), seq_len=32, vocab=256, split="100", seed=11), cache_dir, sizes)
        raise KeyboardInterrupt

    monkeypatch.setattr(ds, "_build", dies)
    with pytest.raises(KeyboardInterrupt):
        build_sources(cfg, gbs=8, train_iters=2, progress=False)
    assert not dist.is_initialized()  # the private one-rank group is gone
    root = tmp_path / "xdg" / "hpp-eth" / "datasets"
    assert [p.name for p in root.iterdir() if p.is_dir()] == []  # nothing half-built stays
    monkeypatch.setattr(ds, "_build", real)
    src = build_sources(cfg, gbs=8, train_iters=2, progress=False).train
    good = build_sources(cfg, gbs=8, train_iters=2, progress=False).train
    assert torch.equal(src.sample(1, 7), good.sample(1, 7))
    assert len([p for p in root.iterdir() if p.is_dir()]) == 1


def test_index_build_progress_bar_counts_indices(tmp_path):
    cfg = DataConfig(("1", shipped_corpus(), "2", shipped_corpus()), seq_len=32, vocab=256, seed=2)
    out = io.StringIO()
    with ds._solo_group(), ds._progress(ds._num_indices(cfg), True, delay=0, file=out) as counted:
        ds._build(cfg, str(tmp_path / "cache"), [64, 16, 0])
    # 2 prefixes x (train, valid) GPTDataset indices + 2 BlendedDataset indices, all built
    assert ds._num_indices(cfg) == 6 and counted.builds == 6
    assert "dataset index:" in out.getvalue() and "/6 [" in out.getvalue()
    with ds._solo_group(), ds._progress(6, True, delay=0, file=io.StringIO()) as counted:
        ds._build(cfg, str(tmp_path / "cache"), [64, 16, 0])
    assert counted.builds == 0  # all loaded from the cache


def test_a_resume_under_a_larger_global_batch_goes_on_from_the_consumed_samples(tmp_path, monkeypatch):
    """10 iterations of gbs 8 consumed 80 samples; resumed at gbs 16 the offset is
    80 - 10 x 16 = -80: global batch 10 reads samples 80..95 of the same order (the first
    run's batches 10 and 11), and the batches before the resume are never read."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = DataConfig((shipped_corpus(),), 32, 256, 1234)
    first = build_sources(cfg, 8, 500, progress=False).train
    second = build_sources(cfg, 16, 12, progress=False, train_samples=8 * 500, offset=80 - 10 * 16).train
    for i in range(8):
        assert torch.equal(second.sample(10, i), first.sample(10, i))
        assert torch.equal(second.sample(10, 8 + i), first.sample(11, i))
        assert torch.equal(second.sample(11, i), first.sample(12, i))
    with pytest.raises(IndexError, match="starts before sample 0"):
        second.sample(0, 0)
    with pytest.raises(SpecError, match="do not fit"):     # the index must hold what the run reads
        build_sources(cfg, 16, 300, progress=False, train_samples=8 * 500, offset=-80)
