"""The fused executor: the whole training step of a part tree as one compiled XLA program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core import losses as _errors
from fusedpc.core._checks import check_part
from fusedpc.core._metrics import FiniteFlag, all_finite, iter_metrics, leaf_finite, report_rows
from fusedpc.core._part import PyTree, display_path
from fusedpc.execution import _sharding

NONFINITE_POLICIES = ("skip", "raise", "ignore")
NORMALISATIONS = ("active", "rows")


class Counters(eqx.Module):
    """Step counters carried (and donated) with the state: attempted and skipped steps."""

    steps: jax.Array
    skipped: jax.Array


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


class NonFiniteStepError(FloatingPointError):
    """Raised (policy `"raise"`) when a step produced NaN or infinity; names the part."""


def copy_tree(tree: PyTree) -> PyTree:
    """A fresh copy of every array leaf (so donation of the original never reaches it)."""
    return jax.tree_util.tree_map(
        lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array | np.ndarray) else a, tree
    )


def _check_array(value: Any, name: str) -> None:
    """Refuse non-arrays (lists, tuples, scalars) at the boundary with an error naming them."""
    if not isinstance(value, jax.Array | np.ndarray):
        raise TypeError(
            f"{name}: expected an array (numpy or jax), got {type(value).__name__}; convert it "
            f"with np.asarray({name})."
        )


def _check_non_empty(value: Any, name: str) -> None:
    """Refuse a batch with no rows: rank 0, or any axis of length 0."""
    shape = tuple(np.shape(value))
    if not shape or 0 in shape:
        raise ValueError(
            f"{name}: expected a non-empty batch, got shape {shape}. Every axis (steps, rows, "
            "sequence, features) must have length >= 1."
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


class FusedPipeline:
    """Trains a tree of parts; every step is one compiled XLA program with its state donated.

    Args:
        tree: the root part.
        error_fn: the descent error at the output: `None` (squared error, $y - t$), a name from
            `fusedpc.losses` (`"softmax_cross_entropy"`, `"cross_entropy"`, ...), an
            `ErrorFunction`, or a callable `error_fn(output, target) -> error`.
        error_normalisation: `"active"` rescales the error by rows / rows with a non-zero error
            (zero rows are padding); `"rows"` leaves it.
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
        error_fn: _errors.ErrorFunction | str | Callable | None = None,
        error_normalisation: str = "active",
        *,
        key: jax.Array | None = None,
        nonfinite: str = "skip",
        mesh: jax.sharding.Mesh | None = None,
        state_sharding: _sharding.StateSharding | None = None,
        check_device_ids: bool = False,
    ):
        check_part(tree, "FusedPipeline(tree)")
        if error_normalisation not in NORMALISATIONS:
            raise ValueError(
                f"error_normalisation: expected one of {NORMALISATIONS}, got "
                f"{error_normalisation!r}."
            )
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite: expected one of {NONFINITE_POLICIES}, got {nonfinite!r}."
            )
        self.tree = tree
        self.error_fn = _errors.resolve(error_fn)
        self.error_normalisation = error_normalisation
        self.nonfinite = nonfinite
        self.mesh = _sharding.resolve_mesh(mesh)
        self.state_sharding = state_sharding
        if state_sharding is not None and self.mesh is None:
            raise ValueError("state_sharding: needs a mesh; pass mesh=fusedpc.data_mesh(...).")
        self.check_device_ids = bool(check_device_ids)
        self._core = tree.compile("")
        key = jax.random.key(0) if key is None else key
        # Copy once: the part objects' own arrays must survive the first donated step.
        self._state = self._place_state(copy_tree(tree.init_state(key)))
        self._counters = self._place_state(
            Counters(steps=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32))
        )
        self._last: StepMetrics | None = None
        self._pending: StepMetrics | None = None
        self._checked: dict = {}  # batch signature -> output shape, checked once
        self.trace_counts = {"step": 0, "run": 0, "predict": 0}
        # With a mesh, pin the carry's shardings (the state leaves as placed) so that the
        # donated buffers come back in place; outputs and metrics are left to propagation.
        pinned = {}
        if self.mesh is not None:
            carry = jax.tree_util.tree_map(
                lambda a: a.sharding, (self._state, self._counters)
            )
            pinned = {"out_shardings": (carry, None, None, None)}
        self._step_jit = jax.jit(self._step_program, donate_argnums=(0,), **pinned)
        self._run_jit = jax.jit(
            self._run_program, donate_argnums=(0,), static_argnames=("keep_outputs",), **pinned
        )
        self._predict_jit = jax.jit(self._predict_program)

    # ------------------------------------------------------------------ placement
    def _place_state(self, tree: PyTree) -> PyTree:
        if self.mesh is None:
            return tree
        rule = None if isinstance(tree, Counters) else self.state_sharding
        return jax.device_put(tree, _sharding.state_shardings(tree, self.mesh, rule))

    def _place_batch(self, x: Any, axis: int = 0) -> Any:
        if self.mesh is None:
            return x
        if not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        _sharding.check_batch_divides(x.shape[axis], self.mesh, axis)
        return jax.device_put(x, _sharding.batch_sharding(self.mesh, x.ndim, axis))

    # ------------------------------------------------------------------ programs
    def _one_step(self, carry, x, target):
        state, counters = carry
        y, cache = self._core.forward(state, x)
        error = self.error_fn.error(y, target)
        if self.error_normalisation == "active":
            error = normalise_active(error)
        input_error, new_state, part_metrics = self._core.backward(state, cache, error)
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
        return (new_state, counters), y, input_error, metrics

    def _step_program(self, carry, x, target):
        self.trace_counts["step"] += 1
        return self._one_step(carry, x, target)

    def _run_program(self, carry, xs, targets, keep_outputs=True):
        self.trace_counts["run"] += 1

        def body(c, batch):
            c, y, e, m = self._one_step(c, *batch)
            return c, ((y, e) if keep_outputs else None, m)

        carry, (outs, metrics) = jax.lax.scan(body, carry, (xs, targets))
        ys, es = outs if keep_outputs else (None, None)
        return carry, ys, es, metrics

    def _predict_program(self, state, x):
        self.trace_counts["predict"] += 1
        return self._core.forward(state, x)[0]

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
                f"{self._first_nonfinite(pending, bad)!r}; the state was kept as it was before "
                "that step. Lower that part's learning rate or check its inputs."
            )

    def check(self, x: Any, target: Any) -> jax.ShapeDtypeStruct:
        """Check the tree against a batch with `jax.eval_shape` (nothing is compiled or run).

        Raises an error naming the part path, the expected and the actual shape, on width or
        rank mismatches; returns the output's shape and dtype.
        """
        x_shape = jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        t_shape = jax.ShapeDtypeStruct(jnp.shape(target), jnp.result_type(target))
        out = jax.eval_shape(self._one_step, (self._state, self._counters), x_shape, t_shape)
        return out[1]

    def _validate_values(self, x: Any) -> None:
        if isinstance(x, jax.Array) and not self.check_device_ids:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        self.tree.validate_input(x, "")

    def _validate_target_ids(self, target: Any, width: int, name: str) -> None:
        """Integer targets of a cross-entropy are class ids: they must lie in `[0, width)`.

        Out-of-range ids would otherwise become all-zero one-hot rows without a word. Host
        arrays are checked always, device arrays only with `check_device_ids` (as inputs)."""
        if not self.error_fn.class_ids:
            return
        if not jnp.issubdtype(jnp.result_type(target), jnp.integer):
            return
        if isinstance(target, jax.Array) and not self.check_device_ids:
            return
        low, high = int(target.min()), int(target.max())
        if low < 0 or high >= width:
            raise ValueError(
                f"{name}: class ids must lie in [0, {width}) (the output's last axis, for "
                f"error_fn {self.error_fn.name!r}), got {low if low < 0 else high}."
            )

    def _validate(self, x: Any, target: Any, batched: bool) -> None:
        x_name, t_name = ("xs", "targets") if batched else ("x", "target")
        _check_array(x, x_name)
        _check_array(target, t_name)
        _check_non_empty(x, x_name)
        self._validate_values(x)  # the tree's own checks first: they say more
        min_rank = 3 if batched else 2
        if np.ndim(x) < min_rank:
            layout = "(steps, rows, ...)" if batched else "(rows, ...)"
            raise ValueError(
                f"{x_name}: expected a batch of shape {layout} (rank >= {min_rank}: a row axis "
                f"before the features), got shape {tuple(np.shape(x))}; add a leading axis "
                f"with x[None] for a single row."
            )
        signature = (
            batched,
            tuple(jnp.shape(x)),
            str(jnp.result_type(x)),
            tuple(jnp.shape(target)),
            str(jnp.result_type(target)),
        )
        if signature not in self._checked:
            if batched:
                if jnp.shape(x)[0] != jnp.shape(target)[0]:
                    raise ValueError(
                        f"run: xs and targets must have the same number of steps on axis 0, "
                        f"got {jnp.shape(x)[0]} and {jnp.shape(target)[0]}."
                    )
                out = self.check(x[0], target[0])
            else:
                out = self.check(x, target)
            self._checked[signature] = out
        out = self._checked[signature]
        self._validate_target_ids(target, out.shape[-1], t_name)

    # ------------------------------------------------------------------ public API
    def step(self, x: Any, target: Any) -> tuple[jax.Array, Any]:
        """One training step, one compiled call. Returns `(output, input_error)`."""
        self._check_pending()
        self._validate(x, target, batched=False)
        carry, y, input_error, metrics = self._step_jit(
            (self._state, self._counters), self._place_batch(x), self._place_batch(target)
        )
        self._state, self._counters = carry
        self._last = metrics
        self._pending = metrics
        return y, input_error

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
        carry, ys, es, metrics = self._run_jit(
            (self._state, self._counters),
            self._place_batch(xs, axis=1),
            self._place_batch(targets, axis=1),
            keep_outputs=keep_outputs,
        )
        self._state, self._counters = carry
        self._last = metrics
        self._pending = metrics
        return ys, es, metrics

    def predict(self, x: Any) -> jax.Array:
        """Forward only; never donates and leaves the state untouched."""
        _check_array(x, "x")
        _check_non_empty(x, "x")
        self._validate_values(x)
        return self._predict_jit(self._state, self._place_batch(x))

    @property
    def state(self) -> PyTree:
        """The current state pytree (live buffers: donated, hence dead, at the next step)."""
        return self._state

    @property
    def steps(self) -> int:
        """Steps attempted so far (committed or skipped)."""
        return int(self._counters.steps)

    @property
    def skipped_steps(self) -> int:
        """Steps not committed because they produced a non-finite value."""
        return int(self._counters.skipped)

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
        return self._core.write_back(copy_tree(self._state))

    def set_state(self, state: PyTree, steps: int = 0, skipped: int = 0) -> None:
        """Replace the state (e.g. from a checkpoint); its structure, shapes and dtypes must
        match the current one exactly."""
        expected = jax.tree_util.tree_structure(self._state)
        actual = jax.tree_util.tree_structure(state)
        if expected != actual:
            raise ValueError(
                f"set_state: the state's tree structure differs from this pipeline's.\n"
                f"expected: {expected}\nactual:   {actual}"
            )
        for (path, old), new in zip(
            jax.tree_util.tree_leaves_with_path(self._state), jax.tree_util.tree_leaves(state)
        ):
            if jnp.shape(old) != jnp.shape(new) or jnp.result_type(old) != jnp.result_type(new):
                raise ValueError(
                    f"set_state: leaf {jax.tree_util.keystr(path)} expected "
                    f"{jnp.result_type(old)}{list(jnp.shape(old))}, got "
                    f"{jnp.result_type(new)}{list(jnp.shape(new))}."
                )
        self._state = self._place_state(copy_tree(state))
        self._counters = self._place_state(
            Counters(
                steps=jnp.asarray(steps, jnp.int32), skipped=jnp.asarray(skipped, jnp.int32)
            )
        )
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
    @staticmethod
    def _select_step(metrics: StepMetrics, index: int) -> StepMetrics:
        if np.ndim(metrics.committed) == 0:
            return metrics
        return jax.tree_util.tree_map(lambda a: a[index], metrics)

    def _first_nonfinite(self, metrics: StepMetrics, index: int = -1) -> str | None:
        """The first part, in backward order, whose update or emitted error was non-finite.

        When no part flagged its update or error (an optimiser's moment estimate overflowed,
        say), the last non-finite state leaf in tree order, by its key path
        (`"parts[0].opt_state[0].nu.weights[1]"`, which starts with the part's path); when no
        leaf either, and the step was not committed, `"<root>"` (the tree's output or input
        error)."""
        chosen = self._select_step(metrics, index)
        bad = [
            path
            for path, m in iter_metrics(chosen.parts)
            if not bool(np.asarray(m.finite))
        ]
        if bad:
            return display_path(bad[-1])
        leaves = [
            path
            for path, ok in jax.tree_util.tree_leaves_with_path(chosen.state_finite)
            if not bool(np.asarray(ok))
        ]
        if leaves:
            return jax.tree_util.keystr(leaves[-1]).lstrip(".")
        if not bool(np.asarray(chosen.committed)):
            return display_path("")
        return None

    def report(self, index: int = -1) -> list[dict[str, Any]]:
        """One row per learning part for the last step (the `index`-th inner step of `run`).

        Each row: `part` (its path in the tree), `layer_sizes`, `update_norm`, `error_norm`,
        `weight_norm`, `update_ratio` (update / weight norm, the number to calibrate a part's
        learning rate by) and `finite`. Empty before the first step.
        """
        if self._last is None:
            return []
        chosen = self._select_step(jax.device_get(self._last), index)
        return report_rows(chosen.parts)

    def nonfinite_part(self, index: int = -1) -> str | None:
        """The part where the last step's non-finite value first appeared (backward order),
        or None when the step was finite."""
        if self._last is None:
            return None
        chosen = self._select_step(self._last, index)
        if bool(np.asarray(chosen.committed)) and self.nonfinite != "ignore":
            return None
        return self._first_nonfinite(self._last, index)


__all__ = ["FusedPipeline", "NonFiniteStepError", "StepMetrics", "FiniteFlag"]
