"""Fused kernels of an optimised HLO module: how many, and how many distinct.

XLA:CPU compiles each distinct fused kernel on its own (its MLIR emitters, then LLVM), so a
program's compile time follows the number of *distinct* kernels (docs/benchmarks.md, "Report
values as vectors"). Two fusions count as one when their computations are the same once
instruction names and metadata are set aside: the same operations, shapes, constants and data
flow. Used by `scripts/count_kernels.py` and `scripts/stacked_update_kernels.py`.
"""

from __future__ import annotations

import re
from collections import Counter

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_FUSION = re.compile(r"= .*? fusion\(.*calls=%([\w.\-]+)")
_NAME = re.compile(r"%[\w.\-]+")
_DROPPED = (re.compile(r",?\s*metadata=\{[^}]*\}"), re.compile(r",?\s*backend_config=.*$"))


def computations(hlo: str) -> dict[str, list[str]]:
    """The HLO text's computations: name -> its instruction lines (without the braces)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            found[current] = []
        elif current is not None and line.strip() not in ("", "}"):
            found[current].append(line.strip())
    return found


def normalised(lines: list[str]) -> str:
    """A computation's text with metadata dropped and its names replaced, in order of first
    appearance, by numbers: equal for computations that differ only in names."""
    numbers: dict[str, str] = {}

    def number(match: re.Match) -> str:
        return numbers.setdefault(match.group(0), f"%{len(numbers)}")

    out = []
    for line in lines:
        for pattern in _DROPPED:
            line = pattern.sub("", line)
        out.append(_NAME.sub(number, line))
    return "\n".join(out)


def count_fusions(hlo: str) -> dict[str, int]:
    """Fusion instructions in `hlo` (a compiled program's `as_text()`) and the distinct fused
    computations among them: `{"fusions": ..., "distinct_fusions": ...}`."""
    comps = computations(hlo)
    called = [m.group(1) for lines in comps.values() for line in lines
              if (m := _FUSION.search(line))]
    distinct = Counter(normalised(comps.get(name, [])) for name in called)
    return {"fusions": len(called), "distinct_fusions": len(distinct)}
