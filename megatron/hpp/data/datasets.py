"""Training text from megatron-core indexed datasets (``.bin``/``.idx``, written by
tools/preprocess_data.py), read memory-mapped through megatron-core's
``BlendedMegatronDatasetBuilder`` + ``GPTDataset`` (+ ``BlendedDataset`` for weighted
blends), as Megatron-LM reads them.

``--data-path`` follows Megatron: ``PREFIX`` / ``PREFIX PREFIX ...`` (blend in
proportion to size) or ``W PREFIX W PREFIX ...`` (blend by weight, e.g.
``0.7 books 0.3 web``); ``--split 98,2,0`` cuts every prefix's documents into train,
valid and test.  :func:`check_data` validates all of it in pure Python (no torch, no
process group), so bad input ends every rank with one line before anything starts.

Sample order (the :class:`GPTSource` contract the trainer relies on):

    sample i of global batch t  =  dataset[offset + t * gbs + i]        0 <= i < gbs

``offset`` is 0, except in a run resumed under another global batch: the checkpoint's
consumed samples minus its iteration x the new gbs (negative under a larger one: the
global batches before the resume are then never read), so that the run goes on with
the first sample not yet trained on, as Megatron's consumed-samples counter does.

megatron-core shuffles documents and samples with ``seed``, so the order is a function
of (data files, split, seq_len, seed, number of samples built) only: not of the plan,
the rank or the number of ranks.  Every sample of a global batch is read once, by the
rank whose (pipeline, micro-batch, dp rank) slice holds it (megatron/hpp/data/batches.py).

Memory: the ``.bin`` files are memory-mapped and only the pages of the samples a rank
reads are touched; the index arrays (document, sample and shuffle indices; blend
indices) are built once, written to a cache directory and memory-mapped from there
too, so a rank's memory does not grow with the corpus.

Index cache (``cache_path``, Megatron's ``--data-cache-path``; default
``$XDG_CACHE_HOME/hpp-eth/datasets``): one directory per (files, sizes, mtimes, split,
seq_len, seed, sample counts).  It is built under ``<key>.partial`` and renamed when
complete, so an interrupted build is never mistaken for a finished one.  With a process
group, rank 0 builds (megatron-core's rank-0-first protocol) while the others wait; the
directory must then be on a file system every rank sees.  Without a process group
(tools, tests) builders on one machine take turns through a file lock, and the build
runs in a private one-rank gloo group because megatron-core's ``BlendedDataset`` asks
``torch.distributed.get_rank()`` on a cache miss.  A build that takes more than a second
shows a progress bar (one step per index) on stderr.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from eth.errors import SpecError

DEFAULT_SPLIT = "98,2,0"
SPLITS = ("train", "valid", "test")
_IDX_MAGIC = b"MMIDIDX\x00\x00"
# megatron-core's DType codes (indexed_dataset.DType): code -> (name, bytes)
_DTYPES = {1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4), 5: ("int64", 8),
           8: ("uint16", 2)}


def parse_data_path(tokens) -> tuple[tuple[str, ...], tuple[float, ...] | None]:
    """Megatron's ``--data-path`` list -> (prefixes, weights or None)."""
    tokens = [str(t) for t in tokens]
    if not tokens:
        raise SpecError("--data-path is empty")

    def number(text):
        try:
            return float(text)
        except ValueError:
            return None

    weighted = len(tokens) % 2 == 0 and number(tokens[0]) is not None
    if weighted:
        weights = [number(t) for t in tokens[0::2]]
        prefixes = tokens[1::2]
        bad = [tokens[2 * i] for i, w in enumerate(weights) if w is None]
        if bad:
            raise SpecError(f"--data-path {' '.join(tokens)}: weights and prefixes must alternate "
                            f"(W PREFIX W PREFIX ...); {bad[0]!r} is not a weight")
        for w, p in zip(weights, prefixes):
            if not math.isfinite(w) or w <= 0:
                raise SpecError(f"--data-path weight of {p} must be a positive number, got {w}")
        if any(number(p) is not None for p in prefixes):
            raise SpecError(f"--data-path {' '.join(tokens)}: weights and prefixes must alternate "
                            f"(W PREFIX W PREFIX ...)")
    else:
        prefixes, weights = tokens, None
        if any(number(p) is not None for p in prefixes):
            raise SpecError(f"--data-path {' '.join(tokens)}: a weight needs a prefix after it "
                            f"(W PREFIX W PREFIX ...)")
    prefixes = [p[:-4] if p.endswith((".bin", ".idx")) else p for p in prefixes]
    return tuple(prefixes), (tuple(weights) if weights else None)


