"""Deprecated: `fusedpc.models` moved to `fusedpc.transformer.reference` (removed in 0.4)."""

from fusedpc._deprecation import warn_moved as _warn_moved
from fusedpc.transformer.reference import *  # noqa: F403
from fusedpc.transformer.reference import __all__ as __all__  # noqa: F401

# stacklevel 2: the line that imported this module
_warn_moved("fusedpc.models", "fusedpc.transformer.reference", stacklevel=2)
