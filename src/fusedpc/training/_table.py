"""One printer for the fixed-width text tables of the CLI, the calibration and the bench."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Column", "format_rows"]

_ALIGNS = ("<", ">", "^")


class Column(NamedTuple):
    """One column of `format_rows`: the row key it shows, its heading, how a value is
    written (`format(value, spec)`, e.g. `".2f"`, `",.0f"`; `""`: `str(value)`) and its
    alignment (`"<"` left, `">"` right, `"^"` centred)."""

    key: str
    heading: str = ""
    spec: str = ""
    align: str = "<"


def _cell(row: Mapping[str, Any], column: Column, missing: str) -> str:
    value = row.get(column.key)
    if value is None:
        return missing
    return format(value, column.spec) if column.spec else str(value)


def format_rows(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column | tuple[str, ...]],
    *,
    title: str | None = None,
    header: bool = True,
    frame: bool = True,
    gap: int = 2,
    missing: str = "-",
) -> str:
    """A fixed-width text table: one line per row, one column per entry of `columns`.

    Each column is as wide as its widest cell (heading included); columns are separated by
    `gap` spaces and trailing spaces are dropped, so a left-aligned last column is not padded.
    The layout, top to bottom: `title` (if given), a rule of `-` (if `frame`), the headings
    (if `header`) and a rule under them, the rows, and a closing rule (if `frame`). Every rule
    is as long as the table is wide.

    Args:
        rows: one mapping per line; a missing key or a `None` value shows `missing`.
        columns: `Column`s, or tuples `(key, heading[, spec[, align]])` read as `Column`s.
        title: a line above the table.
        header: whether to print the headings (and the rule under them).
        frame: whether to print a rule above and below the table.
        gap: spaces between columns, >= 0.
        missing: the cell of a missing or `None` value.

    Returns:
        The table as one string, lines joined by `"\\n"`, no final newline.

    Raises:
        ValueError: for no columns, a negative `gap` or an unknown alignment.
    """
    cols = [c if isinstance(c, Column) else Column(*c) for c in columns]
    if not cols:
        raise ValueError("format_rows: columns must name at least one column, got none.")
    if gap < 0:
        raise ValueError(f"format_rows: gap must be >= 0, got {gap!r}.")
    for c in cols:
        if c.align not in _ALIGNS:
            raise ValueError(
                f"format_rows: column {c.key!r} has align={c.align!r}; expected one of "
                f"{_ALIGNS}."
            )
    body = [[_cell(row, c, missing) for c in cols] for row in rows]
    headings = [c.heading for c in cols]
    widths = [
        max(len(cell) for cell in cells)
        for cells in zip(*([headings] if header else []), *body, [""] * len(cols),
                         strict=True)
    ]
    separator = " " * gap

    def line(cells: list[str]) -> str:
        return separator.join(
            f"{cell:{c.align}{w}}" for cell, c, w in zip(cells, cols, widths, strict=True)
        ).rstrip()

    rule = "-" * (sum(widths) + gap * (len(widths) - 1))
    lines = [] if title is None else [title]
    if frame:
        lines.append(rule)
    if header:
        lines += [line(headings), rule]
    lines += [line(cells) for cells in body]
    if frame:
        lines.append(rule)
    return "\n".join(lines)
