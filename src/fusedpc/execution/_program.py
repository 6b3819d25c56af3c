"""The pure step program: `make_step(tree, ...)` gives `init`, `step`, `run`, `predict` (and
`infer` with latents) over an explicit carry, usable in a user's `jit`, `scan` or `vmap`.

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

import jax
import jax.numpy as jnp

from fusedpc._deprecation import warn_deprecated
from fusedpc.core import losses as _losses
from fusedpc.core._checks import IdRangeCheck, check_part, id_range_check
from fusedpc.core._context import StepContext, row_mask_scale
from fusedpc.core._gradients import GradientHook
from fusedpc.core._measured import Measured, resolve_pending
from fusedpc.core._metrics import metrics_finite
from fusedpc.core._norms import all_finite, sums_finite, sums_finite_vector
from fusedpc.core._part import AbstractPart, Core, PyTree
from fusedpc.core._precision import widened
from fusedpc.execution._inference import Inference, infer
from fusedpc.execution._rows import apply_row_mask, copy_tree, normalise_active
from fusedpc.execution._scan import max_update_ratio, scan_steps
from fusedpc.execution._step_settings import StepSettings, settings_property
from fusedpc.execution._step_types import (
    LOSS_MEAN_HORIZON,
    LOSS_SPIKE_WARMUP,
    NORMALISATIONS,
    SKIP_REASONS,
    Counters,
    StepCarry,
    StepMetrics,
    StepOutput,
    fresh_counters,
    mask_check,
)
from fusedpc.execution._tree_relaxation import (
    Relaxation,
    TreeRelaxation,
    check_tolerance,
    resolve_relaxation,
    row_weight,
)


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
        derived: programs compiled from this one, by name (`generate`'s samplers).
        settings: the `StepSettings` (guards and compute dtype; inside the program
            `nonfinite="raise"` acts as `"skip"`: raising is the host wrapper's business),
            also read one by one as `nonfinite`, `max_update_ratio`, `loss_spike`,
            `clip_global_norm` and `compute_dtype`.
    """

    def __init__(
        self,
        tree: AbstractPart,
        core: Core,
        error_fn: _losses.ErrorFunction,
        error_normalisation: str,
        settings: StepSettings | str | None = None,
        *legacy: Any,
        relaxation: Relaxation | None = None,
    ):
        if isinstance(settings, str):  # release 0.3: nonfinite and four guards positionally
            warn_deprecated(
                "StepProgram(tree, core, error_fn, error_normalisation, nonfinite, "
                "max_update_ratio, ...) is deprecated: pass one fusedpc.StepSettings")
            names = ("max_update_ratio", "loss_spike", "clip_global_norm", "compute_dtype")
            settings = StepSettings(settings, **dict(zip(names, legacy)))
        elif legacy:
            raise TypeError(f"StepProgram: {len(legacy)} arguments after the settings.")
        self.tree = tree
        self.core = core
        self.error_fn = error_fn
        self.error_normalisation = error_normalisation
        self.settings = StepSettings() if settings is None else settings
        self.relaxation = relaxation
        self._tree = None if relaxation is None else TreeRelaxation(
            core, relaxation, error_fn.error, error_fn.loss)
        # programs compiled from this one (`fusedpc.transformer.generate`'s samplers), kept
        # with it and dropped with it
        self.derived: dict[str, Any] = {}

    # the settings one by one, read-only
    nonfinite = settings_property("nonfinite")
    max_update_ratio = settings_property("max_update_ratio")
    loss_spike = settings_property("loss_spike")
    clip_global_norm = settings_property("clip_global_norm")
    compute_dtype = settings_property("compute_dtype")

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
        ctx = StepContext(compute_dtype=self.compute_dtype)
        y, top, cache, relaxed = self._forward_walks(state, x, target, ctx, mask)
        checks = self.input_checks(x, target, int(jnp.shape(y)[-1]))
        error, weights, checked_mask = self._output_error(top, target, mask)
        detailed = bool(detailed) or self.max_update_ratio is not None
        measured = Measured()
        ctx = ctx.replace(detailed=detailed, measured=measured,
                          error_scale=None if weights is None else row_mask_scale(weights))
        walk_state = state if relaxed is None else self._relaxing.learning_state(
            relaxed.tree_state, relaxed, None if weights is None else row_weight(weights))
        input_error, new_state, part_metrics = self._backward(walk_state, cache, error, ctx)
        loss = self._loss(y, target, weights)
        # One flag per state leaf, then one rule for all (the same flags name the part in
        # reports); the state's and the output error's sums of squares are taken with the
        # parts' report norms, each without overflow (entries of 1e20 have a finite norm).
        state_slots = measured.add_each(new_state)
        error_slot = measured.add(error)
        norms = measured.norms()
        state_flags = sums_finite_vector(state_slots, norms.norms)  # the rule reads it whole
        part_metrics = resolve_pending(part_metrics, measured, norms)
        finite = self._finite(loss, weights, [
            jnp.all(state_flags),
            all_finite((y, input_error)),
            metrics_finite(part_metrics),  # each part's own flag: its norms overflowing count
            jnp.isfinite(norms.norms[error_slot]),
        ])
        mask_ok = jnp.array(True) if checked_mask is None else checked_mask.ok
        code = self._skip_code(checks, mask_ok, finite, part_metrics, counters, loss)
        committed = code == 0
        relaxation = None if relaxed is None else self._relaxing.report(
            relaxed, part_metrics, top, target, new_state, self._backprop_twin(
                state, relaxed, y, target, mask, ctx), state)
        new_state = jax.tree_util.tree_map(
            lambda n, o: jnp.where(committed, n, o), new_state, state
        )
        metrics = StepMetrics(
            loss=loss,
            committed=committed,
            parts=part_metrics,
            state_finite=sums_finite(state_slots, norms.norms, state_flags),
            skip_reason=code,
            input_checks=checks,
            loss_mean=counters.loss_mean,
            reported=jnp.array(detailed),
            mask_check=checked_mask,
            relaxation=relaxation,
        )
        counters = self._count(counters, code, loss)
        return StepCarry(new_state, counters), StepOutput(y, input_error, metrics)

    @property
    def _relaxing(self) -> TreeRelaxation:
        """The tree's relaxation (only read for a tree with latents)."""
        if self._tree is None:
            raise AssertionError("StepProgram: a relaxation was asked of a tree without one.")
        return self._tree

    def _forward_walks(self, state: PyTree, x: Any, target: Any, ctx: StepContext,
                       mask: Any = None):
        """The step's forward: `(output, top, cache, relaxed)`. Without latents the forward
        walk (`top` is the output); with them the relaxation (`relaxed`), the feed-forward
        readout as the output and the learning walk's forward (its output `top`)."""
        if self._tree is None:
            y, cache = self._forward(state, x, ctx)
            return y, y, cache, None
        if mask is not None and self._tree.settings.incremental:
            raise ValueError(
                "mask: an incremental relaxation learns at every sweep from errors that a "
                "mask would scale row by row, moving each row's latents by its weight; "
                "train on the real rows alone, or use Relaxation(incremental=False).")
        relaxed = self._tree.relax(state, x, target, ctx, learn=self._backward)
        top, cache = self._tree.learning_forward(relaxed.tree_state, x, relaxed, ctx)
        return relaxed.output, top, cache, relaxed

    def _backprop_twin(self, state: PyTree, relaxed: Any, y: Any, target: Any, mask: Any,
                       ctx: StepContext) -> PyTree | None:
        """The new state of the exact (backprop) step from the same forward, when the
        relaxation reports its distance from it (else None)."""
        if self.relaxation is None or not self.relaxation.backprop_distance:
            return None
        error = self._output_error(y, target, mask)[0]
        plain = ctx.for_inner_trace().replace(detailed=False)
        return self._backward(state, relaxed.first_cache, error, plain)[1]

    def _output_error(self, y: Any, target: Any, mask: Any):
        """The descent error at the output, the row weights of `mask` (or None) and their
        check (or None): with a mask the error of row $r$ is scaled by $w_r R / \\sum w$."""
        error = self.error_fn.error(y, target)
        if mask is not None:
            error, weights = apply_row_mask(error, mask)
            return error, weights, mask_check(weights)
        if self.error_normalisation == "active":
            error = normalise_active(error)
        return error, None, None

    def _finite(self, loss: jax.Array, weights: Any, flags: list[jax.Array]) -> jax.Array:
        """The `"non-finite"` rule: every flag, and the loss where the error function has
        one (a placeholder NaN, no loss, is not a failure); true under `nonfinite="ignore"`."""
        known = self.error_fn.loss if weights is None else self.error_fn.row_loss
        if known is not None:
            flags = [*flags, jnp.isfinite(loss)]
        if self.nonfinite == "ignore":
            return jnp.array(True)
        return jnp.stack(flags).all()

    def _skip_code(self, checks: tuple[IdRangeCheck, ...], mask_ok: jax.Array,
                   finite: jax.Array, part_metrics: PyTree, counters: Counters,
                   loss: jax.Array) -> jax.Array:
        """0 to commit, else 1 + the index in `SKIP_REASONS` of the first rule that refuses."""
        ids_ok = jnp.stack([c.ok for c in checks]).all() if checks else jnp.array(True)
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
        return code

    def _forward(self, state: PyTree, x: Any, ctx: StepContext) -> tuple[Any, PyTree]:
        """The forward walk in the compute dtype; the output handed back in float32."""
        y, cache = self.core.forward(state, x, ctx)
        if self.compute_dtype is not None:
            y = jax.tree_util.tree_map(widened, y)
        return y, cache

    def _backward(self, state: PyTree, cache: PyTree, error: jax.Array, ctx: StepContext):
        """The backward walk in the compute dtype (the input error handed back in float32);
        see `_walk_backward`."""
        input_error, new_state, metrics = self._walk_backward(state, cache, error, ctx)
        if self.compute_dtype is not None:
            input_error = jax.tree_util.tree_map(widened, input_error)
        return input_error, new_state, metrics

    def _walk_backward(self, state: PyTree, cache: PyTree, error: jax.Array,
                       ctx: StepContext):
        """The backward walk; with `clip_global_norm`, twice: once to read every optax
        part's gradient norm (its updates discarded, so the compiler drops them), then with
        every gradient clipped by the global norm, as `optax.clip_by_global_norm` clips the
        whole gradient tree of a backprop step. Input errors are the same either way: they
        use the old weights."""
        if self.clip_global_norm is None:
            return self.core.backward(state, cache, error, ctx)
        # the first walk's reports are dropped: gathered apart, never measured
        squares: list[jax.Array] = []
        self.core.backward(state, cache, error, ctx.replace(
            gradients=GradientHook(squares=squares), measured=Measured()))
        norm = jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))
        hook = GradientHook(clip_norm=norm, max_norm=self.clip_global_norm)
        return self.core.backward(state, cache, error, ctx.replace(gradients=hook))

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
        return self._forward(state, x, StepContext(compute_dtype=self.compute_dtype))[0]

    def checked_predict(self, state: PyTree, x: Any) -> tuple[Any, tuple[IdRangeCheck, ...]]:
        """`predict` with the in-program checks of `x` (token ids in range, ...): read
        `all(c.ok for c in checks)` when you need to know, which costs one scalar read."""
        y = self._forward(state, x, StepContext(compute_dtype=self.compute_dtype))[0]
        return y, tuple(self.tree.input_checks(x, ""))

    def infer(self, state: PyTree, x: Any, target: Any) -> Inference:
        """The step's relaxation towards `target` with nothing learning: the relaxed latents
        and the output at them (`fusedpc.execution.Inference`); needs latents in the tree."""
        if self._tree is None:
            raise ValueError("infer: the tree has no fusedpc.Latent to relax; place Latent() "
                             "parts where inference should move the activities.")
        return infer(self._tree, state, x, target, StepContext(compute_dtype=self.compute_dtype))

    def write_back(self, state: PyTree) -> AbstractPart:
        """The tree holding `state` (pass a copy if the state's buffers will be donated)."""
        return self.core.write_back(state)


