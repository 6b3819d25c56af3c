"""Deprecated: `fusedpc.errors` moved to `fusedpc.losses` (removed in 0.4)."""

from fusedpc._deprecation import warn_moved as _warn_moved
from fusedpc.losses import *  # noqa: F403
from fusedpc.losses import __all__ as __all__  # noqa: F401

# stacklevel 2: the line that imported this module
_warn_moved("fusedpc.errors", "fusedpc.losses", stacklevel=2)
