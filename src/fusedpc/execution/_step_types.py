"""What a step carries and gives back: the carry (state and counters), the step's output and
its metrics, the in-program check of a row mask, and the reasons a step is refused."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._checks import IdRangeCheck
from fusedpc.core._packed import Packed
from fusedpc.core._part import PyTree
from fusedpc.execution._step_settings import NONFINITE_POLICIES as NONFINITE_POLICIES
from fusedpc.execution._validation import mask_problem

NORMALISATIONS = ("active", "rows")
# Why a step was not committed: `StepMetrics.skip_reason` is 0 for a committed step and
# 1 + the index of the first rule, in this order, that refused it.
SKIP_REASONS = ("id out of range", "invalid mask", "non-finite", "update ratio", "loss spike")
# The loss guard's running mean: the plain mean of the first LOSS_MEAN_HORIZON committed
# losses, then an exponential mean with that horizon; it guards from LOSS_SPIKE_WARMUP
# committed steps on.
LOSS_MEAN_HORIZON = 100
LOSS_SPIKE_WARMUP = 10


class MaskCheck(eqx.Module):
    """The in-program check of a step's row mask (a device mask's values are not read back
    before the step): every weight finite and >= 0, and some weight.

    Attributes:
        ok: whether the mask is usable (the step's `"invalid mask"` rule).
        finite: whether every weight is finite.
        low: the smallest finite weight.
        total: the sum of the weights (float32).
    """

    ok: jax.Array
    finite: jax.Array
    low: jax.Array
    total: jax.Array

    def message(self, argument: str = "mask") -> str:
        """One line naming `argument`: what is wrong with the mask (host values)."""
        problem = mask_problem(bool(np.asarray(self.finite)), float(np.asarray(self.low)),
                               float(np.asarray(self.total)))
        return f"{argument}: {problem or 'the mask was refused.'}"


def mask_check(weights: jax.Array) -> MaskCheck:
    """The `MaskCheck` of a step's row weights (two reductions over one weight per row)."""
    w = jnp.asarray(weights, jnp.float32)
    finite = jnp.all(jnp.isfinite(w))
    low = jnp.min(jnp.where(jnp.isfinite(w), w, 0.0))
    total = jnp.sum(w)
    return MaskCheck(finite & (low >= 0) & (total > 0) & jnp.isfinite(total), finite, low, total)


class Counters(eqx.Module):
    """Step counters carried (and donated) with the state.

    Attributes:
        steps: steps attempted (int32).
        skipped: steps not committed, for any reason (int32).
        skips: steps not committed by reason, `(len(SKIP_REASONS),)` int32, in the order of
            `fusedpc.execution.SKIP_REASONS`.
        loss_mean: the running mean of committed steps' losses (float32; 0 before any).
        loss_count: how many committed losses the mean has seen (int32).
    """

    steps: jax.Array
    skipped: jax.Array
    skips: jax.Array = None  # type: ignore[assignment]  # filled in by __post_init__
    loss_mean: jax.Array = None  # type: ignore[assignment]
    loss_count: jax.Array = None  # type: ignore[assignment]

    def __post_init__(self):
        # Two-argument Counters(steps, skipped) (release 0.2.0) still build: the guard's
        # fields start empty, and a skipped count without reasons counts as non-finite.
        if self.skips is None:
            skips = jnp.zeros((len(SKIP_REASONS),), jnp.int32)
            self.skips = skips.at[SKIP_REASONS.index("non-finite")].set(
                jnp.asarray(self.skipped, jnp.int32)
            )
        if self.loss_mean is None:
            self.loss_mean = jnp.zeros((), jnp.float32)
        if self.loss_count is None:
            self.loss_count = jnp.zeros((), jnp.int32)


def fresh_counters() -> Counters:
    """Zeroed counters, as `StepProgram.init` makes them."""
    # Separate buffers: a carry is donated leaf by leaf.
    return Counters(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


class StepCarry(eqx.Module):
    """What one step reads and writes: the tree's state and the step counters.

    Attributes:
        state: the state pytree of the tree (one named `eqx.Module` per part).
        counters: a `Counters` of int32 scalars (steps attempted, steps skipped).
    """

    state: PyTree
    counters: Counters


class StepMetrics(eqx.Module):
    """Everything one step reports.

    Attributes:
        loss: the loss (the masked mean with a mask; NaN without a loss).
        committed: whether the new state was kept.
        parts: the parts' metrics tree (keyed like the state tree).
        state_finite: one boolean per leaf of the step's new state (before the guard chose
            between new and old), so that a non-finite value outside every part's update and
            input error (an optimiser's moment estimate, say) can still be named.
        skip_reason: int32, 0 when committed, else 1 + the index in `SKIP_REASONS` of the
            rule that refused the step.
        input_checks: the in-program `IdRangeCheck`s of the step's inputs and targets.
        mask_check: the in-program `MaskCheck` of the step's row mask (None without one).
        loss_mean: the running mean loss the loss guard compared this step's loss with.
        reported: whether the parts' report norms were computed (False for `run`'s steps
            between reports, whose `parts` norms are NaN: see `StepProgram.run`).
        relaxation: the whole-tree relaxation's report (`RelaxationReport`: the energy
            before and after, its trajectory, the distance from the backprop step) for a
            tree with `fusedpc.Latent` parts; None otherwise.
        packed: `parts` and `state_finite` as stored (a `fusedpc.core.Packed`, one vector
            per dtype); `parts` and `state_finite` are properties that rebuild the trees.
    """

    loss: jax.Array
    committed: jax.Array
    packed: Packed  # `parts` and `state_finite`, one vector per dtype (see `Packed`)
    skip_reason: jax.Array = None  # type: ignore[assignment]
    input_checks: tuple[IdRangeCheck, ...] = ()
    loss_mean: jax.Array = None  # type: ignore[assignment]
    reported: jax.Array = None  # type: ignore[assignment]
    mask_check: MaskCheck | None = None
    relaxation: Any = None

    def __init__(
        self,
        loss: jax.Array,
        committed: jax.Array,
        parts: PyTree,
        state_finite: PyTree = None,
        skip_reason: jax.Array = None,  # type: ignore[assignment]
        input_checks: tuple[IdRangeCheck, ...] = (),
        loss_mean: jax.Array = None,  # type: ignore[assignment]
        reported: jax.Array = None,  # type: ignore[assignment]
        mask_check: MaskCheck | None = None,
        relaxation: Any = None,
    ) -> None:
        self.loss = loss
        self.committed = committed
        # A hundred or more small report values leave the compiled step as a few vectors
        # rather than one output (one kernel XLA compiles) each.
        self.packed = Packed.of((parts, state_finite))
        self.skip_reason = skip_reason
        self.input_checks = input_checks
        self.loss_mean = loss_mean
        self.reported = reported
        self.mask_check = mask_check
        self.relaxation = relaxation

    @property
    def parts(self) -> PyTree:
        """The parts' metrics tree (rebuilt from `packed` when read)."""
        return self.packed.unpack()[0]

    @property
    def state_finite(self) -> PyTree:
        """One boolean per leaf of the new state (rebuilt from `packed` when read)."""
        return self.packed.unpack()[1]


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
