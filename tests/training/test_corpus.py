"""Corpora on disk (`fusedpc.training.corpus`, `fusedpc prepare`, `fusedpc train --data`):
the files, their dtype and metadata, tokenisers that round-trip, windows drawn from the maps
without loading them, refusals that name the argument, and a run that trains on a corpus."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fusedpc.training import corpus, data

TEXTS = ["To be, or not to be, that is the question:\n",
         "Whether 'tis nobler in the mind to suffer\nThe slings and arrows — ünïcödé ✓ 🎭\n",
         ""]


@pytest.fixture
def source(tmp_path):
    folder = tmp_path / "texts"
    (folder / "more").mkdir(parents=True)
    (folder / "a.txt").write_text(data.load_text()[:20000], encoding="utf-8")
    (folder / "more" / "b.txt").write_text(TEXTS[1] * 50, encoding="utf-8")
    (folder / "ignored.md").write_text("not a .txt file", encoding="utf-8")
    return folder


@pytest.mark.parametrize("kind, vocab", [("char", None), ("byte", None), ("bpe", 400)])
def test_prepare_writes_flat_ids_and_metadata_that_open_and_round_trip(source, tmp_path, kind,
                                                                         vocab):
    if kind == "bpe":
        pytest.importorskip("tokenizers")
    out = tmp_path / "corpus"
    meta = corpus.prepare_corpus(source, out, tokenizer=kind, vocab_size=vocab,
                                 validation_fraction=0.2)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["dtype"] == "uint16" and meta["format"] == corpus.FORMAT
    opened = corpus.open_corpus(out)
    assert isinstance(opened.train, np.memmap) and opened.train.dtype == np.uint16
    assert len(opened.train) == meta["train_tokens"] and len(opened.val) == meta["val_tokens"]
    assert meta["val_tokens"] == int(0.2 * (meta["train_tokens"] + meta["val_tokens"]))
    everything = np.concatenate([opened.train, opened.val])
    text = "".join(p.read_text(encoding="utf-8") for p in corpus.source_files(source))
    assert opened.tokenizer.decode(everything) == text  # the files, in order, exactly
    assert int(everything.max()) < opened.vocab_size
    if kind == "bpe":
        assert opened.vocab_size <= 400 and len(everything) < len(text.encode())  # merges
    for sample in TEXTS + [text[:3000]]:
        if kind == "char" and not set(sample) <= set(opened.tokenizer.chars):
            continue
        ids = opened.tokenizer.encode(sample)
        assert opened.tokenizer.decode(ids) == sample
    with pytest.raises(ValueError, match="token ids must lie in"):
        opened.tokenizer.decode([opened.vocab_size])
    rebuilt = data.tokenizer_from_dict(json.loads(json.dumps(opened.tokenizer.to_dict())))
    assert rebuilt.to_dict() == opened.tokenizer.to_dict()


def test_a_corpus_is_never_overwritten_and_bad_settings_name_the_argument(source, tmp_path):
    out = tmp_path / "corpus"
    corpus.prepare_corpus(source, out)
    before = (out / "train.bin").read_bytes()
    with pytest.raises(FileExistsError, match="already holds train.bin, val.bin, meta.json"):
        corpus.prepare_corpus(source, out, tokenizer="byte")
    assert (out / "train.bin").read_bytes() == before
    with pytest.raises(ValueError, match="tokenizer: expected one of .* got 'words'"):
        corpus.prepare_corpus(source, tmp_path / "x", tokenizer="words")
    with pytest.raises(ValueError, match="vocab: a BPE vocabulary needs more than the 256"):
        corpus.prepare_corpus(source, tmp_path / "y", tokenizer="bpe", vocab_size=100)
    with pytest.raises(ValueError, match=r"validation_fraction: expected a number in \[0, 1\)"):
        corpus.prepare_corpus(source, tmp_path / "z", validation_fraction=1.0)
    with pytest.raises(FileNotFoundError, match="source: no file or folder"):
        corpus.prepare_corpus(tmp_path / "nothing", tmp_path / "w")
    with pytest.raises(FileNotFoundError, match="has no train.bin or val.bin"):
        corpus.open_corpus(tmp_path / "nothing")


def test_a_failed_preparation_leaves_no_partial_file_and_can_be_retried(source, tmp_path):
    (source / "z.txt").write_bytes(b"caf\xe9 latin-1")
    out = tmp_path / "corpus"
    with pytest.raises(ValueError, match=r"z.txt' is not UTF-8 \(byte 0xe9\)"):
        corpus.prepare_corpus(source, out)
    assert list(out.iterdir()) == []
    (source / "z.txt").write_text("café", encoding="utf-8")
    assert corpus.prepare_corpus(source, out)["train_tokens"] > 0
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty; a corpus needs text"):
        corpus.prepare_corpus(empty, tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_nanogpt_files_without_metadata_open_with_their_vocabulary(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 50257
    ids.tofile(tmp_path / "train.bin")
    ids[:100].tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match="vocab_size: .* has no meta.json"):
        corpus.open_corpus(tmp_path)
    opened = corpus.open_corpus(tmp_path, vocab_size=50257)
    assert opened.tokenizer is None and opened.vocab_size == 50257
    assert np.array_equal(opened.train, ids)
    (tmp_path / "val.bin").write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match="3 bytes, not a whole number of uint16 ids"):
        corpus.open_corpus(tmp_path, vocab_size=50257)


def test_windows_come_from_the_map_as_from_the_array_and_resume_exactly(source, tmp_path):
    out = tmp_path / "corpus"
    corpus.prepare_corpus(source, out)
    opened = corpus.open_corpus(out)
    mapped = data.BatchIterator(opened.train, 4, 16, seed=3)
    assert np.shares_memory(mapped.data, opened.train)  # the map itself, not a copy
    loaded = data.BatchIterator(np.asarray(opened.train, np.int32), 4, 16, seed=3)
    first = mapped.next_batches(3)
    assert first[0].dtype == np.int32
    for a, b in zip(first, loaded.next_batches(3), strict=True):
        assert np.array_equal(a, b)
    part = opened.train[1000:5000]  # a slice of a map is read as the array it is
    for a, b in zip(data.BatchIterator(part, 4, 16, seed=1).next_batch(),
                    data.BatchIterator(np.asarray(part), 4, 16, seed=1).next_batch(), strict=True):
        assert np.array_equal(a, b)
    resumed = data.BatchIterator(opened.train, 4, 16, seed=3)
    resumed.load_state_dict(mapped.state_dict())
    for a, b in zip(mapped.next_batch(), resumed.next_batch(), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_train_on_a_bpe_corpus_then_sample_and_evaluate_with_its_tokenizer(source, tmp_path,
                                                                           capsys):
    pytest.importorskip("tokenizers")
    from fusedpc.cli import main

    out = tmp_path / "corpus"
    assert main(["prepare", str(source), "--out", str(out), "--tokenizer", "bpe", "--vocab",
                 "300"]) == 0
    assert "train on it with fusedpc train --data" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", "--data", str(out), "--steps", "4", "--out", str(run), "--width",
                 "16", "--n-heads", "2", "--n-blocks", "1", "--max-len", "16", "--batch", "4",
                 "--eval-every", "4", "--eval-batches", "1", "--sample-tokens", "0"]) == 0
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "5", "--prompt", "To be"]) == 0
    assert capsys.readouterr().out.startswith("[To be]")
    assert main(["eval", str(run), "--batches", "1"]) == 0
    assert f"the validation split of '{out}'" in capsys.readouterr().out
    other = tmp_path / "other"
    corpus.prepare_corpus(source, other, tokenizer="byte")
    assert main(["train", "--resume", str(run), "--data", str(other), "--steps", "6"]) == 1
    assert "cannot change data of a run being resumed" in capsys.readouterr().err