def make_step(
    tree: AbstractPart,
    error_fn: _losses.ErrorFunction | str | Callable | None = None,
    error_normalisation: str = "rows",
    *,
    settings: StepSettings | None = None,
    nonfinite: str | None = None,
    max_update_ratio: float | None = None,
    loss_spike: float | None = None,
    clip_global_norm: float | None = None,
    compute_dtype: Any = None,
    relaxation: Relaxation | None = None,
) -> StepProgram:
    """Compile a part tree into its pure training step.

    The guards and the compute dtype are one `fusedpc.StepSettings` (`settings=`), or, as
    a shortcut, its fields as keywords (not both).

    Args:
        tree: the root part.
        error_fn: the descent error at the output: `None` (squared error, $y - t$), a name from
            `fusedpc.losses` (`"softmax_cross_entropy"`, `"cross_entropy"`, ...), an
            `ErrorFunction`, or a callable `error_fn(output, target) -> error`.
        error_normalisation: `"rows"` (the default) leaves the error as `error_fn` formed
            it; say padding with the step's `mask`. `"active"` (opt-in) rescales it by rows
            / rows with a non-zero error, taking exact-zero rows for padding, which is wrong
            for rows that a head fits exactly (see `normalise_active`).
        settings: the step's guards and compute dtype (`fusedpc.StepSettings`); the
            keywords below are its fields (None: the field's default).
        nonfinite: `"skip"` (the default; or `"raise"`) keeps the old state when anything of
            the step is not representable (NaN, infinity, a norm overflowing float32) and
            counts the step as skipped; `"ignore"` commits it anyway.
        max_update_ratio: refuse a step in which any learning part's update / weight norm
            ratio (the report's `update_ratio`) exceeds this bound (`None`: no bound).
        loss_spike: refuse a step whose loss exceeds this factor times the running mean of
            committed losses (`None`: no guard); it guards from the 10th committed step on.
        clip_global_norm: clip every optax-driven part's gradient by the **global** norm over
            all of them, $g \\leftarrow g \\cdot$ `c` $/ \\max(\\lVert g \\rVert, $ `c` $)$,
            before its optimiser, exactly as `optax.clip_by_global_norm(c)` chained before
            the optimiser of a backprop step (`None`: no clipping). It reaches every part that
            steps through `ctx.optimiser_step` (every optax-driven part, and parts of your own
            that use it); the `synaptic_uncertainty` rule is neither counted nor clipped. The
            backward walk is traced twice; the compiler shares what the two have in common
            except inside scanned blocks.
        compute_dtype: `None` or `"float32"` (the default: everything in float32), or
            `"bfloat16"`: activations, caches, errors between parts and the operands of
            matrix products in bfloat16, products accumulated in float32; parameters,
            optimiser states, weight gradients, LayerNorm and softmax statistics, the norms
            and the loss in float32. Parts read it from the step context (`ctx.to_compute`,
            `ctx.matmul`; a part of your own that does not computes in float32).
        relaxation: how the tree's `fusedpc.Latent` parts relax on the one energy of the
            tree (`fusedpc.Relaxation`: sweeps, rate or optax optimiser, fixed prediction,
            reports); a tree with latents and `None` relaxes with `Relaxation()`. A tree
            without latents refuses one (it has nothing to relax).

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
    settings = StepSettings.of(settings, nonfinite=nonfinite, max_update_ratio=max_update_ratio,
                               loss_spike=loss_spike, clip_global_norm=clip_global_norm,
                               compute_dtype=compute_dtype)
    resolved = _losses.resolve(error_fn)
    if settings.loss_spike is not None and resolved.loss is None:
        raise ValueError(
            f"loss_spike: needs a loss, and error_fn {resolved.name!r} has none; pass an "
            "ErrorFunction with a loss or leave loss_spike=None."
        )
    relaxation = resolve_relaxation(tree, relaxation, error_normalisation)
    check_tolerance(relaxation, resolved.loss, resolved.name)
    return StepProgram(tree, tree.compile(""), resolved, error_normalisation, settings,
                       relaxation=relaxation)


__all__ = ["StepProgram", "make_step", "max_update_ratio", "scan_steps"]
