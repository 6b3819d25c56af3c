"""Learning rules as typed settings: what a learning part's weights step by.

`PrecisionWeighted()` (the backprop gradient through the part's precisions), `Standard()`
(precision-normalised errors, the peer's "standard" rule) and `SynapticUncertainty(window,
...)` (a gaussian belief per weight; its own update, no optimiser). A part takes one as
`learning_kind`; the string names (`"precision_weighted"`, `"standard"`,
`"synaptic_uncertainty"` with a `learning_kwargs` dict) are the spelling of the CLI and the
TOML file, which `learning_rule` turns into these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class PrecisionWeighted:
    """The precision-weighted rule: the child factor is the precision-weighted error, which
    makes a single sweep exactly the backprop gradient (the default)."""

    kind: ClassVar[str] = "precision_weighted"

    def keywords(self) -> dict[str, Any]:
        return {}


@dataclasses.dataclass(frozen=True)
class Standard:
    """The standard rule: the child factor divided by the posterior precision."""

    kind: ClassVar[str] = "standard"

    def keywords(self) -> dict[str, Any]:
        return {}


@dataclasses.dataclass(frozen=True)
class SynapticUncertainty:
    """Synaptic uncertainty: each weight a gaussian belief of precision $\\pi_w$, stepped by
    its own rule (no optimiser; see `fusedpc.parts.learning`'s `synaptic_step`).

    Attributes:
        window: the memory window $N$ in steps (>= 1).
        prior_variance: $\\sigma_p^2$ (> 0).
        prior_mean: $\\mu_p$.
        learning_rate: $\\alpha$ (> 0).
        increment_scale: $c$ (> 0).
    """

    window: float
    prior_variance: float = 1.0
    prior_mean: float = 0.0
    learning_rate: float = 1.0
    increment_scale: float = 1.0

    kind: ClassVar[str] = "synaptic_uncertainty"

    def keywords(self) -> dict[str, Any]:
        """The settings as `learning_kwargs`: the window and those not at their default (so
        that the rule and its string spelling make one static configuration)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "window" or value != field.default:
                out[field.name] = value
        return out


LearningRule = PrecisionWeighted | Standard | SynapticUncertainty
RULES: dict[str, type] = {rule.kind: rule for rule in (PrecisionWeighted, Standard,
                                                        SynapticUncertainty)}


def learning_rule(kind: str, keywords: dict[str, Any] | None = None) -> LearningRule:
    """The rule named `kind` with `keywords` (the CLI's and TOML's spelling), checked as a
    part checks them (an unknown name or keyword, a missing `window`, a value out of range:
    a `ValueError` naming it and what is allowed)."""
    from fusedpc.parts.learning._local_update import resolve_learning  # it imports this one

    resolve_learning("learning_rule", None, kind, keywords, 1.0)
    return RULES[kind](**(keywords or {}))


def rule_spelling(owner: str, learning_kind: Any,
                  learning_kwargs: dict | None) -> tuple[str, dict | None]:
    """`(kind, keywords)` of a part's `learning_kind` argument: a rule object (then
    `learning_kwargs` must be None) or its string name with `learning_kwargs`."""
    if isinstance(learning_kind, PrecisionWeighted | Standard | SynapticUncertainty):
        if learning_kwargs:
            raise ValueError(
                f"{owner}: learning_kwargs given with a rule object {learning_kind!r}; the "
                "rule holds its settings (SynapticUncertainty(window=...)).")
        return learning_kind.kind, learning_kind.keywords() or None
    return learning_kind, learning_kwargs


__all__ = ["LearningRule", "PrecisionWeighted", "Standard", "SynapticUncertainty",
           "learning_rule", "rule_spelling"]
