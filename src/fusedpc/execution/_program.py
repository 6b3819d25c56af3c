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

import contextlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core import losses as _losses
from fusedpc.core._checks import IdRangeCheck, check_part, id_range_check
from fusedpc.core._error_scale import error_scaled_by
from fusedpc.core._gradients import clip_gradients, collect_gradient_squares
from fusedpc.core._metrics import (
    PartMetrics,
    all_finite,
    detailed_reports,
    measured_together,
    metric_leaves,
    metrics_finite,
    resolve_pending,
    sums_finite,
    sums_finite_vector,
)
from fusedpc.core._packed import Packed
from fusedpc.core._part import AbstractPart, Core, PyTree
from fusedpc.core._precision import computing_in, resolve_compute_dtype, widened
from fusedpc.execution._validation import mask_problem

NONFINITE_POLICIES = ("skip", "raise", "ignore")
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


def copy_tree(tree: PyTree) -> PyTree:
    """A fresh copy of every array leaf (so donation of the original never reaches it)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array | np.ndarray) else a, tree
    )


def normalise_active(error: jax.Array) -> jax.Array:
    """Scale $E$ by rows / active rows; a row is active when any entry is non-zero.

    $E \\leftarrow E \\cdot R / \\max(A, 1)$, with $R$ rows (all leading axes flattened) and $A$ the
    rows with a non-zero entry: zero rows are taken for padding. Opt-in only
    (`error_normalisation="active"`): a real row whose error is exactly zero (a ReLU or binary
    head that fits it, a saturated sigmoid) is mistaken for padding, and a padding row whose
    target was set to the prediction keeps a rounding of error inside a fused step. Say
    padding with a row mask instead (`step(carry, x, target, mask)`).
    """
    rows = error.reshape(-1, error.shape[-1])
    active = jnp.sum(jnp.any(rows != 0, axis=-1).astype(error.dtype))
    return error * (rows.shape[0] / jnp.maximum(active, 1.0))


def apply_row_mask(error: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The error of a masked step and the row weights: $E_r \\leftarrow E_r\\, w_r R / \\sum w$.

    Every part takes row means, so the step then follows exactly the gradient of the masked
    mean loss $\\sum_r w_r \\ell_r / \\sum_r w_r$ over the $R$ rows; a row of weight 0
    contributes nothing (its error is set to 0, whatever it was). `mask` has the output's
    shape without its last axis (booleans, or non-negative weights)."""
    if tuple(jnp.shape(mask)) != tuple(error.shape[:-1]):
        raise ValueError(
            f"mask: expected shape {tuple(error.shape[:-1])} (the output's shape without its "
            f"last axis: one weight per row), got {tuple(jnp.shape(mask))}."
        )
    if not (
        jnp.issubdtype(jnp.result_type(mask), jnp.number)
        or jnp.issubdtype(jnp.result_type(mask), jnp.bool_)
    ):
        raise TypeError(f"mask: expected booleans or numbers, got dtype {jnp.result_type(mask)}.")
    weights = jnp.asarray(mask).astype(error.dtype)
    rows = weights.size
    scale = weights * (rows / jnp.sum(weights))
    return jnp.where((weights > 0)[..., None], error * scale[..., None], 0.0), weights


def pad_rows(
    rows: int, *arrays: Any, axis: int = 0
) -> tuple[Any, ...]:
    """Pad a short batch to `rows` rows and say which rows are real.

    `pad_rows(64, x, target)` returns `(x, target, mask)`: each array extended along `axis`
    with zeros to `rows` entries, and a boolean `mask` of shape `(rows,)` (True for the real
    rows) to pass as `step(x, target, mask=mask)`. For a GPT batch `(B, T)` the mask is
    `(B, T)`-shaped: broadcast it with `np.broadcast_to(mask[:, None], (rows, T))`.
    Host (numpy) arrays in, numpy arrays out: a last partial batch keeps the step's shapes,
    so it compiles nothing new.
    """
    if not arrays:
        raise ValueError("pad_rows: pass at least one array to pad.")
    length = int(np.shape(arrays[0])[axis])
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer) or rows < length:
        raise ValueError(
            f"rows: expected an integer >= the batch's {length} rows (axis {axis}), got {rows!r}."
        )
    padded = []
    for i, array in enumerate(arrays):
        host = np.asarray(array)
        if host.shape[axis] != length:
            raise ValueError(
                f"arrays[{i}]: expected {length} rows on axis {axis} (as arrays[0]), got shape "
                f"{host.shape}."
            )
        widths = [(0, 0)] * host.ndim
        widths[axis] = (0, rows - length)
        padded.append(np.pad(host, widths))
    mask = np.arange(rows) < length
    return (*padded, mask)


