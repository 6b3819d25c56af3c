"""The fused executor: the whole training step of a part tree as one compiled XLA program.

`FusedPipeline` is the host-side wrapper of the pure step (`fusedpc.make_step`): it places
the state and the batches (meshes), jits the step with the state donated, checks host batches
before anything is compiled or donated, keeps the counters, raises for non-finite steps on
request, and turns the last step's metrics into reports and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core import losses as _losses
from fusedpc.core._checks import check_part
from fusedpc.core._part import PyTree
from fusedpc.execution import _report, _sharding, _validation
from fusedpc.execution._dispatch import (
    Flat,
    Traced,
    WithOutputShape,
    collection_paused,
    report_flags,
    shape_of,
)
from fusedpc.execution._program import (
    StepProgram,
    make_step,
    scan_steps,
)
from fusedpc.execution._readout import PipelineReadout
from fusedpc.execution._rows import (
    copy_tree,
)
from fusedpc.execution._step_settings import StepSettings
from fusedpc.execution._step_types import (
    SKIP_REASONS,
    Counters,
    StepCarry,
    StepMetrics,
    StepOutput,
)


class NonFiniteStepError(FloatingPointError):
    """Raised (policy `"raise"`) when a step produced NaN or infinity; names the part."""


class InputRangeError(ValueError):
    """Raised (policy `"raise"`) when a step's ids (token ids, class ids) were out of range,
    or its row mask was invalid (a negative or non-finite weight, or no weight at all);
    names the argument, the value and the range."""


class FusedPipeline(PipelineReadout):
    """Trains a tree of parts; every step is one compiled XLA program with its state donated.

    Args:
        tree: the root part.
        error_fn: the descent error at the output, as for `fusedpc.make_step`.
        error_normalisation: `"rows"` (default) or `"active"` (opt-in), as for
            `fusedpc.make_step`; say padding with `step(..., mask=...)`.
        key: PRNG key for the parts' initial state (default `jax.random.key(0)`).
        settings: the step's guards and compute dtype as one `fusedpc.StepSettings`; the
            five keywords below are its fields, a shortcut for it (not both).
        nonfinite: what a step whose new state, output or input error holds NaN/inf does:
            `"skip"` keeps the old state (inside the program) and counts the step as skipped;
            `"raise"` does the same and raises `NonFiniteStepError` at the next call;
            `"ignore"` commits it anyway. A norm that overflows float32 counts as infinite.
            An out-of-range id always refuses the step; under `"raise"` the next call raises
            `InputRangeError`.
        max_update_ratio: the spike guard: refuse (inside the program) a step in which any
            learning part's update / weight norm ratio exceeds this bound. None: no bound.
        loss_spike: refuse a step whose loss exceeds this factor (> 1) times the running
            mean of committed losses, from the 10th committed step on. None: no guard.
        clip_global_norm: global gradient-norm clipping over every part that learns through
            optax, as `optax.clip_by_global_norm` in a backprop step (`fusedpc.make_step`).
        compute_dtype: `"bfloat16"` runs activations and matrix products in bfloat16 with
            float32 parameters, optimiser states, norms and loss (`fusedpc.make_step`);
            None (float32) by default. Outputs and input errors come back in float32.
        mesh: a `jax.sharding.Mesh` with a `"data"` axis (e.g. `fusedpc.data_mesh()`): batches
            are sharded over it and the state replicated, so every row mean becomes a
            cross-device reduction inserted by the compiler. Its axes are used as `Auto`.
        state_sharding: with a mesh, an optional rule `(path, leaf) -> PartitionSpec | None`
            placing state leaves (e.g. `fusedpc.shard_widest(mesh)` over a `"model"` axis);
            `None` replicates. The state keeps these shardings after every step.
        check_device_ids: ids (token ids, class-id targets) are checked inside the compiled
            step always (an out-of-range id refuses the step, no host round trip) and on
            host arrays before the call. With True, device arrays are read back and checked
            before the call too (a device-to-host transfer per call), `predict`'s included.
        relaxation: how a tree with `fusedpc.Latent` parts relaxes them on the tree's one
            energy (`fusedpc.Relaxation`; `Relaxation()` for a tree with latents when None),
            as for `fusedpc.make_step`; `report()` then ends with its `<relaxation>` row.

    Only the state is donated: after `step`, arrays previously read from `pipeline.state` are
    dead; the caller's batch and the part objects the pipeline was built from stay valid.
    """

    def __init__(
        self,
        tree: Any,
        error_fn: _losses.ErrorFunction | str | Callable | None = None,
        error_normalisation: str = "rows",
        *,
        key: jax.Array | None = None,
        settings: StepSettings | None = None,
        nonfinite: str | None = None,
        max_update_ratio: float | None = None,
        loss_spike: float | None = None,
        clip_global_norm: float | None = None,
        compute_dtype: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        state_sharding: _sharding.StateSharding | None = None,
        check_device_ids: bool = False,
        relaxation: Any = None,
    ):
        check_part(tree, "FusedPipeline(tree)")
        self.tree = tree
        settings = StepSettings.of(
            settings, nonfinite=nonfinite, max_update_ratio=max_update_ratio,
            loss_spike=loss_spike, clip_global_norm=clip_global_norm, compute_dtype=compute_dtype)
        self.program: StepProgram = make_step(tree, error_fn, error_normalisation,
                                              settings=settings, relaxation=relaxation)
        self.relaxation = self.program.relaxation
        self.settings = settings
        self.compute_dtype = settings.compute_dtype
        self.max_update_ratio = settings.max_update_ratio
        self.loss_spike = settings.loss_spike
        self.error_fn = self.program.error_fn
        self.error_normalisation = error_normalisation
        self.nonfinite = settings.nonfinite
        self.mesh = _sharding.resolve_mesh(mesh)
        self.state_sharding = state_sharding
        if state_sharding is not None and self.mesh is None:
            raise ValueError("state_sharding: needs a mesh; pass mesh=fusedpc.data_mesh(...).")
        self.check_device_ids = bool(check_device_ids)
        key = jax.random.key(0) if key is None else key
        # init copies: the part objects' own arrays must survive the first donated step.
        self._carry = self._place_carry(self.program.init(key))
        self._last_flat: Flat | None = None  # the last call's metrics, as leaves
        self._last_stacked = False
        self._pending_flat: Flat | None = None
        self._outputs: dict = {}  # batch signature -> the output's shape, from the one trace
        self._compiled: set = set()  # (program, batch signature) called once (so compiled)
        self.trace_counts = {"step": 0, "run": 0, "predict": 0}
        # With a mesh, pin the carry's shardings (the state leaves as placed) so that the
        # donated buffers come back in place; outputs and metrics are left to propagation.
        # The compiled programs take and give the carry as its flat list of leaves (and the
        # metrics likewise): rebuilding the equinox modules of a tree on the host costs more
        # than a small step's compute (measured in docs/benchmarks.md), so the trees are
        # rebuilt only when read (`carry`, `state`, `last_metrics`, `report`, ...).
        pinned: dict[str, Any] = {}
        if self.mesh is not None:
            carry = [a.sharding for a in self._carry_flat.leaves]
            pinned = {"out_shardings": (carry, None, None, None)}
        self._step_jit = jax.jit(self._flat_step_program, donate_argnums=(0,),
                                 static_argnames=("detailed",), **pinned)
        self._run_jit = jax.jit(
            self._flat_run_program, donate_argnums=(0,), static_argnames=("keep_outputs",),
            **pinned,
        )
        self._predict_jit = jax.jit(self._predict_program)

    # ------------------------------------------------------------------ flat storage
    @property
    def _carry(self) -> StepCarry:
        return self._carry_flat.tree

    @_carry.setter
    def _carry(self, carry: StepCarry) -> None:
        self._carry_flat = Flat.of(carry)

    @property
    def _last(self) -> StepMetrics | None:
        return None if self._last_flat is None else self._last_flat.tree

    # ------------------------------------------------------------------ placement
    def _place_carry(self, carry: StepCarry) -> StepCarry:
        if self.mesh is None:
            return carry
        return StepCarry(
            state=jax.device_put(
                carry.state,
                _sharding.state_shardings(carry.state, self.mesh, self.state_sharding),
            ),
            counters=jax.device_put(
                carry.counters, _sharding.state_shardings(carry.counters, self.mesh, None)
            ),
        )

    def place_batch(self, x: Any, axis: int = 0) -> Any:
        """`x` placed as the step expects it: sharded over the mesh's data axis along `axis`
        (rows; axis 1 for `run`'s stacked batches), or unchanged without a mesh."""
        return _sharding.shard_batch(x, self.mesh, axis)

    # ------------------------------------------------------------------ programs
    def _step_program(self, carry, x, target, mask=None, detailed=True):
        result = self.program.step(carry, x, target, mask, detailed)
        self.trace_counts["step"] += 1  # counted once the trace succeeded
        return result

    def _flat_step_program(self, leaves, x, target, mask=None, detailed=True):
        carry, out = self._step_program(self._carry_flat.rebuild(leaves), x, target, mask,
                                        detailed)
        return self._flat_result(carry, out, shape_of(out.output))

    def _flat_run_program(self, leaves, xs, targets, masks=None, report_at=None,
                          keep_outputs=True):
        carry, out = self._run_program(
            self._carry_flat.rebuild(leaves), xs, targets, masks, report_at, keep_outputs
        )
        shaped = out.metrics  # a WithOutputShape: one step's output shape, kept by the scan
        out = StepOutput(out.output, out.input_error, shaped.metrics)
        return self._flat_result(carry, out, shaped.output)

    def _flat_result(self, carry: StepCarry, out: StepOutput,
                     output: jax.ShapeDtypeStruct):
        """`(carry leaves, output, input error, metrics)`: the metrics as a `_Traced` node
        whose static data carry their structure and one step's output shape, which the
        trace of a new signature reads off the program's outputs (`_traced`)."""
        metrics_leaves, structure = jax.tree_util.tree_flatten(out.metrics)
        return (jax.tree_util.tree_leaves(carry), out.output, out.input_error,
                Traced(metrics_leaves, structure, output))

    def _shaped_step(self, carry, x, target, mask=None, detailed=True):
        """`program.step` with its output's shape carried in its metrics (`run`'s scan)."""
        carry, out = self.program.step(carry, x, target, mask, detailed)
        shaped = WithOutputShape(out.metrics, shape_of(out.output))
        return carry, StepOutput(out.output, out.input_error, shaped)

    def _run_program(self, carry, xs, targets, masks=None, report_at=None, keep_outputs=True):
        result = scan_steps(
            self._shaped_step, carry, xs, targets, keep_outputs, masks,
            self.program.report_flags(report_at),
        )
        self.trace_counts["run"] += 1
        return result

    def _predict_program(self, state, x):
        result = self.program.predict(state, x)
        self.trace_counts["predict"] += 1
        return result


    # ------------------------------------------------------------------ checks
    def _check_pending(self) -> None:
        """Policy `"raise"`: raise for a previous step that was not finite."""
        if self.nonfinite != "raise" or self._pending_flat is None:
            return
        pending = self._pending_flat.tree
        self._pending_flat = None
        codes = np.asarray(pending.skip_reason).reshape(-1)
        raising = [SKIP_REASONS.index(r) + 1 for r in ("id out of range", "invalid mask",
                                                       "non-finite")]
        bad_steps = np.flatnonzero(np.isin(codes, raising))
        if not bad_steps.size:
            return
        bad = int(bad_steps[0])
        skip = _report.skip_reason(pending, bad, stacked=self._last_stacked)
        assert skip is not None
        if skip.reason.endswith("out of range") or skip.reason == "invalid mask":
            raise InputRangeError(
                f"step {bad} of the last call was not committed: {skip.message} The state was "
                "kept as it was before that step."
            )
        raise NonFiniteStepError(
            f"step {bad} of the last call produced a non-finite value first in part "
            f"{skip.part!r}; the state was kept as it was before that step. "
            f"{_report.nonfinite_advice(pending, bad)}"
        )

    def check(self, x: Any, target: Any) -> jax.ShapeDtypeStruct:
        """Check the tree against a batch by tracing the step (nothing is compiled or run).

        Raises an error naming the part path, the expected and the actual shape, on width or
        rank mismatches; returns the output's shape and dtype. The trace is the one the
        compiled step needs: a `step` with this batch's shapes does not trace again.
        """
        x_shape = jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        t_shape = jax.ShapeDtypeStruct(jnp.shape(target), jnp.result_type(target))
        signature = (*_validation.signature(x, target, batched=False), None)
        return self._traced(
            self._step_jit, signature, self._carry_flat.leaves, x_shape, t_shape, None
        )

    def _validate_values(self, x: Any) -> None:
        if isinstance(x, jax.Array) and not self.check_device_ids:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        # through the class: an equinox module's bound method is itself a module, built
        # anew at every attribute access (about a millisecond for a GPT, every step)
        type(self.tree).validate_input(self.tree, x, "")

    def _validate(self, x: Any, target: Any, batched: bool, mask: Any = None) -> None:
        """Host checks that need no trace: arrays, rows, values (and `run`'s step axis, which
        its scan needs). A step's row axis is checked after the trace (`_check_rows`): the
        tree's own checks come first, they say more."""
        x_name, t_name = ("xs", "targets") if batched else ("x", "target")
        _validation.check_array(x, x_name)
        _validation.check_array(target, t_name)
        _validation.check_non_empty(x, x_name)
        self._validate_values(x)
        if mask is not None:
            _validation.check_mask(mask, "masks" if batched else "mask", batched)
        if batched:
            _validation.check_batch_rank(x, x_name, batched)
            _validation.check_same_steps(x, target)
            if mask is not None:
                _validation.check_same_steps(x, mask, "masks")

    def _traced(self, jitted, signature: tuple, *args, **kwargs) -> jax.ShapeDtypeStruct:
        """The output shape for a batch signature, tracing the program once when new.

        The trace raises the parts' shape errors (naming their paths) before anything is
        compiled or donated; the call that follows reuses it (JAX caches traces). Every use
        of the jitted programs (step, run, check, compiled_step) comes through here first, so
        a new signature is always a fresh trace, which records the output's shape."""
        if signature not in self._outputs:
            with collection_paused():
                traced = jitted.trace(*args, **kwargs)
            facts = traced.out_info[3]
            self._outputs[signature] = facts.output
        return self._outputs[signature]

    # ------------------------------------------------------------------ public API
    def step(self, x: Any, target: Any, mask: Any = None, *,
             report: bool = True) -> tuple[jax.Array, Any]:
        """One training step, one compiled call. Returns `(output, input_error)`.

        `mask` (optional, the output's shape without its last axis): row weights, 0 for
        padding rows; the step then follows the masked mean loss exactly (see
        `StepProgram.step`). `report=False` skips the parts' report norms (the same update,
        commit rule and loss; `report()` then shows NaN norms): a second compiled program,
        for steps you will not read the report of (`report=(i % 10 == 0)`)."""
        self._check_pending()
        self._validate(x, target, batched=False, mask=mask)
        x, target_placed = self.place_batch(x), self.place_batch(target)
        mask_placed = None if mask is None else self.place_batch(mask)
        signature = (
            *_validation.signature(x, target, batched=False),
            _validation.mask_signature(mask),
        )
        out = self._traced(
            self._step_jit, signature, self._carry_flat.leaves, x, target_placed, mask_placed
        )
        _validation.check_batch_rank(x, "x", batched=False)
        _validation.check_class_ids(
            self.error_fn, target, out.shape[-1], "target", self.check_device_ids
        )
        report = bool(report)  # passed only when False: the trace above has the default
        with collection_paused(("step", signature, report) not in self._compiled):
            leaves, output, input_error, metrics = self._step_jit(
                self._carry_flat.leaves, x, target_placed, mask_placed,
                **({} if report else {"detailed": False}),
            )
        self._compiled.add(("step", signature, report))
        self._carry_flat = self._carry_flat.replaced(leaves)
        self._last_flat = self._pending_flat = Flat(metrics.structure, metrics.leaves)
        self._last_stacked = False
        return output, input_error

    def run(
        self,
        xs: Any,
        targets: Any,
        *,
        masks: Any = None,
        keep_outputs: bool = True,
        report_every: int | None = None,
        report_at: Any = None,
    ) -> tuple[Any, Any, StepMetrics]:
        """K steps in one compiled call (`lax.scan` over the leading axis of `xs`/`targets`
        and `masks`, `(K, rows...)`, if given).

        Equal to K calls of `step`. Returns stacked `(outputs, input_errors, metrics)`;
        with `keep_outputs=False` the outputs and input errors are not kept (`None`), which
        saves their memory when only the losses and reports are wanted.

        Report cadence: `report_every=n` computes the parts' report norms on every n-th
        inner step and the last one only; `report_at` (K booleans) names the steps
        directly (the last always reports). The other steps have the same update, commit
        rule and loss, and NaN norms (`metrics.reported` false; `report(index=...)` refuses
        them). Which steps report is data, not a new program: changing it does not
        recompile. With `max_update_ratio` set every step reports (the guard reads them).
        """
        self._check_pending()
        self._validate(xs, targets, batched=True, mask=masks)
        report_at = report_flags(np.shape(xs)[0], report_every, report_at)
        xs, targets_placed = self.place_batch(xs, axis=1), self.place_batch(targets, axis=1)
        masks_placed = None if masks is None else self.place_batch(masks, axis=1)
        signature = (
            *_validation.signature(xs, targets, batched=True),
            _validation.mask_signature(masks),
            keep_outputs,
            report_at is None,
        )
        out = self._traced(
            self._run_jit,
            signature,
            self._carry_flat.leaves,
            xs,
            targets_placed,
            masks_placed,
            report_at,
            keep_outputs=keep_outputs,
        )
        _validation.check_class_ids(
            self.error_fn, targets, out.shape[-1], "targets", self.check_device_ids
        )
        with collection_paused(("run", signature) not in self._compiled):
            leaves, outputs, input_errors, metrics = self._run_jit(
                self._carry_flat.leaves, xs, targets_placed, masks_placed, report_at,
                keep_outputs=keep_outputs,
            )
        self._compiled.add(("run", signature))
        self._carry_flat = self._carry_flat.replaced(leaves)
        self._last_flat = self._pending_flat = Flat(metrics.structure, metrics.leaves)
        self._last_stacked = True
        return outputs, input_errors, self._last_flat.tree

    def compiled_step(self, x: Any, target: Any, mask: Any = None) -> jax.stages.Compiled:
        """The compiled step program for this batch's shapes, as `step` runs it (state
        donated, shardings pinned): for `memory_analysis()`, `cost_analysis()` or
        `as_text()`. Runs nothing; served from the compilation cache after a `step`."""
        self._validate(x, target, batched=False, mask=mask)
        x, target = self.place_batch(x), self.place_batch(target)
        mask = None if mask is None else self.place_batch(mask)
        signature = (
            *_validation.signature(x, target, batched=False),
            _validation.mask_signature(mask),
        )
        leaves = self._carry_flat.leaves
        self._traced(self._step_jit, signature, leaves, x, target, mask)
        return self._step_jit.lower(leaves, x, target, mask).compile()

    def predict(self, x: Any) -> jax.Array:
        """Forward only; never donates and leaves the state untouched.

        Host ids are checked before the call. Device ids out of range give NaN rows (and
        NaN for the rest of their sequence, through attention) at no host round trip; with
        `check_device_ids=True` they are read back and refused before the call (a
        device-to-host transfer). `program.checked_predict` returns the in-program flags
        instead, for a caller who reads them when it needs to."""
        _validation.check_array(x, "x")
        _validation.check_non_empty(x, "x")
        self._validate_values(x)
        return self._predict_jit(self._carry.state, self.place_batch(x))

    def merge(self) -> Any:
        """The tree with the current state written back, holding copies (safe to keep)."""
        return self.program.write_back(copy_tree(self._carry.state))

    def set_state(
        self,
        state: PyTree,
        steps: int = 0,
        skipped: int = 0,
        *,
        counters: Counters | None = None,
    ) -> None:
        """Replace the state (e.g. from a checkpoint); its structure, shapes and dtypes must
        match the current one exactly. `counters` (a whole `Counters`, skip reasons and
        running loss included) replaces `steps` and `skipped` when given."""
        _validation.check_same_state(self._carry.state, state)
        if counters is None:
            counters = Counters(
                steps=jnp.asarray(steps, jnp.int32), skipped=jnp.asarray(skipped, jnp.int32)
            )
        counters = copy_tree(counters)
        self._carry = self._place_carry(StepCarry(copy_tree(state), counters))
        self._last_flat = None
        self._pending_flat = None

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, metadata: dict | None = None) -> None:
        """Write a checkpoint atomically (see `fusedpc.save_checkpoint`)."""
        from fusedpc.execution._checkpoint import save_checkpoint

        save_checkpoint(self, path, metadata)

    def load(self, path: str) -> dict:
        """Load a checkpoint into this pipeline; returns its metadata (see
        `fusedpc.load_checkpoint`). Refused, state untouched, if the trees differ."""
        from fusedpc.execution._checkpoint import load_checkpoint

        return load_checkpoint(self, path)

__all__ = ["FusedPipeline", "InputRangeError", "NonFiniteStepError"]
