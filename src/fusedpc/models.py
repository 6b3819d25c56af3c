"""Deprecated: `fusedpc.models` moved to `fusedpc.transformer.reference` (removed in 0.3)."""

import warnings as _warnings

from fusedpc.transformer.reference import *  # noqa: F403
from fusedpc.transformer.reference import __all__ as __all__  # noqa: F401

_warnings.warn(
    "fusedpc.models moved to fusedpc.transformer.reference; the old name will be removed in 0.3.",
    DeprecationWarning,
    stacklevel=2,
)
