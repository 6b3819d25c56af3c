"""Learning-rate multipliers kept in the optimiser state, so that a calibration can change
them between steps without recompiling, and a checkpoint saves and restores them.

`with_rate_multiplier(optimiser)` is `optax.chain(optimiser, scale_by_rate_multiplier())`:
the optimiser's update $u$ is multiplied by a float32 scalar $m$ held in the state
(`RateMultiplierState.multiplier`, 1 at the start),

$$\\theta \\leftarrow \\theta + m\\,u ,$$

which is the optimiser at rate $m\\eta$ for SGD, Adam and AdamW alike (their update is
proportional to $\\eta$; AdamW's decoupled decay $\\eta\\lambda\\theta$ is scaled with it).
$m = 1$ leaves every update bit for bit as it was. A bare `scale_by_rate_multiplier()` given
to a `synaptic_uncertainty` part scales the gradient that rule steps on: the rule at rate
$m\alpha$, its reversion to the prior unscaled. `rate_multipliers(state)` reads the
multipliers by group (a GPT's slots by default: `gpt_slot`) and
`set_rate_multipliers(state, {group: m})` returns the state with new ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fusedpc.parts.learning._local_update import (
    RateMultiplier,
    RateMultiplierState,
    scale_by_rate_multiplier,
)

__all__ = [
    "RateMultiplier",
    "RateMultiplierState",
    "gpt_slot",
    "rate_multipliers",
    "scale_by_rate_multiplier",
    "set_rate_multipliers",
    "with_rate_multiplier",
]


def with_rate_multiplier(optimiser: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optax.chain(optimiser, scale_by_rate_multiplier())`: `optimiser` at a rate that can be
    multiplied from outside the compiled step (its state holds the multiplier)."""
    return optax.chain(optimiser, scale_by_rate_multiplier())


def gpt_slot(path: str) -> str | None:
    """The GPT slot (`fusedpc.transformer.SLOTS`) of a state path (`jax.tree_util.keystr`),
    or None: `.blocks.blocks.attention.wq.opt_state...` -> `"attention"`, `.head...` ->
    `"head"`; the LayerNorms `n1`, `n2` and `norm_f` -> `"norm"`."""
    for slot in ("attention", "feed_forward"):
        if f".{slot}." in path or f".{slot}[" in path:
            return slot
    if any(f".{name}." in path for name in ("n1", "n2", "norm_f")) or path.startswith(
        ".norm_f"
    ):
        return "norm"
    for slot in ("token", "position", "head"):
        if path.startswith(f".{slot}.") or path.startswith(f".{slot}["):
            return slot
    return None


def _is_multiplier(node: Any) -> bool:
    return isinstance(node, RateMultiplierState)


def _multiplier_nodes(
    state: Any, group: Callable[[str], str | None]
) -> list[tuple[str | None, RateMultiplierState]]:
    """`(group, node)` for every `RateMultiplierState` in `state`, in tree order."""
    return [
        (group(jax.tree_util.keystr(path)), node)
        for path, node in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_multiplier)
        if _is_multiplier(node)
    ]


def rate_multipliers(
    state: Any, group: Callable[[str], str | None] = gpt_slot
) -> dict[str, float]:
    """The multiplier of every group whose optimisers carry one (`with_rate_multiplier`),
    in tree order: `{"attention": 0.5, ...}`. A group whose parts hold different values
    (blocks set one by one) reports their geometric mean. `{}` when there are none.

    Args:
        state: a pipeline's state (`pipeline.state`).
        group: a state path (`jax.tree_util.keystr`) -> its group name, or None to leave it
            out; a GPT's slots by default (`gpt_slot`).
    """
    values: dict[str, list[float]] = {}
    for name, node in _multiplier_nodes(state, group):
        if name is not None:
            values.setdefault(name, []).extend(np.ravel(np.asarray(node.multiplier)).tolist())
    return {
        name: float(np.exp(np.mean(np.log(v)))) if len(set(v)) > 1 else float(v[0])
        for name, v in values.items()
    }


def set_rate_multipliers(
    state: Any,
    multipliers: Mapping[str, float],
    group: Callable[[str], str | None] = gpt_slot,
) -> Any:
    """`state` with the multiplier of every named group replaced (groups not named keep
    theirs); the state's structure, shapes and dtypes are unchanged, so a pipeline takes it
    with `set_state` and steps on without recompiling.

    Args:
        state: a pipeline's state.
        multipliers: `{group: m}`, each `m` a positive finite number (the rate's factor
            against the optimiser's own rate, not against the current multiplier).
        group: as in `rate_multipliers`.

    Raises:
        ValueError: for a group that no multiplier belongs to (the message lists those that
            exist) or a multiplier that is not a positive finite number.
    """
    present = {name for name, _ in _multiplier_nodes(state, group) if name is not None}
    unknown = sorted(set(multipliers) - present)
    if unknown:
        raise ValueError(
            f"multipliers: no rate multiplier belongs to {unknown}; the state has "
            f"{sorted(present) or 'none'} (build the optimisers with with_rate_multiplier)."
        )
    for name, m in multipliers.items():
        if not (isinstance(m, int | float | np.floating) and m > 0 and math.isfinite(m)):
            raise ValueError(
                f"multipliers[{name!r}]: expected a positive finite number, got {m!r}."
            )

    def replace(path, node):
        if not _is_multiplier(node):
            return node
        name = group(jax.tree_util.keystr(path))
        if name not in multipliers:
            return node
        value = jnp.full_like(node.multiplier, float(multipliers[name]))
        return RateMultiplierState(value)

    return jax.tree_util.tree_map_with_path(replace, state, is_leaf=_is_multiplier)
