"""The unfused baseline: the same part tree with one compiled program per leaf part.

The fused executor compiles the whole step (forward walk, error, every local learning step)
into one XLA program. To measure what that buys, `unfused(tree)` wraps every *leaf* part (a
part with no child parts) so that its Core's `forward` and `backward` are each their own
`jax.jit`, and `UnfusedPipeline` walks the composites eagerly in Python: every leaf is one
dispatch forward and one backward, and the composites' glue (residual additions, the
attention mixing, the error at the output) runs op by op between them. The errors therefore
travel between parts through the host's dispatch loop, as they would in an implementation
without a fused step.

The arithmetic is the same as the fused step's, so one step of both gives the same state to
float32 rounding; only the scheduling differs. The tree is walked through the part protocol
only, so no concrete part type is named here: a part is a composite when `children()` lists
any, it is rebuilt with `replace_children`, and every part is first asked for its
`unrolled()` form (a `Repeat` that scans its blocks unrolls them), so that the leaves of
repeated blocks are dispatched one by one too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fusedpc.core import losses as _errors
from fusedpc.core._checks import check_part
from fusedpc.core._context import StepContext
from fusedpc.core._part import AbstractPart, Core, PyTree
from fusedpc.execution._rows import copy_tree, normalise_active
from fusedpc.execution._step_types import NORMALISATIONS


def is_composite(part: AbstractPart) -> bool:
    """A part is a composite when it declares children (`AbstractPart.children()`)."""
    return bool(part.children())


class JitLeaf(AbstractPart):
    """A leaf part whose Core's `forward` and `backward` are each compiled on their own.

    Its state is the wrapped part's state (no extra nesting), so the state trees of a tree and
    of its `unfused` twin have the same structure; `write_back` returns a wrapped part again.
    """

    inner: AbstractPart

    def __init__(self, inner: AbstractPart):
        self.inner = check_part(inner, "JitLeaf.inner")

    def init_state(self, key: jax.Array) -> PyTree:
        return self.inner.init_state(key)

    def validate_input(self, x: Any, path: str) -> None:
        self.inner.validate_input(x, path)

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        return self.inner.input_checks(x, path)

    def compile(self, path: str) -> Core:
        core = self.inner.compile(path)
        # each leaf compiled on its own, in the plain context (float32, norms measured at
        # once): a context of a step's trace cannot reach into a separately compiled leaf
        plain = StepContext()
        jitted_forward = jax.jit(lambda state, x: core.forward(state, x, plain))
        jitted_backward = jax.jit(lambda state, cache, error: core.backward(state, cache, error,
                                                                             plain))

        def forward(state: PyTree, x, ctx: StepContext):
            del ctx
            return jitted_forward(state, x)

        def backward(state: PyTree, cache, error, ctx: StepContext):
            del ctx
            return jitted_backward(state, cache, error)

        def write_back(state: PyTree) -> JitLeaf:
            return JitLeaf(core.write_back(state))

        return Core(forward, backward, write_back)


def unfused(tree: AbstractPart) -> AbstractPart:
    """The same tree with every leaf part wrapped in a `JitLeaf` (one jit per leaf part).

    Every part is replaced by its `unrolled()` form first (a scan over repeated blocks becomes
    a Python loop whose leaves dispatch one by one); composites are then rebuilt around their
    wrapped children with `replace_children` (their own `__init__` is not re-run).
    """
    check_part(tree, "unfused(tree)")
    if isinstance(tree, JitLeaf):
        return tree
    tree = tree.unrolled()
    children = tree.children()
    if not children:
        return JitLeaf(tree)
    return tree.replace_children([unfused(child) for _, child in children])


class UnfusedPipeline:
    """Trains an `unfused` tree eagerly: the composites run in Python, each leaf is one jit.

    The same training step as `FusedPipeline.step` (forward walk, descent error from
    `error_fn`, `error_normalisation`, backward walk, new state), without the non-finite guard
    (a step is always committed) and without donation. The error at the output is formed by
    one more small compiled function.

    Args:
        tree: the root part; wrapped with `unfused` unless it is already.
        error_fn, error_normalisation, key: as for `FusedPipeline`.
        mesh: as for `FusedPipeline`: the state is replicated over it and each batch's leading
            axis sharded over its `"data"` axis.
    """

    def __init__(
        self,
        tree: AbstractPart,
        error_fn: _errors.ErrorFunction | str | Callable | None = None,
        error_normalisation: str = "rows",
        *,
        key: jax.Array | None = None,
        mesh: jax.sharding.Mesh | None = None,
    ):
        check_part(tree, "UnfusedPipeline(tree)")
        if error_normalisation not in NORMALISATIONS:
            raise ValueError(
                f"error_normalisation: expected one of {NORMALISATIONS}, got "
                f"{error_normalisation!r}."
            )
        self.tree = tree if _all_leaves_wrapped(tree) else unfused(tree)
        self.error_fn = _errors.resolve(error_fn)
        self.error_normalisation = error_normalisation
        self._core = self.tree.compile("")
        key = jax.random.key(0) if key is None else key
        self.mesh = mesh
        self._state = copy_tree(self.tree.init_state(key))
        if mesh is not None:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._state = jax.device_put(self._state, replicated)
        self._head = jax.jit(self._error_and_loss)
        self._loss: jax.Array | None = None
        self._metrics: PyTree = None

    def _error_and_loss(self, y, target):
        error = self.error_fn.error(y, target)
        if self.error_normalisation == "active":
            error = normalise_active(error)
        if self.error_fn.loss is None:
            loss = jnp.full((), jnp.nan, jnp.float32)
        else:
            loss = self.error_fn.loss(y, target).astype(jnp.float32)
        return error, loss

    def _place(self, x: Any) -> Any:
        if self.mesh is None:
            return x
        x = jnp.asarray(x)
        spec = jax.sharding.PartitionSpec("data", *([None] * (x.ndim - 1)))
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

    def step(self, x: Any, target: Any) -> tuple[jax.Array, Any]:
        """One training step dispatched part by part. Returns `(output, input_error)`."""
        # As FusedPipeline: values of host arrays are checked, device arrays by shape and dtype
        # only (reading them back would cost a device-to-host copy per step).
        checked = jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
        self.tree.validate_input(checked, "")
        x, target = self._place(x), self._place(target)
        ctx = StepContext()
        y, cache = self._core.forward(self._state, x, ctx)
        error, self._loss = self._head(y, target)
        input_error, self._state, self._metrics = self._core.backward(
            self._state, cache, error, ctx)
        return y, input_error

    @property
    def state(self) -> PyTree:
        """The current state pytree (the same structure as the wrapped tree's state)."""
        return self._state

    @property
    def last_loss(self) -> float | None:
        return None if self._loss is None else float(self._loss)

    @property
    def last_metrics(self) -> PyTree:
        """The parts' metrics of the last step (keyed like the state)."""
        return self._metrics

    def merge(self) -> AbstractPart:
        """The (wrapped) tree with the current state written back, holding copies."""
        return self._core.write_back(copy_tree(self._state))


def _all_leaves_wrapped(tree: AbstractPart) -> bool:
    if isinstance(tree, JitLeaf):
        return True
    children = tree.children()
    return bool(children) and all(_all_leaves_wrapped(child) for _, child in children)


__all__ = ["JitLeaf", "UnfusedPipeline", "is_composite", "unfused"]
