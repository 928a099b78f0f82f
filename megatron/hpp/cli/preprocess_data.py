"""Text -> megatron-core indexed dataset (``<prefix>.bin`` + ``<prefix>.idx``); installed as
``hpp-preprocess``.

    python tools/preprocess_data.py --input books/*.txt --output-prefix data/books
    python tools/preprocess_data.py --input corpus.jsonl --json-key text \
        --tokenizer-json gpt2/tokenizer.json --output-prefix data/corpus
    torchrun ... pretrain_gpt.py --data-path 0.7 data/books 0.3 data/corpus ...

Inputs: ``.jsonl`` / ``.json`` files hold one JSON object per line, the document under
``--json-key`` (Megatron's format); any other file is UTF-8 text, one document per file
or, with ``--text-docs paragraph``, one per paragraph (lines up to a blank line).  Every
document is tokenized (byte-level by default, or a local HuggingFace ``tokenizer.json``;
megatron/hpp/data/tokenizer.py) and followed by the end-of-document token.  The files
are written by megatron-core's ``IndexedDatasetBuilder`` under temporary names and
renamed into place at the end, so an interrupted run leaves no half-written dataset.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from eth.cli.common import check_output_file, run_main
from eth.errors import SpecError

JSON_SUFFIXES = (".jsonl", ".json")


def _lines(path: Path, progress: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    try:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                progress(len(raw))
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise SpecError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except IsADirectoryError:
        raise SpecError(f"--input {path} is a directory; give its files (e.g. {path}/*.txt)") from None
    except FileNotFoundError:
        raise SpecError(f"--input {path} does not exist") from None


def documents(path, text_docs: str = "file", json_key: str = "text",
              progress: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The documents of one input file (see the module docstring); blank ones are skipped."""
    path = Path(path)
    if path.suffix in JSON_SUFFIXES:
        for lineno, line in _lines(path, progress):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(json_key), str):
                raise SpecError(f"{path}:{lineno}: no string field {json_key!r} (--json-key)")
            if obj[json_key].strip():
                yield obj[json_key]
        return
    para: list[str] = []
    for _, line in _lines(path, progress):
        if text_docs == "paragraph" and not line.strip():
            if para:
                yield "".join(para).rstrip("\n")
            para = []
        elif line.strip() or para:
            para.append(line)
    text = "".join(para).rstrip("\n")
    if text.strip():
        yield text


@dataclass
class Written:
    documents: int = 0
    tokens: int = 0


def write_indexed(docs, tokenizer, prefix, append_eod: bool = True) -> Written:
    """Tokenize ``docs`` into ``prefix``.bin/.idx (megatron-core format), atomically."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = f"{prefix}.bin.tmp{os.getpid()}", f"{prefix}.idx.tmp{os.getpid()}"
    stats = Written()
    try:
        builder = IndexedDatasetBuilder(tmp_bin, dtype=tokenizer.token_dtype)
        for doc in docs:
            ids = tokenizer.encode(doc) + ([tokenizer.eod] if append_eod else [])
            if not ids:
                continue
            builder.add_document(numpy.asarray(ids, dtype=tokenizer.token_dtype), [len(ids)])
            stats.documents += 1
            stats.tokens += len(ids)
        builder.finalize(tmp_idx)
        if stats.documents == 0:
            raise SpecError("the inputs hold no document (all empty); nothing written")
        os.replace(tmp_bin, get_bin_path(prefix))
        os.replace(tmp_idx, get_idx_path(prefix))
    finally:
        for tmp in (tmp_bin, tmp_idx):
            if os.path.exists(tmp):
                os.unlink(tmp)
    return stats


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--input", nargs="+", required=True, help="text or JSON-lines files")
    ap.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    ap.add_argument("--tokenizer-json", default=None,
                    help="local HuggingFace tokenizer.json (default: byte-level, vocab 256)")
    ap.add_argument("--eod-token", default=None, help="end-of-document token of --tokenizer-json "
                                                      "(default: the first of <|endoftext|>, </s>, ...)")
    ap.add_argument("--json-key", default="text", help="document field of .jsonl/.json inputs")
    ap.add_argument("--text-docs", choices=("file", "paragraph"), default="file",
                    help="documents of a text input: the whole file, or each blank-line separated paragraph")
    ap.add_argument("--no-eod", action="store_true", help="do not append the end-of-document token")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    from megatron.hpp.data.tokenizer import load_tokenizer

    prefix = Path(args.output_prefix)
    if prefix.is_dir():
        raise SpecError(f"--output-prefix {prefix} is a directory; give a prefix such as {prefix / 'corpus'}")
    check_output_file(prefix.with_name(prefix.name + ".bin"), "--output-prefix")
    inputs = [Path(p) for p in args.input]
    for path in inputs:
        if path.is_dir():
            raise SpecError(f"--input {path} is a directory; give its files (e.g. {path}/*.txt)")
        if not path.is_file():
            raise SpecError(f"--input {path} does not exist")
    tokenizer = load_tokenizer(args.tokenizer_json, args.eod_token)

    from tqdm import tqdm

    from megatron.hpp.compat import quiet_megatron_warnings

    quiet_megatron_warnings()
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (slow import, before the bar starts)

    bar = tqdm(total=sum(p.stat().st_size for p in inputs), unit="B", unit_scale=True, file=sys.stderr,
               desc="tokenizing", disable=args.no_progress, delay=1.0, leave=False)
    try:
        docs = (d for p in inputs for d in documents(p, args.text_docs, args.json_key, bar.update))
        stats = write_indexed(docs, tokenizer, prefix, append_eod=not args.no_eod)
    finally:
        bar.close()
    print(f"wrote {prefix}.bin and {prefix}.idx: {stats.documents} documents, {stats.tokens} tokens "
          f"({tokenizer.token_dtype.__name__}), tokenizer {tokenizer.describe()}")
    return 0


def main(argv=None) -> int:
    """The CLI (``hpp-preprocess``); bad input: ``error: ...`` on stderr, exit 2."""
    return run_main(_main, argv)
