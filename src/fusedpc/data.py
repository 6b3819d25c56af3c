"""Deprecated: `fusedpc.data` moved to `fusedpc.training.data` (removed in 0.4)."""

from fusedpc._deprecation import warn_moved as _warn_moved
from fusedpc.training.data import *  # noqa: F403
from fusedpc.training.data import __all__ as __all__  # noqa: F401

# stacklevel 2: the line that imported this module
_warn_moved("fusedpc.data", "fusedpc.training.data", stacklevel=2)
