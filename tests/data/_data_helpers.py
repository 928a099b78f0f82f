"""Small indexed datasets written straight with megatron-core's builder, for the data tests."""
from __future__ import annotations

from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[2]


def write_docs(prefix, docs, dtype=numpy.uint8) -> str:
    """``docs``: iterable of int arrays -> ``prefix``.bin/.idx; returns the prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        doc = numpy.asarray(doc, dtype=dtype)
        builder.add_document(doc, [doc.size])
    builder.finalize(prefix + ".idx")
    return prefix


def labelled_docs(num_docs: int, length: int, first_label: int = 1):
    """Document d is ``length`` copies of byte (first_label + d) % 255 + 1 (never 0): a
    sample's bytes tell which documents it came from."""
    return [numpy.full(length, (first_label + d) % 255 + 1, dtype=numpy.uint8) for d in range(num_docs)]
