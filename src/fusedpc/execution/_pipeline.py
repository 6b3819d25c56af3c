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
from fusedpc.core._metrics import report_rows
from fusedpc.core._part import PyTree
from fusedpc.execution import _report, _sharding, _validation
from fusedpc.execution._program import (
    NONFINITE_POLICIES,
    NORMALISATIONS,
    Counters,
    StepCarry,
    StepMetrics,
    StepOutput,
    StepProgram,
    copy_tree,
    make_step,
    normalise_active,
    scan_steps,
)


class NonFiniteStepError(FloatingPointError):
    """Raised (policy `"raise"`) when a step produced NaN or infinity; names the part."""


class FusedPipeline:
    """Trains a tree of parts; every step is one compiled XLA program with its state donated.

    Args:
        tree: the root part.
        error_fn: the descent error at the output, as for `fusedpc.make_step`.
        error_normalisation: `"active"` or `"rows"`, as for `fusedpc.make_step`.
        key: PRNG key for the parts' initial state (default `jax.random.key(0)`).
        nonfinite: what a step whose new state, output or input error holds NaN/inf does:
            `"skip"` keeps the old state (inside the program) and counts the step as skipped;
            `"raise"` does the same and raises `NonFiniteStepError` at the next call;
            `"ignore"` commits it anyway.
        mesh: a `jax.sharding.Mesh` with a `"data"` axis (e.g. `fusedpc.data_mesh()`): batches
            are sharded over it and the state replicated, so every row mean becomes a
            cross-device reduction inserted by the compiler. Its axes are used as `Auto`.
        state_sharding: with a mesh, an optional rule `(path, leaf) -> PartitionSpec | None`
            placing state leaves (e.g. `fusedpc.shard_widest(mesh)` over a `"model"` axis);
            `None` replicates. The state keeps these shardings after every step.
        check_device_ids: value checks of inputs (token ids inside the vocabulary) run on host
            arrays always; on arrays already on the device only when True, since reading
            them back costs a device-to-host transfer per call.

    Only the state is donated: after `step`, arrays previously read from `pipeline.state` are
    dead; the caller's batch and the part objects the pipeline was built from stay valid.
    """

    def __init__(
        self,
        tree: Any,
        error_fn: _losses.ErrorFunction | str | Callable | None = None,
        error_normalisation: str = "active",
        *,
        key: jax.Array | None = None,
        nonfinite: str = "skip",
        mesh: jax.sharding.Mesh | None = None,
        state_sharding: _sharding.StateSharding | None = None,
        check_device_ids: bool = False,
    ):
        check_part(tree, "FusedPipeline(tree)")
        self.tree = tree
        self.program: StepProgram = make_step(
            tree, error_fn, error_normalisation, nonfinite=nonfinite
        )
        self.error_fn = self.program.error_fn
        self.error_normalisation = error_normalisation
        self.nonfinite = nonfinite
        self.mesh = _sharding.resolve_mesh(mesh)
        self.state_sharding = state_sharding
        if state_sharding is not None and self.mesh is None:
            raise ValueError("state_sharding: needs a mesh; pass mesh=fusedpc.data_mesh(...).")
        self.check_device_ids = bool(check_device_ids)
        key = jax.random.key(0) if key is None else key
        # init copies: the part objects' own arrays must survive the first donated step.
        self._carry = self._place_carry(self.program.init(key))
        self._last: StepMetrics | None = None
        self._pending: StepMetrics | None = None
        self._outputs: dict = {}  # batch signature -> the output's shape, from the one trace
        self._traced_output: jax.ShapeDtypeStruct | None = None
        self.trace_counts = {"step": 0, "run": 0, "predict": 0}
        # With a mesh, pin the carry's shardings (the state leaves as placed) so that the
        # donated buffers come back in place; outputs and metrics are left to propagation.
        pinned: dict[str, Any] = {}
        if self.mesh is not None:
            carry = jax.tree_util.tree_map(lambda a: a.sharding, self._carry)
            pinned = {"out_shardings": (carry, None)}
        self._step_jit = jax.jit(self._step_program, donate_argnums=(0,), **pinned)
        self._run_jit = jax.jit(
            self._run_program, donate_argnums=(0,), static_argnames=("keep_outputs",), **pinned
        )
        self._predict_jit = jax.jit(self._predict_program)

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
    def _recording_step(self, carry: StepCarry, x: Any, target: Any):
        carry, out = self.program.step(carry, x, target)
        self._traced_output = jax.ShapeDtypeStruct(jnp.shape(out.output), out.output.dtype)
        return carry, out

    def _step_program(self, carry, x, target):
        result = self._recording_step(carry, x, target)
        self.trace_counts["step"] += 1  # counted once the trace succeeded
        return result

    def _run_program(self, carry, xs, targets, keep_outputs=True):
        result = scan_steps(self._recording_step, carry, xs, targets, keep_outputs)
        self.trace_counts["run"] += 1
        return result

    def _predict_program(self, state, x):
        result = self.program.predict(state, x)
        self.trace_counts["predict"] += 1
        return result

    # ------------------------------------------------------------------ checks
    def _check_pending(self) -> None:
        """Policy `"raise"`: raise for a previous step that was not finite."""
        if self.nonfinite != "raise" or self._pending is None:
            return
        pending, self._pending = self._pending, None
        committed = np.asarray(pending.committed).reshape(-1)
        if not committed.all():
            bad = int(np.argmin(committed))
            raise NonFiniteStepError(
                f"step {bad} of the last call produced a non-finite value first in part "
                f"{_report.first_nonfinite(pending, bad)!r}; the state was kept as it was "
                "before that step. Lower that part's learning rate or check its inputs."
            )

    def check(self, x: Any, target: Any) -> jax.ShapeDtypeStruct:
        """Check the tree against a batch by tracing the step (nothing is compiled or run).

        Raises an error naming the part path, the expected and the actual shape, on width or
        rank mismatches; returns the output's shape and dtype. The trace is the one the
        compiled step needs: a `step` with this batch's shapes does not trace again.
        """
        x_shape = jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        t_shape = jax.ShapeDtypeStruct(jnp.shape(target), jnp.result_type(target))
        signature = _validation.signature(x, target, batched=False)
        return self._traced(self._step_jit, signature, self._carry, x_shape, t_shape)

    def _validate_values(self, x: Any) -> None:
        if isinstance(x, jax.Array) and not self.check_device_ids:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        self.tree.validate_input(x, "")

    def _validate(self, x: Any, target: Any, batched: bool) -> None:
        """Host checks that need no trace: arrays, rows, values (and `run`'s step axis, which
        its scan needs). A step's row axis is checked after the trace (`_check_rows`): the
        tree's own checks come first, they say more."""
        x_name, t_name = ("xs", "targets") if batched else ("x", "target")
        _validation.check_array(x, x_name)
        _validation.check_array(target, t_name)
        _validation.check_non_empty(x, x_name)
        self._validate_values(x)
        if batched:
            _validation.check_batch_rank(x, x_name, batched)
            _validation.check_same_steps(x, target)

    def _traced(self, jitted, signature: tuple, *args, **kwargs) -> jax.ShapeDtypeStruct:
        """The output shape for a batch signature, tracing the program once when new.

        The trace raises the parts' shape errors (naming their paths) before anything is
        compiled or donated; the call that follows reuses it (JAX caches traces). Every use
        of the jitted programs (step, run, check, compiled_step) comes through here first, so
        a new signature is always a fresh trace, which records the output's shape."""
        if signature not in self._outputs:
            self._traced_output = None  # never another signature's shape
            jitted.trace(*args, **kwargs)
            self._outputs[signature] = self._traced_output
        return self._outputs[signature]

    # ------------------------------------------------------------------ public API
    def step(self, x: Any, target: Any) -> tuple[jax.Array, Any]:
        """One training step, one compiled call. Returns `(output, input_error)`."""
        self._check_pending()
        self._validate(x, target, batched=False)
        x, target_placed = self.place_batch(x), self.place_batch(target)
        signature = _validation.signature(x, target, batched=False)
        out = self._traced(self._step_jit, signature, self._carry, x, target_placed)
        _validation.check_batch_rank(x, "x", batched=False)
        _validation.check_class_ids(
            self.error_fn, target, out.shape[-1], "target", self.check_device_ids
        )
        self._carry, result = self._step_jit(self._carry, x, target_placed)
        self._last = self._pending = result.metrics
        return result.output, result.input_error

    def run(
        self, xs: Any, targets: Any, *, keep_outputs: bool = True
    ) -> tuple[Any, Any, StepMetrics]:
        """K steps in one compiled call (`lax.scan` over the leading axis of `xs`/`targets`).

        Equal to K calls of `step`. Returns stacked `(outputs, input_errors, metrics)`;
        with `keep_outputs=False` the outputs and input errors are not kept (`None`), which
        saves their memory when only the losses and reports are wanted.
        """
        self._check_pending()
        self._validate(xs, targets, batched=True)
        xs, targets_placed = self.place_batch(xs, axis=1), self.place_batch(targets, axis=1)
        signature = (*_validation.signature(xs, targets, batched=True), keep_outputs)
        out = self._traced(
            self._run_jit, signature, self._carry, xs, targets_placed, keep_outputs=keep_outputs
        )
        _validation.check_class_ids(
            self.error_fn, targets, out.shape[-1], "targets", self.check_device_ids
        )
        self._carry, result = self._run_jit(
            self._carry, xs, targets_placed, keep_outputs=keep_outputs
        )
        self._last = self._pending = result.metrics
        return result.output, result.input_error, result.metrics

    def compiled_step(self, x: Any, target: Any) -> jax.stages.Compiled:
        """The compiled step program for this batch's shapes, as `step` runs it (state
        donated, shardings pinned): for `memory_analysis()`, `cost_analysis()` or
        `as_text()`. Runs nothing; served from the compilation cache after a `step`."""
        self._validate(x, target, batched=False)
        x, target = self.place_batch(x), self.place_batch(target)
        signature = _validation.signature(x, target, batched=False)
        self._traced(self._step_jit, signature, self._carry, x, target)
        return self._step_jit.lower(self._carry, x, target).compile()

    def predict(self, x: Any) -> jax.Array:
        """Forward only; never donates and leaves the state untouched."""
        _validation.check_array(x, "x")
        _validation.check_non_empty(x, "x")
        self._validate_values(x)
        return self._predict_jit(self._carry.state, self.place_batch(x))

    @property
    def carry(self) -> StepCarry:
        """The current carry (state and counters) as `program.step` takes it: live buffers,
        donated (hence dead) at the next step."""
        return self._carry

    @property
    def state(self) -> PyTree:
        """The current state pytree (live buffers: donated, hence dead, at the next step)."""
        return self._carry.state

    @property
    def steps(self) -> int:
        """Steps attempted so far (committed or skipped)."""
        return int(self._carry.counters.steps)

    @property
    def skipped_steps(self) -> int:
        """Steps not committed because they produced a non-finite value."""
        return int(self._carry.counters.skipped)

    @property
    def last_loss(self) -> float | None:
        """The loss of the last step (the last inner step of `run`), or None before any."""
        if self._last is None:
            return None
        return float(np.asarray(self._last.loss).reshape(-1)[-1])

    @property
    def last_metrics(self) -> StepMetrics | None:
        """The last call's metrics (stacked over K for `run`), still on device."""
        return self._last

    def merge(self) -> Any:
        """The tree with the current state written back, holding copies (safe to keep)."""
        return self.program.write_back(copy_tree(self._carry.state))

    def set_state(self, state: PyTree, steps: int = 0, skipped: int = 0) -> None:
        """Replace the state (e.g. from a checkpoint); its structure, shapes and dtypes must
        match the current one exactly."""
        current = self._carry.state
        expected = jax.tree_util.tree_structure(current)
        actual = jax.tree_util.tree_structure(state)
        if expected != actual:  # type: ignore[operator]  # PyTreeDef's stub lacks __ne__
            raise ValueError(
                f"set_state: the state's tree structure differs from this pipeline's.\n"
                f"expected: {expected}\nactual:   {actual}"
            )
        for (path, old), new in zip(
            jax.tree_util.tree_leaves_with_path(current), jax.tree_util.tree_leaves(state)
        ):
            if jnp.shape(old) != jnp.shape(new) or jnp.result_type(old) != jnp.result_type(new):
                raise ValueError(
                    f"set_state: leaf {jax.tree_util.keystr(path)} expected "
                    f"{jnp.result_type(old)}{list(jnp.shape(old))}, got "
                    f"{jnp.result_type(new)}{list(jnp.shape(new))}."
                )
        counters = Counters(
            steps=jnp.asarray(steps, jnp.int32), skipped=jnp.asarray(skipped, jnp.int32)
        )
        self._carry = self._place_carry(StepCarry(copy_tree(state), counters))
        self._last = None
        self._pending = None

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

    # ------------------------------------------------------------------ reports
    def report(self, index: int = -1) -> list[dict[str, Any]]:
        """One row per learning part for the last step (the `index`-th inner step of `run`).

        Each row: `part` (its path in the tree), `layer_sizes`, `update_norm`, `error_norm`,
        `weight_norm`, `update_ratio` (update / weight norm, the number to calibrate a part's
        learning rate by) and `finite`. Empty before the first step.
        """
        if self._last is None:
            return []
        chosen = _report.select_step(jax.device_get(self._last), index)
        return report_rows(chosen.parts)

    def nonfinite_part(self, index: int = -1) -> str | None:
        """The part where the last step's non-finite value first appeared (backward order),
        or None when the step was finite."""
        if self._last is None:
            return None
        chosen = _report.select_step(self._last, index)
        if bool(np.asarray(chosen.committed)) and self.nonfinite != "ignore":
            return None
        return _report.first_nonfinite(self._last, index)


__all__ = [
    "FusedPipeline",
    "NonFiniteStepError",
    "StepMetrics",
    "StepOutput",
    # the unfused baseline imports these from here
    "NORMALISATIONS",
    "NONFINITE_POLICIES",
    "copy_tree",
    "normalise_active",
]