def max_update_ratio(parts: PyTree) -> jax.Array:
    """The largest update / weight norm ratio over every learning part (the report's
    `update_ratio`); 0 without learning parts. A part with zero weights counts as infinite
    when it moved and as 0 when it did not."""
    ratios = []
    for m in metric_leaves(parts):
        if isinstance(m, PartMetrics):
            update, weight = m.update_norm, m.weight_norm
            safe = jnp.where(weight > 0, weight, 1.0)
            ratio = jnp.where(weight > 0, update / safe, jnp.where(update > 0, jnp.inf, 0.0))
            ratios.append(jnp.max(ratio))
    if not ratios:
        return jnp.zeros((), jnp.float32)
    return jnp.max(jnp.stack(ratios))


def scan_steps(
    step: Callable,
    carry: Any,
    xs: Any,
    targets: Any,
    keep_outputs: bool = True,
    masks: Any = None,
    report_at: Any = None,
) -> tuple[Any, StepOutput]:
    """K applications of `step(carry, x, target, mask, detailed) -> (carry, StepOutput)` in
    one `lax.scan` over the leading axis of `xs`, `targets` (and `masks`); outputs and
    metrics stacked over K. With `report_at` (K booleans) each step is traced twice, with
    and without its report norms, and `lax.cond` runs the one that step asks for."""

    def trim(out: StepOutput) -> StepOutput:
        return out if keep_outputs else StepOutput(None, None, out.metrics)

    def body(c, batch):
        if report_at is None:
            c, out = step(c, *batch)
            return c, trim(out)
        *batch, flag = batch
        mask = batch[2] if len(batch) == 3 else None

        def detailed(operands):
            c_, b_ = operands
            new, out = step(c_, b_[0], b_[1], mask, detailed=True)
            return new, trim(out)

        def light(operands):
            c_, b_ = operands
            new, out = step(c_, b_[0], b_[1], mask, detailed=False)
            return new, trim(out)

        return jax.lax.cond(flag, detailed, light, (c, tuple(batch[:2])))

    batches: tuple = (xs, targets) if masks is None else (xs, targets, masks)
    if report_at is not None:
        batches = (*batches, jnp.asarray(report_at, bool))
    return jax.lax.scan(body, carry, batches)


