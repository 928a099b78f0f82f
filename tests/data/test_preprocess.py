"""tools/preprocess_data.py (megatron/hpp/cli/preprocess_data.py): text and JSON lines ->
megatron-core .bin/.idx, byte-level or a local HuggingFace tokenizer.json; read back
with megatron-core's own IndexedDataset."""
import json
import subprocess
import sys

import numpy
import pytest

from _data_helpers import ROOT
from megatron.hpp.cli.preprocess_data import main
from megatron.hpp.data.datasets import shipped_corpus


def _docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(prefix))
    return data.index.dtype, [data[i].tolist() for i in range(len(data))]


def test_text_paragraphs_and_json_lines_byte_level(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("First paragraph,\ntwo lines.\n\n\nSecond é.\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "json doc"}) + "\n\n"
                                      + json.dumps({"text": "  ", "id": 2}) + "\n"
                                      + json.dumps({"body": "x", "text": "last"}) + "\n")
    out = tmp_path / "out" / "c"
    assert main(["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--text-docs", "paragraph",
                 "--output-prefix", str(out), "--no-progress"]) == 0
    dtype, docs = _docs(out)
    assert dtype == numpy.uint8
    assert docs == [list(b"First paragraph,\ntwo lines.") + [0], list("Second é.".encode()) + [0],
                    list(b"json doc") + [0], list(b"last") + [0]]
    assert "4 documents, 53 tokens (uint8)" in capsys.readouterr().out
    assert main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(out), "--no-eod",
                 "--no-progress"]) == 0  # whole file = one document; replaces the old pair
    assert _docs(out)[1] == [list("First paragraph,\ntwo lines.\n\n\nSecond é.".encode())]
    assert sorted(p.name for p in out.parent.iterdir()) == ["c.bin", "c.idx"]


def _tokenizer_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|endoftext|>", "the", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def test_local_huggingface_tokenizer(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    tok = _tokenizer_json(tmp_path / "tokenizer.json")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"content": t}) for t in
                                                ["the cat sat", "on the mat", "the dog"]) + "\n")
    out = tmp_path / "hf"
    assert main(["--input", str(tmp_path / "d.jsonl"), "--json-key", "content", "--tokenizer-json",
                 str(tmp_path), "--output-prefix", str(out), "--no-progress"]) == 0
    dtype, docs = _docs(out)
    assert dtype == numpy.uint16
    assert docs == [[2, 3, 4, 1], [5, 2, 6, 1], [2, 0, 1]]
    assert docs[0][:-1] == tok.encode("the cat sat").ids
    assert "end of document '<|endoftext|>' = 1" in capsys.readouterr().out
    assert main(["--input", str(tmp_path / "d.jsonl"), "--json-key", "content", "--tokenizer-json",
                 str(tmp_path / "tokenizer.json"), "--eod-token", "</s>", "--output-prefix",
                 str(tmp_path / "x"), "--no-progress"]) == 2
    assert "--eod-token '</s>' is not in" in capsys.readouterr().err


@pytest.mark.parametrize("content, extra, message", [
    ("a\x00b", [], "NUL character"),
    ('{"text": 1}\n', ["--json-key", "text"], "d.jsonl:1: no string field 'text' (--json-key)"),
    ("{broken\n", [], "d.jsonl:1: not a JSON object"),
    ("\n\n", [], "the inputs hold no document (all empty); nothing written"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, content, extra, message):
    name = "d.txt" if message in ("NUL character",) or content == "\n\n" else "d.jsonl"
    (tmp_path / name).write_text(content)
    out = tmp_path / "o" / "p"
    assert main(["--input", str(tmp_path / name), "--output-prefix", str(out), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_bad_paths(tmp_path, capsys):
    assert main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "p")]) == 2
    assert f"--input {tmp_path} is a directory" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text("x")
    assert main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path)]) == 2
    assert f"--output-prefix {tmp_path} is a directory" in capsys.readouterr().err
    assert main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "p"),
                 "--tokenizer-json", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_shipped_corpus_is_reproducible(tmp_path):
    corpus = ROOT / "megatron" / "hpp" / "corpus"
    out = tmp_path / "english"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--text-docs", "paragraph",
                           "--output-prefix", str(out), "--no-progress", "--input",
                           *(str(corpus / f) for f in ("paradise-lost.txt", "as-you-like-it.txt",
                                                       "alice-in-wonderland.txt"))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1907 documents, 728361 tokens (uint8)" in proc.stdout
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"english{suffix}").read_bytes() == open(shipped_corpus() + suffix, "rb").read()
    licence = (corpus / "README.md").read_text()
    assert "public domain" in licence and "Canterbury Corpus" in licence
