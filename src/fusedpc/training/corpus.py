"""Corpora on disk: token ids in flat memory-mapped files, read window by window.

`prepare_corpus(source, out)` tokenises a text file or a folder of them and writes

* `train.bin` and `val.bin`: the token ids, one flat little-endian array each (`uint16` when
  the vocabulary has at most 65,536 ids, else `uint32`): the layout of nanoGPT's
  `train.bin` / `val.bin`, so files made by its preparation scripts work as they are;
* `meta.json`: the format, the dtype, the vocabulary size, the token counts and the tokeniser
  (its `to_dict` description: a character table, bytes, or a BPE tokeniser's whole JSON).

`open_corpus(path)` maps the two files (nothing is read until a window is drawn), so the
resident memory of a run does not grow with the corpus, and `BatchIterator` draws its windows
straight from the maps. A folder without `meta.json` (nanoGPT's GPT-2 files) is read as
`uint16` ids with the vocabulary given to `open_corpus` (`vocab_size=`; 50,257 for GPT-2's).

Tokenisers: `"char"` (the sorted characters of the source), `"byte"` (UTF-8 bytes, 256 ids)
or `"bpe"`: a byte-level BPE trained here, offline, on the source with the `tokenizers`
library (`pip install tokenizers`), `BPETokenizer`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fusedpc.training import data

FORMAT = "fusedpc-corpus-1"
TOKENIZERS = ("char", "byte", "bpe")
_CHUNK_CHARS = 1 << 22  # characters tokenised at a time while writing


@dataclasses.dataclass(frozen=True)
class BPETokenizer:
    """A byte-level BPE tokeniser (a `tokenizers.Tokenizer`), described by its JSON.

    Build one with `BPETokenizer.train(texts, vocab_size)`; `to_dict` holds the whole
    tokeniser, so a checkpoint or a corpus's `meta.json` rebuilds it offline.
    """

    json_text: str
    _model: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # parsed once, held with the description
        object.__setattr__(self, "_model", _tokenizers().Tokenizer.from_str(self.json_text))

    @classmethod
    def train(cls, texts: Iterator[str], vocab_size: int) -> BPETokenizer:
        """Train on `texts` to at most `vocab_size` ids (256 bytes and the merges)."""
        tokenizers = _tokenizers()
        model = tokenizers.Tokenizer(tokenizers.models.BPE())
        model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
        model.train_from_iterator(texts, trainer)
        return cls(model.to_str())

    @property
    def vocab_size(self) -> int:
        """$V$: the bytes and the merges."""
        return int(self._model.get_vocab_size())

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text`, int32."""
        return np.asarray(self._model.encode(text).ids, dtype=np.int32)

    def decode(self, ids: Any) -> str:
        """The text of `ids` (bytes that are not UTF-8 become U+FFFD)."""
        arr = data.ids_in_range(ids, self.vocab_size)
        return self._model.decode(arr.astype(np.int64).tolist())

    def to_dict(self) -> dict[str, Any]:
        """`{"kind": "bpe", "json": ...}`, inverted by `from_dict`."""
        return {"kind": "bpe", "json": self.json_text}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BPETokenizer:
        """Rebuild a tokeniser saved with `to_dict`."""
        if d.get("kind") != "bpe":
            raise ValueError(f"not a BPETokenizer description: kind={d.get('kind')!r}")
        return cls(d["json"])


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError("tokenizer 'bpe' needs the tokenizers library: pip install "
                          "tokenizers (or pip install 'fusedpc[data]').") from None
    return tokenizers


def source_files(source: str | os.PathLike[str]) -> list[Path]:
    """The text files of `source`: itself, or a folder's `*.txt` files (recursively, sorted)."""
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if files:
            return files
        raise ValueError(f"source: the folder {str(path)!r} holds no .txt file.")
    raise FileNotFoundError(f"source: no file or folder {str(path)!r}.")


def _chunks(files: list[Path]) -> Iterator[str]:
    """The files' text, `_CHUNK_CHARS` characters at a time (files joined as they are)."""
    for path in files:
        with open(path, encoding="utf-8", newline="") as handle:
            try:
                while chunk := handle.read(_CHUNK_CHARS):
                    yield chunk
            except UnicodeDecodeError as err:
                raise ValueError(f"source: {str(path)!r} is not UTF-8 (byte "
                                 f"{err.object[err.start]:#04x}); convert it, for example "
                                 "with iconv -f latin1 -t utf-8.") from None


def _build_tokenizer(files: list[Path], kind: str, vocab_size: int | None) -> Any:
    if kind == "byte":
        return data.ByteTokenizer()
    if kind == "char":
        chars: set[str] = set()
        for chunk in _chunks(files):
            chars.update(chunk)
        return data.CharTokenizer("".join(sorted(chars)))
    if vocab_size is None or vocab_size <= 256:
        raise ValueError(f"vocab: a BPE vocabulary needs more than the 256 bytes, got "
                         f"{vocab_size!r}.")
    return BPETokenizer.train(_chunks(files), vocab_size)


