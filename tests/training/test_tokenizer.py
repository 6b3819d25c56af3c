"""A tokeniser of the user's own: any object with `encode`, `decode`, `vocab_size` and
`to_dict` (`fusedpc.training.Tokenizer`) trains, resumes and loads like the built-in ones."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fusedpc.training import Tokenizer, load_run, resolve_config, train
from fusedpc.training import data as data_module
from fusedpc.training._setup import encode_text, resolve_tokenizer

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


class LowerCaseTokenizer:
    """Characters folded to lower case: a smaller vocabulary than `CharTokenizer`'s. No base
    class; it only has the four members a run uses."""

    def __init__(self, chars: str):
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> LowerCaseTokenizer:
        return cls("".join(sorted(set(text.lower()))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._index[c] for c in text.lower()], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": "lower", "chars": self.chars}


def test_a_user_tokeniser_satisfies_the_protocol():
    tok = LowerCaseTokenizer.from_text(data_module.load_text())
    assert isinstance(tok, Tokenizer)
    assert data_module.check_tokenizer(tok) is tok
    for builtin in (data_module.CharTokenizer("ab"), data_module.ByteTokenizer()):
        assert isinstance(builtin, Tokenizer)


def test_bad_tokenisers_are_named():
    with pytest.raises(TypeError, match="got object without encode, decode, vocab_size, to_dict"):
        data_module.check_tokenizer(object())

    class NoVocabulary(LowerCaseTokenizer):
        vocab_size = 0

    with pytest.raises(TypeError, match="vocab_size must be a positive integer, got 0"):
        data_module.check_tokenizer(NoVocabulary("a"))

    class OutOfRange(LowerCaseTokenizer):
        def encode(self, text):
            return np.array([0, 5], np.int32)

    with pytest.raises(ValueError, match=r"lie in \[0, vocab_size=2\), got values from 0 to 5"):
        encode_text(OutOfRange("ab"), "ab")
    with pytest.raises(ValueError, match="1-D array of integer token ids"):
        encode_text(type("Floats", (OutOfRange,), {"encode": lambda s, t: np.ones(2)})("ab"), "")


def test_resuming_refuses_another_or_a_missing_user_tokeniser():
    config = resolve_config(TINY)
    saved = {"kind": "lower", "chars": "ab"}
    with pytest.raises(ValueError, match="the run was trained with the tokeniser"):
        resolve_tokenizer(config, "", saved, LowerCaseTokenizer("abc"))
    with pytest.raises(ValueError, match="pass it again"):
        resolve_tokenizer(config, "", saved)
    same = LowerCaseTokenizer("ab")
    assert resolve_tokenizer(config, "", saved, same) is same


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_train_resume_and_load_with_a_user_tokeniser(tmp_path):
    text = data_module.load_text()
    tok = LowerCaseTokenizer.from_text(text)
    assert tok.vocab_size < data_module.CharTokenizer.from_text(text).vocab_size
    devnull = open(os.devnull, "w")
    config = resolve_config(TINY, {"steps": 10, "sample_tokens": 0})
    out = tmp_path / "lower"
    result = train(config, out, tokenizer=tok, stream=devnull)
    assert result.step == 10 and result.tokenizer is tok and np.isfinite(result.val_loss)
    assert result.pipeline.predict(np.zeros((1, config.model.max_len), np.int32)).shape[-1] == (
        tok.vocab_size
    )
    with pytest.raises(ValueError, match="pass it again"):
        load_run(out)
    pipeline, loaded, _, metadata = load_run(out, tokenizer=LowerCaseTokenizer(tok.chars))
    assert metadata["tokenizer"] == tok.to_dict() and loaded.chars == tok.chars
    resumed = train(
        resolve_config(TINY, {"steps": 15, "sample_tokens": 0}), out, resume_from=out,
        tokenizer=LowerCaseTokenizer(tok.chars), stream=devnull,
    )
    assert resumed.step == 15
    devnull.close()
