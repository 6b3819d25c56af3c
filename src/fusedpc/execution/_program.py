"""The pure step program: `make_step(tree, ...)` gives `init`, `step`, `run` and `predict`
over an explicit carry, usable inside a user's own `jax.jit`, `lax.scan` or `jax.vmap`.

One step is: the forward walk, the descent error at the output, its normalisation, the
backward walk (every part's local learning step and the error at its input), the non-finite
guard (the old state kept, inside the program, when anything came out NaN or infinite) and
the step counters. `FusedPipeline` is a host-side wrapper around exactly these functions
(placement, donation, validation of host batches, reports, checkpoints).

```python
program = fusedpc.make_step(tree, "softmax_cross_entropy")
carry = program.init(jax.random.key(0))
step = jax.jit(program.step, donate_argnums=0)
carry, out = step(carry, x, target)          # out.output, out.input_error, out.metrics
```

Several seeds at once: the weights live in the tree, so build one tree per key under `vmap`
and step them all with one program (its functions hold no arrays, so any seed's serves):

```python
carries = jax.vmap(lambda key: fusedpc.make_step(build(key)).init(key))(keys)
carries, outs = jax.jit(jax.vmap(program.step))(carries, xs, targets)  # xs: (seeds, ...)
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core import losses as _losses
from fusedpc.core._checks import check_part
from fusedpc.core._metrics import all_finite, leaf_finite
from fusedpc.core._part import AbstractPart, Core, PyTree

NONFINITE_POLICIES = ("skip", "raise", "ignore")
NORMALISATIONS = ("active", "rows")


class Counters(eqx.Module):
    """Step counters carried (and donated) with the state: attempted and skipped steps."""

    steps: jax.Array
    skipped: jax.Array


class StepCarry(eqx.Module):
    """What one step reads and writes: the tree's state and the step counters.

    Attributes:
        state: the state pytree of the tree (one named `eqx.Module` per part).
        counters: a `Counters` of int32 scalars (steps attempted, steps skipped).
    """

    state: PyTree
    counters: Counters


class StepMetrics(eqx.Module):
    """Everything one step reports: the loss (NaN without one), whether the step was
    committed, the parts' metrics tree (keyed like the state tree) and `state_finite`, one
    boolean per leaf of the step's new state (before the guard chose between new and old), so
    that a non-finite value outside every part's update and input error (an optimiser's
    moment estimate, say) can still be named."""

    loss: jax.Array
    committed: jax.Array
    parts: PyTree
    state_finite: PyTree = None


class StepOutput(eqx.Module):
    """What one step hands back besides the new carry.

    Attributes:
        output: the tree's output `(rows..., features)` (stacked over K for `run`; `None`
            from `run(..., keep_outputs=False)`).
        input_error: the descent error at the tree's input, $\\partial L/\\partial x$ (same
            stacking; `None` for integer inputs such as token ids, and with
            `keep_outputs=False`).
        metrics: a `StepMetrics` (stacked over K for `run`).
    """

    output: Any
    input_error: Any
    metrics: StepMetrics


def copy_tree(tree: PyTree) -> PyTree:
    """A fresh copy of every array leaf (so donation of the original never reaches it)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array | np.ndarray) else a, tree
    )


def normalise_active(error: jax.Array) -> jax.Array:
    """Scale $E$ by rows / active rows; a row is active when any entry is non-zero.

    $E \\leftarrow E \\cdot R / \\max(A, 1)$, with $R$ rows (all leading axes flattened) and $A$ the
    rows with a non-zero entry. Rows of zero error are padding: the row means that every part
    takes then average over the real rows only.
    """
    rows = error.reshape(-1, error.shape[-1])
    active = jnp.sum(jnp.any(rows != 0, axis=-1).astype(error.dtype))
    return error * (rows.shape[0] / jnp.maximum(active, 1.0))


def scan_steps(
    step: Callable, carry: Any, xs: Any, targets: Any, keep_outputs: bool = True
) -> tuple[Any, StepOutput]:
    """K applications of `step(carry, x, target) -> (carry, StepOutput)` in one `lax.scan`
    over the leading axis of `xs` and `targets`; outputs and metrics stacked over K."""

    def body(c, batch):
        c, out = step(c, *batch)
        if not keep_outputs:
            out = StepOutput(None, None, out.metrics)
        return c, out

    return jax.lax.scan(body, carry, (xs, targets))