def parse_split(split: str) -> tuple[float, float, float]:
    """"98,2,0" -> normalised (train, valid, test) fractions, as megatron-core reads it."""
    parts = re.findall(r"[.0-9]+", split)
    if not parts or len(parts) > 3 or re.sub(r"[.0-9,\s/]", "", split):
        raise SpecError(f"--split {split!r} must be up to three numbers, e.g. 98,2,0")
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(values) <= 0 or values[0] <= 0:
        raise SpecError(f"--split {split!r} gives the training set no share")
    total = sum(values)
    return tuple(v / total for v in values)


def split_ranges(num_docs: int, fractions) -> list[tuple[int, int] | None]:
    """Document range of each split, exactly as megatron-core cuts them (None: no share)."""
    bounds, acc = [0.0], 0.0
    for f in fractions:
        acc += f
        bounds.append(acc)
    return [None if hi <= lo else (int(round(lo * num_docs)), int(round(hi * num_docs)))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class IndexInfo:
    """What a ``.idx`` file says (read without megatron-core or torch)."""

    prefix: str
    dtype: str
    token_bytes: int
    num_docs: int
    num_tokens: int

    @staticmethod
    def read(prefix: str) -> "IndexInfo":
        import numpy

        idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
        with open(idx, "rb") as fh:
            head = fh.read(34)
        if len(head) < 34 or head[:9] != _IDX_MAGIC:
            raise SpecError(f"{idx} is not a megatron-core index file (bad header)")
        version, code, count, docs = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in _DTYPES:
            raise SpecError(f"{idx}: unsupported version {version} or token type code {code}")
        name, size = _DTYPES[code]
        expected = 34 + 4 * count + 8 * count + 8 * docs
        if idx.stat().st_size < expected:
            raise SpecError(f"{idx} has {idx.stat().st_size} bytes, its header needs {expected} "
                            f"(truncated?)")
        lengths = numpy.memmap(idx, dtype=numpy.int32, mode="r", offset=34, shape=(count,))
        tokens = int(lengths.sum(dtype=numpy.int64))
        if bin_.stat().st_size != tokens * size:
            raise SpecError(f"{bin_} has {bin_.stat().st_size} bytes, {idx} describes {tokens} tokens "
                            f"of {size} bytes ({tokens * size} bytes): the pair does not match")
        return IndexInfo(prefix, name, size, int(count), tokens)

    def split_tokens(self, lo: int, hi: int) -> int:
        import numpy

        lengths = numpy.memmap(self.prefix + ".idx", dtype=numpy.int32, mode="r", offset=34,
                               shape=(self.num_docs,))
        return int(lengths[lo:hi].sum(dtype=numpy.int64))


def check_prefix(prefix: str) -> IndexInfo:
    """A readable ``prefix``.bin/.idx pair (else SpecError saying what ``prefix`` is)."""
    path = Path(prefix)
    if path.is_dir():
        found = sorted(str(p)[:-4] for p in path.glob("*.idx"))
        hint = f" such as {found[0]}" if found else ""
        raise SpecError(f"--data-path {prefix} is a directory; give the prefix of its .bin/.idx files{hint}")
    missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
    if missing:
        if path.is_file():
            raise SpecError(f"--data-path {prefix} is a plain file; convert it first: "
                            f"tools/preprocess_data.py --input {prefix} --output-prefix PREFIX")
        raise SpecError(f"--data-path {prefix}: {' and '.join(prefix + s for s in missing)} "
                        f"{'does' if len(missing) == 1 else 'do'} not exist")
    return IndexInfo.read(prefix)


def default_cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hpp-eth", "datasets")


def shipped_corpus() -> str:
    """Prefix of the English corpus shipped with the package (megatron/hpp/corpus/README.md)."""
    return str(Path(__file__).resolve().parents[1] / "corpus" / "english")


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from and how it is cut (all checked here)."""

    data_path: tuple
    """Megatron's ``--data-path`` tokens: PREFIX..., or W PREFIX W PREFIX ..."""
    seq_len: int
    """Tokens per sample input (a sample holds seq_len + 1 tokens)."""
    vocab: int
    """Model vocabulary: every token id must be below it."""
    seed: int = 1234
    """Seed of megatron-core's document and sample shuffles."""
    split: str = DEFAULT_SPLIT
    """Train/valid/test shares of every prefix's documents (``--split``)."""
    cache_path: str | None = None
    """Index cache directory (``--data-cache-path``); None: :func:`default_cache_path`."""
    prefixes: tuple = field(init=False)
    """Derived: dataset prefixes."""
    weights: tuple | None = field(init=False)
    """Derived: blend weights, None = in proportion to the prefixes' sizes."""
    fractions: tuple = field(init=False)
    """Derived: normalised (train, valid, test) shares."""

    def __post_init__(self):
        prefixes, weights = parse_data_path(self.data_path)
        object.__setattr__(self, "prefixes", prefixes)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "fractions", parse_split(self.split))
        if self.seq_len <= 0 or self.vocab <= 0:
            raise SpecError(f"seq_len {self.seq_len} and vocab {self.vocab} must be positive")

    @property
    def cache_root(self) -> str:
        return self.cache_path or default_cache_path()


