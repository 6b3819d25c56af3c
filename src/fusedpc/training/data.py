"""Bundled text, tokenisers and reproducible, resumable batching.

The package ships one small public-domain English text (Shakespeare's *Hamlet*, see
``_texts/README.md``) so that examples, tests and benchmarks run without a network.

Typical use::

    text = load_text()                         # the bundled default
    tok = CharTokenizer.from_text(text)
    train, val = split(tok.encode(text), validation_fraction=0.1)
    batches = BatchIterator(train, batch_size=32, seq_len=128, seed=0)
    inputs, targets = batches.next_batch()     # each (32, 128), int32
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import mmap
import os
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "DEFAULT_TEXT",
    "BatchIterator",
    "ByteTokenizer",
    "CharTokenizer",
    "Tokenizer",
    "bundled_texts",
    "load_text",
    "split",
    "check_tokenizer",
    "tokenizer_from_dict",
]

DEFAULT_TEXT = "hamlet"
"""Name of the bundled text that `load_text()` returns by default."""


def _texts_dir():
    return importlib.resources.files("fusedpc.training") / "_texts"


def bundled_texts() -> tuple[str, ...]:
    """Names of the texts shipped with the package (file names without ``.txt``)."""
    return tuple(
        sorted(
            entry.name[: -len(".txt")]
            for entry in _texts_dir().iterdir()
            if entry.name.endswith(".txt")
        )
    )


def load_text(name_or_path: str | os.PathLike[str] | None = None) -> str:
    """Load a text as a string.

    Args:
        name_or_path: ``None`` for the bundled default (`DEFAULT_TEXT`), the name of a
            bundled text (see `bundled_texts`), or the path of a UTF-8 text file of your own.

    Returns:
        The text's contents.

    Raises:
        FileNotFoundError: when `name_or_path` is neither a bundled name nor an existing file.
        ValueError: when the file is not UTF-8 text (the message names it).
    """
    if name_or_path is None:
        name_or_path = DEFAULT_TEXT
    if isinstance(name_or_path, str) and name_or_path in bundled_texts():
        return (_texts_dir() / f"{name_or_path}.txt").read_text(encoding="utf-8")
    path = os.fspath(name_or_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no text file at {path!r}, and it is not a bundled text name "
            f"(bundled texts: {', '.join(bundled_texts())})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"text file {path!r} is not UTF-8 (it holds byte {err.object[err.start]:#04x}, "
            f"which UTF-8 cannot start there); save it as UTF-8, or convert it (for example "
            f"iconv -f latin1 -t utf-8)."
        ) from None


def _as_ids(ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr


def ids_in_range(ids: Any, vocab_size: int) -> np.ndarray:
    """`ids` as a 1-D integer array, every id in `[0, vocab_size)` (else a `ValueError`
    naming the range and the values found): what a tokeniser's `decode` takes."""
    arr = _as_ids(ids)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}), got values from {arr.min()} "
            f"to {arr.max()}"
        )
    return arr


