"""Deprecated: `fusedpc.errors` moved to `fusedpc.losses` (removed in 0.3)."""

import warnings as _warnings

from fusedpc.losses import *  # noqa: F403
from fusedpc.losses import __all__ as __all__  # noqa: F401

_warnings.warn(
    "fusedpc.errors moved to fusedpc.losses; the old name will be removed in 0.3.",
    DeprecationWarning,
    stacklevel=2,
)
