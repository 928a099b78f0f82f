"""Tokenizers of tools/preprocess_data.py: byte-level by default, or a local HuggingFace
``tokenizer.json`` read by the ``tokenizers`` package (``pip install hpp-eth[data]``).

Nothing is downloaded: a HuggingFace tokenizer is a file on disk.  Both give

    encode(text) -> list[int]   token ids, without special tokens
    vocab_size                   ids are < vocab_size (the model's vocab must be >= it)
    eod                          end-of-document id appended after every document
    token_dtype                  numpy dtype of the .bin file (megatron-core's choice)
    describe()                   one line for logs

Byte-level: ids are the UTF-8 bytes of the text, vocab 256, and the end-of-document id
is 0 (the NUL byte, which text does not contain), as in megatron-core's own
``ByteLevelTokenizer`` (eos id 0).  So a byte corpus trains the ``tiny`` preset
(vocab 256) and any larger vocabulary.
"""
from __future__ import annotations

from pathlib import Path

import numpy

from eth.errors import SpecError

# end-of-document tokens looked for in a tokenizer.json, in this order, without --eod-token
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|eot_id|>")


class ByteTokenizer:
    """UTF-8 bytes; end of document = 0."""

    vocab_size = 256
    eod = 0
    token_dtype = numpy.uint8

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        if b"\x00" in data:
            raise SpecError("text holds a NUL character, which the byte tokenizer reserves as the "
                            "end-of-document token")
        return list(data)

    def describe(self) -> str:
        return "byte-level (UTF-8 bytes, vocab 256, end of document 0)"


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path, eod_token: str | None = None):
        path = Path(path)
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise SpecError(f"--tokenizer-json {path} is a directory without a tokenizer.json")
            path = path / "tokenizer.json"
        if not path.is_file():
            raise SpecError(f"--tokenizer-json {path} does not exist")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise SpecError("--tokenizer-json needs the tokenizers package: "
                            "pip install 'hpp-eth[data]' (or pip install tokenizers)") from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception types
            raise SpecError(f"--tokenizer-json {path} is not a tokenizer.json: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = (eod_token,) if eod_token else EOD_CANDIDATES
        found = [(n, self._tok.token_to_id(n)) for n in names if self._tok.token_to_id(n) is not None]
        if not found:
            if eod_token:
                raise SpecError(f"--eod-token {eod_token!r} is not in {path}")
            raise SpecError(f"{path} has none of the end-of-document tokens {list(EOD_CANDIDATES)}; "
                            f"name one with --eod-token")
        self.eod_token, self.eod = found[0]
        # megatron-core's DType.optimal_dtype(vocab): uint16 below 65500 ids, else int32
        self.token_dtype = numpy.uint16 if self.vocab_size < 65500 else numpy.int32

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def describe(self) -> str:
        return f"{self.path} (vocab {self.vocab_size}, end of document {self.eod_token!r} = {self.eod})"


def load_tokenizer(tokenizer_json=None, eod_token: str | None = None):
    """The byte tokenizer, or the HuggingFace one in ``tokenizer_json``."""
    if tokenizer_json is None:
        if eod_token is not None:
            raise SpecError("--eod-token needs --tokenizer-json (the byte tokenizer's end of document is 0)")
        return ByteTokenizer()
    return HFTokenizer(tokenizer_json, eod_token)