def _write(files: list[Path], folder: Path, tokenizer: str, vocab_size: int | None,
           validation_fraction: float) -> dict[str, Any]:
    """`prepare_corpus`'s writing: the ids through `.partial` files, renamed when complete."""
    model = _build_tokenizer(files, tokenizer, vocab_size)
    dtype = ids_dtype(model.vocab_size)
    everything = folder / "all.bin.partial"
    count = 0
    with open(everything, "wb") as handle:
        for chunk in _chunks(files):
            ids = model.encode(chunk)
            handle.write(np.asarray(ids, dtype).tobytes())
            count += len(ids)
    if count < 2:
        raise ValueError(f"source: {len(files)} file(s) with {count} token(s); a corpus needs "
                         "text to train on.")
    n_val = int(count * validation_fraction)
    ids = np.memmap(everything, dtype=dtype, mode="r", shape=(count,))
    for name, part in (("train.bin", ids[:count - n_val]), ("val.bin", ids[count - n_val:])):
        with open(folder / f"{name}.partial", "wb") as handle:
            for start in range(0, len(part), 1 << 24):
                handle.write(np.asarray(part[start:start + (1 << 24)]).tobytes())
    del ids
    everything.unlink()
    meta = {"format": FORMAT, "dtype": dtype.name, "vocab_size": int(model.vocab_size),
            "train_tokens": count - n_val, "val_tokens": n_val,
            "source": [str(p) for p in files], "tokenizer": model.to_dict()}
    (folder / "meta.json.partial").write_text(json.dumps(meta, indent=1))
    for name in ("train.bin", "val.bin", "meta.json"):  # every file complete: then named
        os.replace(folder / f"{name}.partial", folder / name)
    return meta


def ids_dtype(vocab_size: int) -> np.dtype:
    """`uint16` when every id fits (at most 65,536 ids), else `uint32`."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def prepare_corpus(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    validation_fraction: float = 0.1,
) -> dict[str, Any]:
    """Tokenise `source` (a text file or a folder of `.txt` files) into `out`.

    Args:
        source: the text, UTF-8.
        out: a new or empty folder; it receives `train.bin`, `val.bin` and `meta.json`.
        tokenizer: `"char"`, `"byte"` or `"bpe"` (trained here on `source`).
        vocab_size: the BPE vocabulary (required for `"bpe"`, > 256).
        validation_fraction: the last fraction of the tokens, in `[0, 1)`, held out.

    Returns:
        The metadata written to `meta.json`.

    The ids are written chunk by chunk, so the text is never held whole; the last
    `validation_fraction` of the ids is moved to `val.bin` at the end. Nothing is written
    into a folder that already holds a corpus (no run's data is ever overwritten).
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer: expected one of {TOKENIZERS}, got {tokenizer!r}.")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction: expected a number in [0, 1), got "
                         f"{validation_fraction!r}.")
    files = source_files(source)
    if all(p.stat().st_size == 0 for p in files):
        raise ValueError(f"source: {str(source)!r} is empty; a corpus needs text to train on.")
    folder = Path(out)
    taken = [n for n in ("train.bin", "val.bin", "meta.json") if (folder / n).exists()]
    if taken:
        raise FileExistsError(f"out: {str(folder)!r} already holds {', '.join(taken)}; "
                              "choose a new folder (a corpus is never overwritten).")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        meta = _write(files, folder, tokenizer, vocab_size, validation_fraction)
    except BaseException:
        for name in ("all.bin.partial", "train.bin.partial", "val.bin.partial",
                     "meta.json.partial"):
            (folder / name).unlink(missing_ok=True)
        raise
    return meta


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared corpus, memory-mapped: `train` and `val` (1-D id arrays, read on
    demand), its `tokenizer` (None for a folder without `meta.json`), `vocab_size` and
    `meta` (the `meta.json` contents)."""

    path: Path
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Any
    meta: dict[str, Any]


def tokenizer_from_dict(d: dict[str, Any]) -> Any:
    """A built-in tokeniser (char, byte or BPE) from its `to_dict` description."""
    if d.get("kind") == "bpe":
        return BPETokenizer.from_dict(d)
    return data.tokenizer_from_dict(d)


def open_corpus(path: str | os.PathLike[str], vocab_size: int | None = None) -> Corpus:
    """Map the corpus in folder `path` (module docstring).

    Args:
        path: a folder from `prepare_corpus`, or one with nanoGPT's `train.bin` and `val.bin`
            (`uint16` ids) and no `meta.json`.
        vocab_size: the vocabulary of a folder without `meta.json` (required there; checked
            against `meta.json` where given).
    """
    folder = Path(path)
    missing = [n for n in ("train.bin", "val.bin") if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"data: {str(folder)!r} has no {' or '.join(missing)}; make "
                                "one with fusedpc prepare SOURCE --out DATA.")
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"data: {str(meta_path)!r} is not a {FORMAT} description "
                             f"(format {meta.get('format')!r}).")
        if vocab_size is not None and vocab_size != meta["vocab_size"]:
            raise ValueError(f"vocab_size: the corpus has {meta['vocab_size']} ids, got "
                             f"{vocab_size}.")
        dtype, size, model = np.dtype(meta["dtype"]), int(meta["vocab_size"]), (
            tokenizer_from_dict(meta["tokenizer"]))
    else:
        if vocab_size is None:
            raise ValueError(f"vocab_size: {str(folder)!r} has no meta.json to say its "
                             "vocabulary; give it (50257 for GPT-2's BPE).")
        meta, dtype, size, model = {}, np.dtype(np.uint16), int(vocab_size), None
    maps = []
    for name in ("train.bin", "val.bin"):
        file = folder / name
        if file.stat().st_size % dtype.itemsize:
            raise ValueError(f"data: {str(file)!r} is {file.stat().st_size} bytes, not a "
                             f"whole number of {dtype.name} ids.")
        maps.append(np.memmap(file, dtype=dtype, mode="r"))
    return Corpus(folder, maps[0], maps[1], size, model, meta)


__all__ = ["FORMAT", "TOKENIZERS", "BPETokenizer", "Corpus", "ids_dtype", "open_corpus",
           "prepare_corpus", "source_files", "tokenizer_from_dict"]