def check_data(cfg: DataConfig) -> list[IndexInfo]:
    """Every prefix readable, its token type within the model's vocab, and every split with
    a share holding at least one sample (pure Python; raises SpecError)."""
    infos = []
    need = cfg.seq_len + 1
    for prefix in cfg.prefixes:
        info = check_prefix(prefix)
        if info.dtype == "uint8" and cfg.vocab < 256:
            raise SpecError(f"--data-path {prefix} holds byte tokens (0..255), the model's vocab is "
                            f"{cfg.vocab}")
        for name, rng in zip(SPLITS, split_ranges(info.num_docs, cfg.fractions)):
            if rng is None:
                continue
            tokens = info.split_tokens(*rng)
            if tokens < need:
                raise SpecError(f"--split {cfg.split}: the {name} part of {prefix} is documents "
                                f"[{rng[0]}, {rng[1]}) of {info.num_docs}, {tokens} tokens; a sample "
                                f"needs {need} (use more documents or another --split)")
        infos.append(info)
    return infos


class _TokenIds:
    """What megatron-core's GPTDatasetConfig reads of a tokenizer: the vocab size (token
    width), eod (only for loss/attention masks, which the trainer does not take from the
    dataset) and an identity for the cache key.  The data files are already tokenized."""

    def __init__(self, vocab: int):
        self.vocab_size, self.eod = vocab, 0
        self.unique_identifiers = {"class": "hpp.TokenIds", "vocab_size": vocab}


