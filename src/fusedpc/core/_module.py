"""Parts as equinox layers: `as_module(part)` is an `eqx.Module` whose call is the forward.

A part holds its configuration and the arrays it starts from; its state comes from
`init_state(key)`. `PartModule` holds that state as its arrays (so `eqx.filter_jit`,
`jax.vmap` and `eqx.partition` see exactly the state) and the part's configuration as static
structure (every array replaced by its shape and dtype), and calls the part's forward.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.extend.core

from fusedpc.core._checks import check_part
from fusedpc.core._context import StepContext
from fusedpc.core._part import AbstractPart, PyTree

_TRACE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


def _outputs_depend_on_inputs(jaxpr: Any) -> bool:
    """Whether any output of `jaxpr` is computed from one of its inputs (a data-flow walk;
    an equation with a dependent operand taints all its outputs)."""
    tainted = set(jaxpr.invars)

    def depends(var: Any) -> bool:
        return not isinstance(var, jax.extend.core.Literal) and var in tainted

    for eqn in jaxpr.eqns:
        if any(depends(var) for var in eqn.invars):
            tainted.update(eqn.outvars)
    return any(depends(var) for var in jaxpr.outvars)


def state_drawn_from_key(part: AbstractPart) -> bool:
    """Whether `part.init_state(key)` depends on `key`: True for a part whose arrays are drawn
    when its state is initialised (a `LearningNetwork` over a `PCNetwork` built without
    weights or key), False for one that holds its arrays (any `pipeline.merge()` result).

    Read from the data flow of the traced `init_state` (nothing is computed); an `init_state`
    that cannot be traced is run on two keys and the states compared.
    """
    key = jax.random.key(0)
    try:
        closed = jax.make_jaxpr(part.init_state)(key)
    except _TRACE_ERRORS:
        first, second = part.init_state(key), part.init_state(jax.random.key(1))
        return not bool(eqx.tree_equal(first, second))
    return _outputs_depend_on_inputs(closed.jaxpr)


def _shape_of(leaf: Any) -> Any:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if eqx.is_array(leaf) else leaf


class PartModule(eqx.Module):
    """A part as an equinox layer: `module(x)` is the part's forward, `(..., in) -> (..., out)`.

    Build it with `fusedpc.as_module(part, key=None)`. Fields: `state`, the part's state (its
    arrays: what `eqx.partition(module, eqx.is_array)`, `eqx.filter_jit` and `jax.vmap` see),
    and, static, the part's configuration with every array replaced by a
    `jax.ShapeDtypeStruct` (so two modules of equal parts have one tree structure). A call
    compiles the part (`part.compile("")`, which reads only the part's configuration and array
    shapes, as a `Repeat` also requires) and returns `forward(state, x)[0]`: inference only,
    no cache kept, no learning step, and the state is never donated. Input values are not
    checked (token ids out of range are clamped by the lookup); the pipeline's checks are in
    `FusedPipeline.predict`.
    """

    state: PyTree
    structure: Any = eqx.field(static=True)
    shapes: tuple[Any, ...] = eqx.field(static=True)

    def __init__(self, part: AbstractPart, state: PyTree):
        """`part` gives the configuration, `state` (from `part.init_state(key)`, or a state of
        the same structure) the arrays; `fusedpc.as_module` is the usual way to build one."""
        check_part(part, "PartModule(part)")
        leaves, self.structure = jax.tree_util.tree_flatten(part)
        self.shapes = tuple(_shape_of(leaf) for leaf in leaves)
        self.state = state

    def __call__(self, x: Any, *, key: jax.Array | None = None) -> Any:
        """The forward, `(..., in) -> (..., out)`. `key` is accepted and ignored (the forward is
        deterministic), for equinox's layer convention: `eqx.nn.Sequential` passes one to
        every layer. It is not the key the state is drawn from (that one is `as_module`'s)."""
        del key
        part: AbstractPart = jax.tree_util.tree_unflatten(self.structure, self.shapes)
        y, _ = part.compile("").forward(self.state, x, StepContext())
        return y


def as_module(part: AbstractPart, key: jax.Array | None = None) -> PartModule:
    """The part as an equinox layer, `PartModule`: `as_module(part)(x)` runs its forward.

    **Arguments:**

    - `part`: any part (a leaf, a composite, a `pipeline.merge()` result).
    - `key`: the PRNG key its state is drawn from, `part.init_state(key)` (the same key as
      `FusedPipeline(part, key=key)` gives the same state). Required when the state depends on
      it (a `LearningNetwork` whose `PCNetwork` was built without weights or key draws its
      weights there): without it such a part would silently run on weights nobody chose, so
      `as_module` raises a `ValueError`. A part that holds its arrays (every
      `pipeline.merge()` result) needs none.

    `part(x)` is the shortcut `as_module(part)(x)`; build the module once to call it often
    (each call of `part(x)` traces `init_state` to check the key).
    """
    part = check_part(part, "as_module(part)")
    if key is None:
        if state_drawn_from_key(part):
            raise ValueError(
                f"as_module: the state of this {type(part).__name__} is drawn from the PRNG key "
                "at init_state (a LearningNetwork whose PCNetwork was built without weights or "
                "key, say), so calling it without a key would run on random weights. Pass "
                "as_module(part, key=...) (the key FusedPipeline(part, key=...) draws the same "
                "state from), or call a trained tree, pipeline.merge(), which holds its weights."
            )
        key = jax.random.key(0)
    return PartModule(part, part.init_state(key))


__all__ = ["PartModule", "as_module", "state_drawn_from_key"]