@runtime_checkable
class Tokenizer(Protocol):
    """What a run needs of a tokeniser; `CharTokenizer` and `ByteTokenizer` are two, and any
    object with these four members is another (no base class to inherit).

    The vocabulary is the ids $0, \\dots, V - 1$ with $V$ = `vocab_size`; the model's token
    table and head have $V$ rows.
    """

    @property
    def vocab_size(self) -> int:
        """$V$, the number of distinct token ids."""
        ...

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text`: a 1-D integer array of length $N$, values in $[0, V)$."""
        ...

    def decode(self, ids: Any) -> str:
        """The text of the token ids `ids` (a 1-D integer sequence in $[0, V)$)."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description, saved in the run's checkpoint."""
        ...


def check_tokenizer(tokenizer: Any, where: str = "tokenizer") -> Tokenizer:
    """`tokenizer` if it has what `Tokenizer` asks for, else a `TypeError` naming what it lacks.

    Args:
        tokenizer: the object to check.
        where: the name of the argument, for the message.

    Returns:
        `tokenizer`, unchanged.
    """
    missing = [name for name in ("encode", "decode", "vocab_size", "to_dict")
               if not hasattr(tokenizer, name)]
    if missing:
        raise TypeError(
            f"{where}: expected a tokeniser with encode, decode, vocab_size and to_dict "
            f"(fusedpc.training.data.Tokenizer), got {type(tokenizer).__name__} without "
            f"{', '.join(missing)}."
        )
    size = tokenizer.vocab_size
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise TypeError(f"{where}: vocab_size must be a positive integer, got {size!r}.")
    return tokenizer


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokeniser: token ``i`` is the ``i``-th character of `chars`.

    `chars` holds each character once, sorted by code point. Build one with
    `CharTokenizer.from_text`. Characters not in the vocabulary cannot be encoded.
    """

    chars: str

    def __post_init__(self):
        if len(self.chars) == 0:
            raise ValueError("a CharTokenizer needs at least one character")
        if list(self.chars) != sorted(set(self.chars)):
            raise ValueError("chars must be unique and sorted by code point")

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokeniser whose vocabulary is the sorted set of characters of `text`."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens."""
        return len(self.chars)

    @property
    def _codes(self) -> np.ndarray:
        return np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, shape ``(len(text),)``, dtype int32."""
        codes = self._codes
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(codes, points)
        known = codes[np.minimum(ids, len(codes) - 1)] == points
        if not known.all():
            bad = sorted({chr(c) for c in points[~known]})
            raise ValueError(f"characters not in the vocabulary: {bad!r}")
        return ids.astype(np.int32)

    def decode(self, ids: Any) -> str:
        """The string whose token ids are `ids` (a 1-D integer sequence)."""
        arr = ids_in_range(ids, self.vocab_size)
        return self._codes[arr.astype(np.int64)].astype("<u4").tobytes().decode("utf-32-le")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description, inverted by `from_dict`."""
        return {"kind": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CharTokenizer:
        """Rebuild a tokeniser saved with `to_dict`."""
        if d.get("kind") != "char":
            raise ValueError(f"not a CharTokenizer description: kind={d.get('kind')!r}")
        return cls(d["chars"])


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Byte-level tokeniser: the tokens are the 256 byte values of the UTF-8 encoding.

    `decode` replaces byte sequences that are not valid UTF-8 (as a model's samples may
    be) with U+FFFD rather than raising.
    """

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens (256)."""
        return 256

    def encode(self, text: str) -> np.ndarray:
        """Token ids of the UTF-8 bytes of `text`, dtype int32."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Any) -> str:
        """The string whose UTF-8 bytes are `ids` (a 1-D integer sequence in [0, 256))."""
        arr = _as_ids(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte token ids must lie in [0, 256)")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description, inverted by `from_dict`."""
        return {"kind": "byte"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ByteTokenizer:
        """Rebuild a tokeniser saved with `to_dict`."""
        if d.get("kind") != "byte":
            raise ValueError(f"not a ByteTokenizer description: kind={d.get('kind')!r}")
        return cls()


def tokenizer_from_dict(d: dict[str, Any]) -> Any:
    """Rebuild a built-in tokeniser from its `to_dict` description (dispatching on ``kind``).

    A tokeniser of your own is not rebuilt from its description: give it again (e.g.
    `train(..., tokenizer=mine)` when resuming, `load_run(folder, tokenizer=mine)`).
    """
    kind = d.get("kind")
    if kind == "bpe":  # its module imports this one
        from fusedpc.training.corpus import BPETokenizer

        return BPETokenizer.from_dict(d)
    kinds: dict[str, type[CharTokenizer] | type[ByteTokenizer]] = {
        "char": CharTokenizer, "byte": ByteTokenizer
    }
    if kind not in kinds:
        raise ValueError(f"unknown tokeniser kind {kind!r}; expected one of "
                         f"{sorted([*kinds, 'bpe'])}")
    return kinds[kind].from_dict(d)


def split(ids: Any, validation_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Split a token sequence into contiguous training and validation parts.

    The last ``floor(n * validation_fraction)`` tokens form the validation part and the
    rest the training part, so no window of either part overlaps the other.
    """
    arr = _as_ids(ids)
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must lie in [0, 1), got {validation_fraction}")
    n_val = int(len(arr) * validation_fraction)
    n_train = len(arr) - n_val
    return arr[:n_train], arr[n_train:]


class BatchIterator:
    """Random windows of a token sequence, reproducible from a seed and resumable.

    Batch number ``k`` (counting from 0) draws `batch_size` window starts uniformly from
    ``[0, n - seq_len - 1]`` with ``numpy.random.default_rng([seed, k])`` and takes windows
    ``w`` of ``seq_len + 1`` tokens, shape ``(batch_size, seq_len + 1)``; it returns
    ``inputs = w[:, :-1]`` and ``targets = w[:, 1:]``, each ``(batch_size, seq_len)``,
    int32. Because each batch depends only on ``(seed, k)``, the position is the single
    integer `step`, saved by `state_dict` and restored by `load_state_dict`: a resumed
    iterator draws exactly the batches an uninterrupted one would, and
    ``next_batches(k)`` equals ``k`` calls of `next_batch` stacked.

    Args:
        data: 1-D integer token ids, ``n`` of them with ``n >= seq_len + 1`` (an array, or a
            memory map such as `fusedpc.training.corpus.open_corpus` gives: it is never read
            whole, only the windows drawn).
        batch_size: windows per batch.
        seq_len: tokens per input row.
        seed: non-negative integer seed.
    """

    def __init__(self, data: Any, batch_size: int, seq_len: int, *, seed: int = 0):
        # kept as given: a memory-mapped corpus stays on disk, each window read and widened;
        # its windows are read through a map opened for the one batch and closed after it
        # (as nanoGPT does), so the pages a run touches do not stay in its resident memory
        # (a whole map only: a slice of one keeps its parent's offset, so it is read as an array)
        whole = isinstance(data, np.memmap) and isinstance(data.base, mmap.mmap)
        self._file = (data.filename, data.dtype, data.offset, data.shape) if whole and (
            data.filename) else None
        self.data = _as_ids(data)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if seq_len + 1 > len(self.data):
            raise ValueError(
                f"seq_len {seq_len} needs at least {seq_len + 1} tokens of data, "
                f"but the data has {len(self.data)}"
            )
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.step = 0
        self._offsets = np.arange(self.seq_len + 1)

    def _windows(self, k: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, k])
        starts = rng.integers(0, len(self.data) - self.seq_len, size=self.batch_size)
        if self._file is None:
            return self.data[starts[:, None] + self._offsets].astype(np.int32)
        filename, dtype, offset, shape = self._file
        mapped = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)
        windows = mapped[starts[:, None] + self._offsets].astype(np.int32)
        del mapped  # unmapped: its pages leave this process (they stay in the page cache)
        return windows

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next ``(inputs, targets)``, each ``(batch_size, seq_len)``."""
        w = self._windows(self.step)
        self.step += 1
        return w[:, :-1], w[:, 1:]

    def next_batches(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The next `k` batches stacked: ``(inputs, targets)``, each
        ``(k, batch_size, seq_len)``."""
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        w = np.stack([self._windows(self.step + i) for i in range(k)])
        self.step += k
        return w[..., :-1], w[..., 1:]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The iterator's position, JSON-serialisable."""
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a `state_dict`; the batch shape must be the same as when it was saved."""
        for name in ("batch_size", "seq_len"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"saved {name} {state[name]} differs from this iterator's {getattr(self, name)}"
                )
        if state["step"] < 0:
            raise ValueError(f"step must be non-negative, got {state['step']}")
        self.seed = int(state["seed"])
        self.step = int(state["step"])
