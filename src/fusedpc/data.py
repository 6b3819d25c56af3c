"""Deprecated: `fusedpc.data` moved to `fusedpc.training.data` (removed in 0.3)."""

import warnings as _warnings

from fusedpc.training.data import *  # noqa: F403
from fusedpc.training.data import __all__ as __all__  # noqa: F401

_warnings.warn(
    "fusedpc.data moved to fusedpc.training.data; the old name will be removed in 0.3.",
    DeprecationWarning,
    stacklevel=2,
)