class StepProgram:
    """The training step of one part tree as pure functions over an explicit `StepCarry`.

    Made by `fusedpc.make_step`. Nothing here holds arrays or state: every method is a pure
    function of its arguments, so it can be jitted (with `donate_argnums=0` to write the new
    state into the old buffers), scanned, vmapped or differentiated like any JAX function.

    Attributes:
        tree: the root part the program was compiled from.
        core: the tree's `Core` (`tree.compile("")`).
        error_fn: the resolved `fusedpc.losses.ErrorFunction`.
        error_normalisation: `"active"` or `"rows"`.
        nonfinite: `"skip"`, `"raise"` or `"ignore"` (inside the program `"raise"` acts as
            `"skip"`; raising is the host wrapper's business).
    """

    def __init__(
        self,
        tree: AbstractPart,
        core: Core,
        error_fn: _losses.ErrorFunction,
        error_normalisation: str,
        nonfinite: str,
    ):
        self.tree = tree
        self.core = core
        self.error_fn = error_fn
        self.error_normalisation = error_normalisation
        self.nonfinite = nonfinite

    def __repr__(self) -> str:
        return (
            f"StepProgram(tree={type(self.tree).__name__}, error_fn={self.error_fn.name!r}, "
            f"error_normalisation={self.error_normalisation!r}, nonfinite={self.nonfinite!r})"
        )

    def init(self, key: jax.Array) -> StepCarry:
        """The initial carry: the tree's state from `key` (copied, so that donating it never
        reaches the arrays held by the part objects) and zeroed counters."""
        return StepCarry(
            state=copy_tree(self.tree.init_state(key)),
            counters=Counters(
                steps=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32)
            ),
        )

    def step(self, carry: StepCarry, x: Any, target: Any) -> tuple[StepCarry, StepOutput]:
        """One training step: returns the new carry and the step's `StepOutput`.

        Args:
            carry: the current `StepCarry`.
            x: a batch `(rows..., features)` (or token ids `(batch, seq)` for a GPT).
            target: what `error_fn(output, target)` compares the output with.
        """
        state, counters = carry.state, carry.counters
        y, cache = self.core.forward(state, x)
        error = self.error_fn.error(y, target)
        if self.error_normalisation == "active":
            error = normalise_active(error)
        input_error, new_state, part_metrics = self.core.backward(state, cache, error)
        if self.error_fn.loss is None:
            loss = jnp.full((), jnp.nan, jnp.float32)
        else:
            loss = self.error_fn.loss(y, target).astype(jnp.float32)
        # One flag per state leaf (kept in the metrics to name a bad leaf), then one for all.
        state_finite = jax.tree_util.tree_map(leaf_finite, new_state)
        finite = jnp.stack(
            [*jax.tree_util.tree_leaves(state_finite), all_finite((y, input_error))]
        ).all()
        if self.nonfinite == "ignore":
            committed = jnp.array(True)
        else:
            committed = finite
            new_state = jax.tree_util.tree_map(
                lambda n, o: jnp.where(committed, n, o), new_state, state
            )
        counters = Counters(
            steps=counters.steps + 1,
            skipped=counters.skipped + (~committed).astype(jnp.int32),
        )
        metrics = StepMetrics(
            loss=loss, committed=committed, parts=part_metrics, state_finite=state_finite
        )
        return StepCarry(new_state, counters), StepOutput(y, input_error, metrics)

    def run(
        self, carry: StepCarry, xs: Any, targets: Any, keep_outputs: bool = True
    ) -> tuple[StepCarry, StepOutput]:
        """K steps in one `lax.scan` over the leading axis of `xs` and `targets`; equal to K
        calls of `step`. With `keep_outputs=False` the outputs and input errors are dropped
        (`None`) and only the stacked metrics are kept."""
        return scan_steps(self.step, carry, xs, targets, keep_outputs)

    def predict(self, state: PyTree, x: Any) -> Any:
        """The forward walk only: the tree's output for `x` under `state`."""
        return self.core.forward(state, x)[0]

    def write_back(self, state: PyTree) -> AbstractPart:
        """The tree holding `state` (pass a copy if the state's buffers will be donated)."""
        return self.core.write_back(state)


def make_step(
    tree: AbstractPart,
    error_fn: _losses.ErrorFunction | str | Callable | None = None,
    error_normalisation: str = "active",
    *,
    nonfinite: str = "skip",
) -> StepProgram:
    """Compile a part tree into its pure training step.

    Args:
        tree: the root part.
        error_fn: the descent error at the output: `None` (squared error, $y - t$), a name from
            `fusedpc.losses` (`"softmax_cross_entropy"`, `"cross_entropy"`, ...), an
            `ErrorFunction`, or a callable `error_fn(output, target) -> error`.
        error_normalisation: `"active"` rescales the error by rows / rows with a non-zero error
            (zero rows are padding); `"rows"` leaves it.
        nonfinite: `"skip"` (or `"raise"`) keeps the old state when the new state, the output
            or the input error holds NaN/inf and counts the step as skipped; `"ignore"`
            commits it anyway.

    Returns:
        A `StepProgram` with pure `init(key)`, `step(carry, x, target)`,
        `run(carry, xs, targets, keep_outputs)` and `predict(state, x)`.
    """
    check_part(tree, "make_step(tree)")
    if error_normalisation not in NORMALISATIONS:
        raise ValueError(
            f"error_normalisation: expected one of {NORMALISATIONS}, got "
            f"{error_normalisation!r}."
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite: expected one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    return StepProgram(
        tree, tree.compile(""), _losses.resolve(error_fn), error_normalisation, nonfinite
    )


__all__ = [
    "Counters",
    "StepCarry",
    "StepMetrics",
    "StepOutput",
    "StepProgram",
    "copy_tree",
    "make_step",
    "normalise_active",
    "scan_steps",
]
