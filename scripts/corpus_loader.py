"""The memory-mapped corpus loader: tokens per second and resident memory, by corpus size.

Makes corpora of the bundled text's character ids tiled to each `--sizes` (in millions of
tokens; 1,100 M tokens of `uint16` is a 2.2 GB `train.bin`), then, for each, in a fresh
process: opens it (`fusedpc.training.corpus.open_corpus`), draws `--batches` batches of config
M's shape (32 rows of 128 + 1 tokens) with `BatchIterator`, and prints one JSON line: tokens
per second of the draws and the process's resident memory after them, split as the kernel
reports it: `rss_anon_mb` (the process's own memory: arrays, the interpreter, numpy) and
`rss_file_mb` (pages of the mapped file that the draws touched: the kernel's page cache,
shared and reclaimable, bounded by the windows drawn, not by the corpus).

    python scripts/corpus_loader.py                         # 1 M and 1,100 M tokens
    python scripts/corpus_loader.py --sizes 1,50 --batches 200 --keep /tmp/corpora
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS, LENGTH = 32, 128  # config M's batch


def make_corpus(folder: Path, tokens: int) -> None:
    """A corpus of `tokens` ids: the bundled text's character ids, tiled (written in chunks)."""
    from fusedpc.training import corpus, data

    text = data.load_text()
    tokenizer = data.CharTokenizer.from_text(text)
    unit = np.asarray(tokenizer.encode(text), np.uint16)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.bin", "wb") as handle:
        left = tokens
        while left > 0:
            piece = np.tile(unit, max(1, min(left, 1 << 26) // len(unit) + 1))[:min(left, 1 << 26)]
            handle.write(piece.tobytes())
            left -= len(piece)
    unit[:LENGTH * 4].tofile(folder / "val.bin")
    meta = {"format": corpus.FORMAT, "dtype": "uint16", "vocab_size": tokenizer.vocab_size,
            "train_tokens": tokens, "val_tokens": LENGTH * 4, "source": ["bundled text, tiled"],
            "tokenizer": tokenizer.to_dict()}
    (folder / "meta.json").write_text(json.dumps(meta))


def _memory() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile", "VmRSS"):
            fields[name] = int(value.split()[0]) / 1024
    return fields


def measure(folder: str, batches: int) -> dict:
    """In this process: open the corpus, draw `batches` batches, time them, read the memory."""
    from fusedpc.training import corpus, data

    opened = corpus.open_corpus(folder)
    windows = data.BatchIterator(opened.train, ROWS, LENGTH, seed=0)
    windows.next_batch()  # the first page faults and imports out of the timing
    start = time.perf_counter()
    for _ in range(batches):
        x, _ = windows.next_batch()
    elapsed = time.perf_counter() - start
    memory = _memory()
    return {"corpus_tokens": len(opened.train), "corpus_gb": round(opened.train.nbytes / 1e9, 3),
            "batches": batches, "tokens_per_s": round(batches * ROWS * LENGTH / elapsed),
            "rss_mb": round(memory.get("VmRSS", float("nan")), 1),
            "rss_anon_mb": round(memory.get("RssAnon", float("nan")), 1),
            "rss_file_mb": round(memory.get("RssFile", float("nan")), 1),
            "checksum": int(x.sum())}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,1100", help="corpus sizes, millions of tokens")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--keep", default=None, help="make the corpora here and keep them")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a worker
    args = parser.parse_args(argv)
    if args.measure:
        row = measure(args.measure, args.batches)
        print(json.dumps(row), flush=True)
        return [row]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep or scratch)
        for size in (float(v) for v in args.sizes.split(",") if v.strip()):
            folder = root / f"corpus_{size:g}M"
            if not (folder / "meta.json").exists():
                make_corpus(folder, int(size * 1e6))
            out = subprocess.run([sys.executable, __file__, "--measure", str(folder),
                                  "--batches", str(args.batches)],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
