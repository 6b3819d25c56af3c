"""Tests of the bundled text, tokenisers and batching in `fusedpc.training.data`."""

import json

import numpy as np
import pytest

from fusedpc.training.data import (
    DEFAULT_TEXT,
    BatchIterator,
    ByteTokenizer,
    CharTokenizer,
    bundled_texts,
    load_text,
    split,
    tokenizer_from_dict,
)


def test_bundled_text_loads():
    text = load_text()
    assert DEFAULT_TEXT in bundled_texts()
    assert text == load_text(DEFAULT_TEXT)
    assert len(text.encode("utf-8")) > 50_000
    assert "Hamlet" in text


def test_load_text_from_path(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("to be, or not to be\n", encoding="utf-8")
    assert load_text(path) == "to be, or not to be\n"
    assert load_text(str(path)) == "to be, or not to be\n"


def test_load_text_names_a_file_that_is_not_utf8(tmp_path):
    # Reliability III: "'utf-8' codec can't decode byte 0xe9 ..." named no file.
    path = tmp_path / "latin.txt"
    path.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"text file '.*latin\.txt' is not UTF-8 .*0xe9"):
        load_text(path)


def test_load_text_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text(missing)


def test_char_tokenizer_round_trip():
    text = load_text()
    tok = CharTokenizer.from_text(text)
    assert list(tok.chars) == sorted(set(text))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert ids.min() >= 0 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()[:10]) == text[:10]


def test_char_tokenizer_non_ascii_and_order():
    tok = CharTokenizer.from_text("héllo wörld ✓")
    assert tok.chars == "".join(sorted(set("héllo wörld ✓")))
    assert tok.decode(tok.encode("wörld ✓")) == "wörld ✓"
    assert tok.encode(" ")[0] == 0  # the space sorts first


def test_char_tokenizer_errors():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="token ids"):
        tok.decode([0, 3])
    with pytest.raises(ValueError):
        CharTokenizer("ba")


def test_tokenizer_serialisation():
    char = CharTokenizer.from_text("some text!")
    byte = ByteTokenizer()
    for tok in (char, byte):
        d = json.loads(json.dumps(tok.to_dict()))
        assert type(tok).from_dict(d) == tok
        assert tokenizer_from_dict(d) == tok
    with pytest.raises(ValueError, match="kind"):
        tokenizer_from_dict({"kind": "word"})


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    text = "naïve café ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised
    with pytest.raises(ValueError):
        tok.decode([256])


def test_split():
    ids = np.arange(100, dtype=np.int32)
    train, val = split(ids, validation_fraction=0.1)
    assert len(train) == 90 and len(val) == 10
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)
    train, val = split(ids, validation_fraction=0.0)
    assert len(train) == 100 and len(val) == 0
    with pytest.raises(ValueError, match="validation_fraction"):
        split(ids, validation_fraction=1.0)


def _data(n=500):
    return np.random.default_rng(0).integers(0, 50, n).astype(np.int32)


def test_batches_shapes_and_shift():
    data = _data()
    it = BatchIterator(data, batch_size=4, seq_len=16, seed=3)
    inputs, targets = it.next_batch()
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    # Every row is a contiguous window of the data.
    for row_in, row_tg in zip(inputs, targets, strict=True):
        window = np.concatenate([row_in, row_tg[-1:]])
        starts = [s for s in range(len(data) - 16) if np.array_equal(data[s : s + 17], window)]
        assert starts


def test_batches_reproducible_from_seed():
    a = BatchIterator(_data(), 4, 16, seed=11)
    b = BatchIterator(_data(), 4, 16, seed=11)
    c = BatchIterator(_data(), 4, 16, seed=12)
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = a.next_batch(), b.next_batch(), c.next_batch()
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
        assert not np.array_equal(xa, xc)


def test_resumed_iterator_matches_uninterrupted():
    straight = BatchIterator(_data(), 4, 16, seed=5)
    expected = [straight.next_batch() for _ in range(6)]

    first = BatchIterator(_data(), 4, 16, seed=5)
    got = [first.next_batch() for _ in range(2)]
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = BatchIterator(_data(), 4, 16, seed=0)
    resumed.load_state_dict(saved)
    got += [resumed.next_batch() for _ in range(4)]
    for (xe, ye), (xg, yg) in zip(expected, got, strict=True):
        np.testing.assert_array_equal(xe, xg)
        np.testing.assert_array_equal(ye, yg)


def test_next_batches_equals_repeated_next_batch():
    one = BatchIterator(_data(), 3, 8, seed=9)
    many = BatchIterator(_data(), 3, 8, seed=9)
    singles = [one.next_batch() for _ in range(5)]
    x, y = many.next_batches(2)
    assert x.shape == y.shape == (2, 3, 8)
    x2, y2 = many.next_batches(3)
    xs = np.concatenate([x, x2])
    ys = np.concatenate([y, y2])
    np.testing.assert_array_equal(xs, np.stack([s[0] for s in singles]))
    np.testing.assert_array_equal(ys, np.stack([s[1] for s in singles]))
    assert many.state_dict() == one.state_dict()


def test_window_covering_all_data():
    data = np.arange(9, dtype=np.int32)
    x, y = BatchIterator(data, 2, 8).next_batch()
    np.testing.assert_array_equal(x, np.tile(np.arange(8), (2, 1)))
    np.testing.assert_array_equal(y, np.tile(np.arange(1, 9), (2, 1)))


def test_batch_iterator_errors():
    with pytest.raises(ValueError, match="seq_len"):
        BatchIterator(np.arange(8), 2, 8)
    with pytest.raises(ValueError, match="batch_size"):
        BatchIterator(np.arange(100), 0, 8)
    it = BatchIterator(np.arange(100), 2, 8)
    with pytest.raises(ValueError, match="batch_size"):
        it.load_state_dict({"seed": 0, "step": 1, "batch_size": 3, "seq_len": 8})
