"""One helper for fusedpc's deprecations: `warn_deprecated` says what changed, what to use
instead, and the release that removes the old spelling (`REMOVED_IN`, the release after this
one: a deprecation says it, and that release removes it)."""

from __future__ import annotations

import warnings

REMOVED_IN = "0.5"


def warn_deprecated(message: str, stacklevel: int = 2) -> None:
    """A `DeprecationWarning`: `message` (what changed and what to use), then the release
    that removes the old spelling. `stacklevel` as `warnings.warn`'s, counted from the
    caller of this function (2: the line that called the caller)."""
    warnings.warn(f"{message}; the old name will be removed in {REMOVED_IN}.",
                  DeprecationWarning, stacklevel=stacklevel + 1)