class StepProgram:
    """The training step of one part tree as pure functions over an explicit `StepCarry`.

    Made by `fusedpc.make_step`. Nothing here holds arrays or state: every method is a pure
    function of its arguments, so it can be jitted (with `donate_argnums=0` to write the new
    state into the old buffers), scanned, vmapped or differentiated like any JAX function.

    Attributes:
        tree: the root part the program was compiled from.
        core: the tree's `Core` (`tree.compile("")`).
        error_fn: the resolved `fusedpc.losses.ErrorFunction`.
        error_normalisation: `"rows"` or `"active"`.
        nonfinite: `"skip"`, `"raise"` or `"ignore"` (inside the program `"raise"` acts as
            `"skip"`; raising is the host wrapper's business).
        max_update_ratio: the spike guard's bound on any part's update / weight norm, or None.
        loss_spike: the loss guard's factor over the running mean loss, or None.
        clip_global_norm: the bound of global gradient-norm clipping, or None.
        compute_dtype: `"bfloat16"` when activations and matrix products run in bfloat16,
            None for float32.
    """

    def __init__(
        self,
        tree: AbstractPart,
        core: Core,
        error_fn: _losses.ErrorFunction,
        error_normalisation: str,
        nonfinite: str,
        max_update_ratio: float | None = None,
        loss_spike: float | None = None,
        clip_global_norm: float | None = None,
        compute_dtype: str | None = None,
    ):
        self.tree = tree
        self.compute_dtype = compute_dtype
        self.clip_global_norm = clip_global_norm
        self.core = core
        self.error_fn = error_fn
        self.error_normalisation = error_normalisation
        self.nonfinite = nonfinite
        self.max_update_ratio = max_update_ratio
        self.loss_spike = loss_spike

    def __repr__(self) -> str:
        guards = "".join(
            f", {name}={value!r}"
            for name, value in (
                ("max_update_ratio", self.max_update_ratio),
                ("loss_spike", self.loss_spike),
                ("clip_global_norm", self.clip_global_norm),
                ("compute_dtype", self.compute_dtype),
            )
            if value is not None
        )
        return (
            f"StepProgram(tree={type(self.tree).__name__}, error_fn={self.error_fn.name!r}, "
            f"error_normalisation={self.error_normalisation!r}, nonfinite={self.nonfinite!r}"
            f"{guards})"
        )

    def init(self, key: jax.Array) -> StepCarry:
        """The initial carry: the tree's state from `key` (copied, so that donating it never
        reaches the arrays held by the part objects) and zeroed counters."""
        return StepCarry(state=copy_tree(self.tree.init_state(key)), counters=fresh_counters())

    def input_checks(self, x: Any, target: Any, width: int) -> tuple[IdRangeCheck, ...]:
        """The in-program checks of a batch: the tree's own (token ids, ...) and, for a
        class-id error function with integer targets, the targets against `[0, width)`."""
        checks = tuple(self.tree.input_checks(x, ""))
        if self.error_fn.class_ids and jnp.issubdtype(jnp.result_type(target), jnp.integer):
            checks += (id_range_check(target, width, "", "class ids", "target"),)
        return checks

    def _loss(self, y: Any, target: Any, weights: jax.Array | None) -> jax.Array:
        fn = self.error_fn
        if weights is not None:
            if fn.row_loss is None:
                return jnp.full((), jnp.nan, jnp.float32)
            rows = fn.row_loss(y, target).astype(jnp.float32)
            w = weights.astype(jnp.float32)
            return jnp.sum(w * rows) / jnp.sum(w)
        if fn.loss is None:
            return jnp.full((), jnp.nan, jnp.float32)
        return fn.loss(y, target).astype(jnp.float32)

    def step(
        self, carry: StepCarry, x: Any, target: Any, mask: Any = None, detailed: bool = True
    ) -> tuple[StepCarry, StepOutput]:
        """One training step: returns the new carry and the step's `StepOutput`.

        Args:
            carry: the current `StepCarry`.
            x: a batch `(rows..., features)` (or token ids `(batch, seq)` for a GPT).
            target: what `error_fn(output, target)` compares the output with.
            mask: optional row weights `(rows...)` (the output's shape without its last
                axis; booleans or non-negative numbers): padding rows get 0 and contribute
                nothing, and every mean (the parts' updates, the loss) runs over the real
                rows, exactly as a masked mean loss under backprop. Rows must still be
                finite (zeros are fine). `None` weighs every row alike.
            detailed: whether the parts compute their report norms (`True`); `False` leaves
                them NaN ("not measured", `metrics.reported` false) and saves their
                reductions. The commit rule is the same either way: the norms of every
                state leaf (parameters and optimiser moments alike), the output, the input
                error and the loss must be finite. A step with `max_update_ratio` set always
                computes its norms (the guard reads them).

        The step is committed unless, in this order: an input id lies outside its range
        (`"id out of range"`); a weight of `mask` is negative or not finite, or none is
        positive (`"invalid mask"`); anything is not representable (`"non-finite"`: a NaN or an
        infinity in the new state, the output, the input error or the loss, or a part's
        update, weight or error norm that overflows float32); a part's update / weight ratio
        exceeds `max_update_ratio` (`"update ratio"`); the loss exceeds `loss_spike` times
        the running mean of committed losses (`"loss spike"`). A refused step keeps the old
        state bit for bit and counts in `counters.skipped` and `counters.skips`.
        """
        state, counters = carry.state, carry.counters
        y, cache = self._forward(state, x)
        checks = self.input_checks(x, target, int(jnp.shape(y)[-1]))
        error = self.error_fn.error(y, target)
        weights = None
        mask_ok, checked_mask = jnp.array(True), None
        scaled: Any = contextlib.nullcontext()
        if mask is not None:
            error, weights = apply_row_mask(error, mask)
            checked_mask = mask_check(weights)
            mask_ok = checked_mask.ok
            # what the mask scaled every real row by, for parts not linear in their error
            scaled = error_scaled_by(weights.size / jnp.sum(weights))
        elif self.error_normalisation == "active":
            error = normalise_active(error)
        detailed = bool(detailed) or self.max_update_ratio is not None
        with detailed_reports(detailed), scaled, measured_together() as measured:
            input_error, new_state, part_metrics = self._backward(state, cache, error)
        loss = self._loss(y, target, weights)

        ids_ok = jnp.stack([c.ok for c in checks]).all() if checks else jnp.array(True)
        # One flag per state leaf (kept in the metrics to name a bad leaf), then one rule for
        # all: the same flags name the part in reports. The state's sums of squares are taken
        # with the parts' report norms (a part's new weights are state leaves: measured once),
        # and so is the output error's (the last part's `error_norm`). Every norm is taken
        # without overflow: entries of 1e20 have a finite norm, and a representable state
        # passes (a float32 sum of squares overflows from entries of ~1.8e19).
        state_slots = measured.add_each(new_state)
        error_slot = measured.add(error)
        norms = measured.norms()
        state_flags = sums_finite_vector(state_slots, norms.norms)  # the rule reads it whole
        state_finite = sums_finite(state_slots, norms.norms, state_flags)
        part_metrics = resolve_pending(part_metrics, measured, norms)
        finite_flags = [
            jnp.all(state_flags),
            all_finite((y, input_error)),
            metrics_finite(part_metrics),  # each part's own flag: its norms overflowing count
            jnp.isfinite(norms.norms[error_slot]),
        ]
        known = self.error_fn.loss if weights is None else self.error_fn.row_loss
        if known is not None:  # a placeholder NaN (no loss) is not a failure
            finite_flags.append(jnp.isfinite(loss))
        finite = jnp.stack(finite_flags).all()
        if self.nonfinite == "ignore":
            finite = jnp.array(True)
        ratio_ok = jnp.array(True)
        if self.max_update_ratio is not None:
            ratio_ok = max_update_ratio(part_metrics) <= self.max_update_ratio
        spike_ok = jnp.array(True)
        if self.loss_spike is not None:
            guarding = counters.loss_count >= LOSS_SPIKE_WARMUP
            spike_ok = ~(guarding & (loss > self.loss_spike * counters.loss_mean))
        code = jnp.int32(0)
        rules = (ids_ok, mask_ok, finite, ratio_ok, spike_ok)  # in SKIP_REASONS' order
        for number, ok in reversed(list(enumerate(rules, 1))):
            code = jnp.where(ok, code, jnp.int32(number))
        committed = code == 0
        new_state = jax.tree_util.tree_map(
            lambda n, o: jnp.where(committed, n, o), new_state, state
        )
        counters = self._count(counters, code, loss)
        metrics = StepMetrics(
            loss=loss,
            committed=committed,
            parts=part_metrics,
            state_finite=state_finite,
            skip_reason=code,
            input_checks=checks,
            loss_mean=carry.counters.loss_mean,
            reported=jnp.array(detailed),
            mask_check=checked_mask,
        )
        return StepCarry(new_state, counters), StepOutput(y, input_error, metrics)

    def _forward(self, state: PyTree, x: Any) -> tuple[Any, PyTree]:
        """The forward walk in the compute dtype; the output handed back in float32."""
        with computing_in(self.compute_dtype):
            y, cache = self.core.forward(state, x)
        if self.compute_dtype is not None:
            y = jax.tree_util.tree_map(widened, y)
        return y, cache

    def _backward(self, state: PyTree, cache: PyTree, error: jax.Array):
        """The backward walk in the compute dtype (the input error handed back in float32);
        see `_walk_backward`."""
        with computing_in(self.compute_dtype):
            input_error, new_state, metrics = self._walk_backward(state, cache, error)
        if self.compute_dtype is not None:
            input_error = jax.tree_util.tree_map(widened, input_error)
        return input_error, new_state, metrics

    def _walk_backward(self, state: PyTree, cache: PyTree, error: jax.Array):
        """The backward walk; with `clip_global_norm`, twice: once to read every optax
        part's gradient norm (its updates discarded, so the compiler drops them), then with
        every gradient clipped by the global norm, as `optax.clip_by_global_norm` clips the
        whole gradient tree of a backprop step. Input errors are the same either way: they
        use the old weights."""
        if self.clip_global_norm is None:
            return self.core.backward(state, cache, error)
        # the first walk's reports are dropped: gathered apart, never measured
        with collect_gradient_squares() as squares, measured_together():
            self.core.backward(state, cache, error)
        total = sum(squares, jnp.zeros((), jnp.float32))
        norm = jnp.sqrt(total)
        with clip_gradients(norm, self.clip_global_norm):
            return self.core.backward(state, cache, error)

    @staticmethod
    def _count(counters: Counters, code: jax.Array, loss: jax.Array) -> Counters:
        committed = code == 0
        reasons = jnp.arange(1, len(SKIP_REASONS) + 1, dtype=jnp.int32)
        seen = committed & jnp.isfinite(loss)
        count = counters.loss_count + seen.astype(jnp.int32)
        rate = 1.0 / jnp.minimum(count, LOSS_MEAN_HORIZON).astype(jnp.float32)
        mean = jnp.where(counters.loss_count == 0, loss, counters.loss_mean)
        mean = jnp.where(seen, mean + (loss - mean) * rate, counters.loss_mean)
        return Counters(
            steps=counters.steps + 1,
            skipped=counters.skipped + (~committed).astype(jnp.int32),
            skips=counters.skips + (reasons == code).astype(jnp.int32),
            loss_mean=mean,
            loss_count=count,
        )

    def run(
        self,
        carry: StepCarry,
        xs: Any,
        targets: Any,
        keep_outputs: bool = True,
        masks: Any = None,
        report_at: Any = None,
    ) -> tuple[StepCarry, StepOutput]:
        """K steps in one `lax.scan` over the leading axis of `xs`, `targets` (and `masks`,
        `(K, rows...)`); equal to K calls of `step`. With `keep_outputs=False` the outputs
        and input errors are dropped (`None`) and only the stacked metrics are kept.

        `report_at` (optional, K booleans, an array of the call like `xs`: changing it does
        not retrace) says which steps compute their parts' report norms; the others are
        `step(..., detailed=False)`: the same update, the same commit rule, every loss, and
        NaN norms. `None` reports every step."""
        return scan_steps(
            self.step, carry, xs, targets, keep_outputs, masks, self.report_flags(report_at)
        )

    def report_flags(self, report_at: Any) -> Any:
        """The per-step report flags `run` traces with: `None` (every step reports, one step
        body) when `max_update_ratio` is set, since its guard reads every step's norms."""
        return None if self.max_update_ratio is not None else report_at

    def predict(self, state: PyTree, x: Any) -> Any:
        """The forward walk only: the tree's output for `x` under `state`. Out-of-range token
        ids give NaN rows (see `checked_predict` for the flag)."""
        return self._forward(state, x)[0]

    def checked_predict(self, state: PyTree, x: Any) -> tuple[Any, tuple[IdRangeCheck, ...]]:
        """`predict` with the in-program checks of `x` (token ids in range, ...): read
        `all(c.ok for c in checks)` when you need to know, which costs one scalar read."""
        return self._forward(state, x)[0], tuple(self.tree.input_checks(x, ""))

    def write_back(self, state: PyTree) -> AbstractPart:
        """The tree holding `state` (pass a copy if the state's buffers will be donated)."""
        return self.core.write_back(state)


