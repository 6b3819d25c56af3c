"""The installed package's version, read from its metadata (the one place it is written is
pyproject.toml). Imports nothing else of fusedpc, so every layer may use it."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("fusedpc")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
