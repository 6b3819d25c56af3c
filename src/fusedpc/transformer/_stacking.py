"""How a GPT part holds its blocks: a `Repeat` scanned in a `lax.scan`, a `Repeat` unrolled,
or a `Blocks` chain of independent blocks (`hybrid_from_gpt(scan=...)`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from fusedpc.core._part import AbstractPart
from fusedpc.parts._repeat import Repeat
from fusedpc.transformer._gpt import Blocks, TransformerBlock

# `scan="auto"` unrolls this many blocks or fewer (see `blocks_form`).
AUTO_UNROLL_BLOCKS = 4
SCAN_CHOICES = (True, False, "auto")


def blocks_form(scan: bool | str, n_blocks: int, where: str = "scan") -> str:
    """How `hybrid_from_gpt(scan=...)` runs `n_blocks` identical blocks: `"scanned"` (a
    `Repeat` in a `lax.scan`), `"unrolled"` (a `Repeat` unrolled) or `"tuple"` (independent
    blocks in a `Blocks` chain; the name is kept from when they were a bare tuple). `where`
    names the setting in the error for a `scan` that is none of `SCAN_CHOICES`.

    Structurally identical blocks are held by a `Repeat` (their states stacked); optimisers
    made separately by the same call (`optax.adam(1e-3)` in a loop) count as identical, see
    `fusedpc.parts.equivalent`. `scan=True` runs them in a `lax.scan` (compile time flat in
    depth), `scan="auto"` unrolls the `Repeat` up to `AUTO_UNROLL_BLOCKS` blocks and scans
    beyond, and `scan=False`, or blocks that differ, give a `Blocks` chain of independent
    blocks.

    Why "auto": for a few blocks the unrolled program steps faster (on CPU the scan
    zero-fills and copies its stacked caches every step), at the price of a longer compile;
    from about 8 blocks on the scan costs nothing noticeable per step and keeps compile time
    flat in depth (measured in docs/performance.md). Unrolled or scanned, a `Repeat` has the
    same state layout, so checkpoints move between the two.
    """
    if scan not in SCAN_CHOICES:
        raise ValueError(f"{where} must be True, False or 'auto', got {scan!r}.")
    if scan is False:
        return "tuple"
    if scan == "auto" and n_blocks <= AUTO_UNROLL_BLOCKS:
        return "unrolled"
    return "scanned"


def stack_blocks(
    blocks: Sequence[TransformerBlock], form: str, scan: bool | str
) -> AbstractPart:
    """`blocks` held as `form` (from `blocks_form(scan, ...)`): a `Repeat`, or a `Blocks`
    chain where asked (`"tuple"`) or where the blocks differ, which `scan=True` refuses and a
    default scan warns of (the warning points at `hybrid_from_gpt`'s caller)."""
    stacked: AbstractPart = Blocks(blocks)
    if form == "tuple":
        return stacked
    try:
        return Repeat(blocks, unroll=form == "unrolled")
    except (TypeError, ValueError) as err:
        # blocks differ: a `Blocks` chain runs them one after another, and its program
        # (and compile time) grows with depth. Asked to scan: an error; scanning by
        # default: said, with what differs and the fix.
        if scan is True:
            raise ValueError(
                f"hybrid_from_gpt(scan=True): the blocks cannot be scanned. {err}"
            ) from None
        if form == "scanned":
            warnings.warn(
                f"hybrid_from_gpt: the {len(blocks)} blocks run as an unscanned chain, whose "
                f"compile time grows with depth, because they differ. {err} Pass one "
                "optimiser object to every block (hybrid_from_gpt(learn={slot: "
                "optimiser}) does), or scan=False to ask for the chain.",
                UserWarning,
                stacklevel=3,
            )
    return stacked