def _check_bound(name: str, value: Any, low: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{name}: expected None or a number, got {type(value).__name__}.")
    value = float(value)
    if not (np.isfinite(value) and value > low):
        raise ValueError(f"{name}: expected None or a finite number > {low:g}, got {value!r}.")
    return value


def make_step(
    tree: AbstractPart,
    error_fn: _losses.ErrorFunction | str | Callable | None = None,
    error_normalisation: str = "rows",
    *,
    nonfinite: str = "skip",
    max_update_ratio: float | None = None,
    loss_spike: float | None = None,
    clip_global_norm: float | None = None,
    compute_dtype: Any = None,
) -> StepProgram:
    """Compile a part tree into its pure training step.

    Args:
        tree: the root part.
        error_fn: the descent error at the output: `None` (squared error, $y - t$), a name from
            `fusedpc.losses` (`"softmax_cross_entropy"`, `"cross_entropy"`, ...), an
            `ErrorFunction`, or a callable `error_fn(output, target) -> error`.
        error_normalisation: `"rows"` (the default) leaves the error as `error_fn` formed
            it; say padding with the step's `mask`. `"active"` (opt-in) rescales it by rows
            / rows with a non-zero error, taking exact-zero rows for padding, which is wrong
            for rows that a head fits exactly (see `normalise_active`).
        nonfinite: `"skip"` (or `"raise"`) keeps the old state when anything of the step is
            not representable (NaN, infinity, a norm overflowing float32) and counts the step
            as skipped; `"ignore"` commits it anyway.
        max_update_ratio: refuse a step in which any learning part's update / weight norm
            ratio (the report's `update_ratio`) exceeds this bound (`None`: no bound).
        loss_spike: refuse a step whose loss exceeds this factor times the running mean of
            committed losses (`None`: no guard); it guards from the 10th committed step on.
        clip_global_norm: clip every optax-driven part's gradient by the **global** norm over
            all of them, $g \\leftarrow g \\cdot$ `c` $/ \\max(\\lVert g \\rVert, $ `c` $)$,
            before its optimiser, exactly as `optax.clip_by_global_norm(c)` chained before
            the optimiser of a backprop step (`None`: no clipping). Parts that do not learn
            through optax (`synaptic_uncertainty`, parts of your own) are neither counted nor
            clipped. The backward walk is traced twice; the compiler shares what the two have
            in common except inside scanned blocks.
        compute_dtype: `None` or `"float32"` (the default: everything in float32), or
            `"bfloat16"`: activations, caches, errors between parts and the operands of
            matrix products in bfloat16, products accumulated in float32; parameters,
            optimiser states, weight gradients, LayerNorm and softmax statistics, the norms
            and the loss in float32. Parts read it through `fusedpc.core.to_compute` and
            `fusedpc.core.matmul` (a part of your own that does not computes in float32).

    Returns:
        A `StepProgram` with pure `init(key)`, `step(carry, x, target, mask)`,
        `run(carry, xs, targets, keep_outputs, masks)` and `predict(state, x)`.
    """
    check_part(tree, "make_step(tree)")
    if error_normalisation not in NORMALISATIONS:
        raise ValueError(
            f"error_normalisation: expected one of {NORMALISATIONS}, got "
            f"{error_normalisation!r}."
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite: expected one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
    resolved = _losses.resolve(error_fn)
    loss_spike = _check_bound("loss_spike", loss_spike, 1.0)
    if loss_spike is not None and resolved.loss is None:
        raise ValueError(
            f"loss_spike: needs a loss, and error_fn {resolved.name!r} has none; pass an "
            "ErrorFunction with a loss or leave loss_spike=None."
        )
    return StepProgram(
        tree,
        tree.compile(""),
        resolved,
        error_normalisation,
        nonfinite,
        _check_bound("max_update_ratio", max_update_ratio, 0.0),
        loss_spike,
        _check_bound("clip_global_norm", clip_global_norm, 0.0),
        resolve_compute_dtype(compute_dtype),
    )


__all__ = [
    "LOSS_MEAN_HORIZON",
    "LOSS_SPIKE_WARMUP",
    "SKIP_REASONS",
    "Counters",
    "MaskCheck",
    "StepCarry",
    "StepMetrics",
    "StepOutput",
    "StepProgram",
    "copy_tree",
    "apply_row_mask",
    "fresh_counters",
    "make_step",
    "max_update_ratio",
    "normalise_active",
    "scan_steps",
]