class GPTSource:
    """``sample(iteration, index)``: int64 [seq_len + 1] tokens of sample ``index`` of
    global batch ``iteration`` (see the module docstring)."""

    def __init__(self, dataset, gbs: int, seq_len: int, vocab: int, name: str, offset: int = 0):
        self.dataset, self.gbs, self.seq_len, self.vocab, self.name = dataset, gbs, seq_len, vocab, name
        self.offset = offset
        """Samples before global batch 0 (a run resumed under another global batch:
        the checkpoint's consumed samples - its iteration x this gbs)."""

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, iteration: int, index: int):
        import torch

        if not 0 <= index < self.gbs or iteration < 0:
            raise IndexError(f"sample {index} of global batch {iteration}: need 0 <= index < gbs "
                             f"{self.gbs} and iteration >= 0")
        pos = self.offset + iteration * self.gbs + index
        if pos < 0:
            raise IndexError(f"{self.name} data: global batch {iteration} starts before sample 0 (offset "
                             f"{self.offset}): it was trained before the resume")
        if pos >= len(self.dataset):
            raise SpecError(f"{self.name} data: global batch {iteration} needs sample {pos}, the "
                            f"dataset was built for {len(self.dataset)} samples")
        item = self.dataset[pos]
        tokens = torch.cat([item["tokens"], item["labels"][-1:]])
        top = int(tokens.max())
        if top >= self.vocab:
            raise SpecError(f"{self.name} data: token id {top} in sample {pos} is >= the model's "
                            f"vocab {self.vocab} (tokenized with a larger vocabulary?)")
        return tokens


@dataclass
class DataSources:
    train: GPTSource
    valid: GPTSource | None


def cache_key(cfg: DataConfig, sizes) -> str:
    """Changes whenever the indices would: files (size, mtime), blend, split, seq_len,
    seed, sample counts, megatron-core version."""
    from megatron.core.package_info import __version__ as mcore

    files = []
    for p in cfg.prefixes:
        for s in (".bin", ".idx"):
            st = os.stat(p + s)
            files.append([os.path.abspath(p + s), st.st_size, st.st_mtime_ns])
    text = json.dumps([files, cfg.weights, cfg.fractions, cfg.seq_len, cfg.seed, list(sizes), mcore])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _megatron_config(cfg: DataConfig, cache_dir: str):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=cfg.seed, sequence_length=cfg.seq_len,
        blend=(list(cfg.prefixes), list(cfg.weights) if cfg.weights else None), split=cfg.split,
        path_to_cache=cache_dir, tokenizer=_TokenIds(cfg.vocab), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)


def _build(cfg: DataConfig, cache_dir: str, sizes) -> list:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True,
                                         _megatron_config(cfg, cache_dir)).build()


def _num_indices(cfg: DataConfig) -> int:
    active = sum(f > 0 for f in cfg.fractions)
    blended = len(cfg.prefixes) > 1 or cfg.weights is not None
    return active * (len(cfg.prefixes) + (1 if blended else 0))


@contextlib.contextmanager
def _progress(total: int, enabled: bool, delay: float = 1.0, file=None):
    """A tqdm bar advanced by megatron-core's "Build and save the ..." log records (rank 0);
    shown only when the build takes longer than ``delay`` seconds."""
    import logging
    import sys

    from tqdm import tqdm

    bar = tqdm(total=total, desc="dataset index", unit="index", delay=delay, disable=not enabled,
               leave=False, file=file or sys.stderr)

    class Advance(logging.Handler):
        builds = 0  # index builds started (the bar's count)

        def emit(self, record):
            if record.getMessage().startswith("Build and save the") and "indexes" not in record.getMessage():
                self.builds += 1
                bar.update()

    log = logging.getLogger("megatron.core.datasets")
    handler, level = Advance(logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler
        bar.update(bar.total - bar.n)  # the bar counts builds as they start: the last one ended
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        bar.close()


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _solo_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _publish(staging: Path, final: Path) -> None:
    import shutil

    try:
        os.replace(staging, final)
    except OSError:  # another job finished the same build first: keep its copy
        if not final.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)


def _shared_cache_plan(root: Path, key: str, rank: int) -> tuple[str, bool]:
    """Collective: rank 0's cache key (so that copies of the data with other modification
    times on other nodes still share one index), whether every rank sees rank 0's cache
    folder (else the same SpecError on every rank), and whether the index still has to
    be built (the same answer everywhere)."""
    import time

    import torch
    import torch.distributed as dist

    token = [f"{os.getpid()}-{time.time_ns()}", key] if rank == 0 else [None, None]
    dist.broadcast_object_list(token, src=0)
    key, final, probe = token[1], root / token[1], root / f".probe-{token[0]}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        probe.touch()
    dist.barrier()
    flags = torch.tensor([0 if probe.is_file() else 1, 0 if final.is_dir() else 1])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    dist.barrier()
    if rank == 0:
        probe.unlink()
    if int(flags[0]):
        raise SpecError(f"data index cache {root} is not one folder that every rank sees: "
                        f"--data-cache-path must be on a file system all nodes share")
    return key, bool(flags[1])


def build_sources(cfg: DataConfig, gbs: int, train_iters: int, valid_iters: int = 0,
                  progress: bool = True, train_samples: int | None = None, offset: int = 0) -> DataSources:
    """The train (and valid) :class:`GPTSource` for ``train_iters`` global batches of
    ``gbs`` samples (an index of ``train_samples`` samples when given, e.g. to keep the
    order a checkpoint's run had; global batch t starting at sample ``offset + t * gbs``:
    a run resumed under another global batch).  Collective when a process group exists
    (every rank calls it)."""
    import shutil

    import torch.distributed as dist

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401  (slow: before any bar)

    if gbs <= 0 or train_iters <= 0 or valid_iters < 0:
        raise SpecError(f"gbs {gbs}, train iterations {train_iters} and valid iterations {valid_iters}: "
                        f"need gbs > 0, train > 0, valid >= 0")
    check_data(cfg)
    # offset < 0: a resume under a larger global batch (its first global batches are never read)
    if offset + train_iters * gbs <= 0 or (train_samples is not None and train_samples < offset + train_iters * gbs):
        raise SpecError(f"{train_samples} training samples from offset {offset}: {train_iters} iterations x "
                        f"gbs {gbs} do not fit")
    sizes = [offset + train_iters * gbs if train_samples is None else train_samples, valid_iters * gbs, 0]
    root = Path(cfg.cache_root)
    key, total = cache_key(cfg, sizes), _num_indices(cfg)
    if dist.is_initialized():
        rank = dist.get_rank()
        key, needed = _shared_cache_plan(root, key, rank)
        final = root / key
        if needed:
            staging = root / f"{key}.partial"
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            dist.barrier()
            with _progress(total, progress and rank == 0):
                _build(cfg, str(staging), sizes)  # rank 0 builds, then the others load
            dist.barrier()
            if rank == 0:
                _publish(staging, final)
            dist.barrier()
    else:
        final = root / key
        with _file_lock(root / f"{key}.lock"):
            if not final.is_dir():
                staging = root / f"{key}.partial{os.getpid()}"
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                try:
                    with _solo_group(), _progress(total, progress):
                        _build(cfg, str(staging), sizes)
                    _publish(staging, final)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
    train, valid, _ = _build(cfg, str(final), sizes)  # every index a cache hit: memory-mapped
    if len(train) < sizes[0]:  # a blend by size is capped at one epoch of its prefixes
        raise SpecError(f"--data-path {' '.join(map(str, cfg.data_path))} yields {len(train)} training "
                        f"samples of {cfg.seq_len + 1} tokens, {train_iters} iterations x gbs {gbs} need "
                        f"{sizes[0]}; give weights (W PREFIX ...) to repeat the data, or more data")
    return DataSources(GPTSource(train, gbs, cfg.seq_len, cfg.vocab, "train", offset),
                       GPTSource(valid, gbs, cfg.seq_len, cfg.vocab, "valid")
                       if valid_iters and valid is not None else None)
