"""A gated feed-forward (SwiGLU): three slots, each any part, around a weight-free gate with a
hand-derived backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax

from fusedpc.core._checks import check_part
from fusedpc.core._metrics import named
from fusedpc.core._part import (
    AbstractPart,
    Core,
    LinearParams,
    PyTree,
    display_path,
    join_path,
    replace_fields,
)
from fusedpc.parts._activations import get_activation

_SLOTS = ("gate", "up", "down")


class GatedState(eqx.Module):
    """State of a `GatedFeedForward`: one field per slot."""

    gate: PyTree
    up: PyTree
    down: PyTree


class GatedCache(eqx.Module):
    """What a `GatedFeedForward`'s backward reads: each slot's cache, the gate's output `g`
    and the up projection's output `u`, each `(..., F)`."""

    gate: PyTree
    up: PyTree
    down: PyTree
    g: jax.Array
    u: jax.Array


class GatedFeedForward(AbstractPart):
    """A gated feed-forward
    $y = \\mathrm{down}\\big(a(\\mathrm{gate}(x)) \\odot \\mathrm{up}(x)\\big)$: SwiGLU for the
    default $a = \\mathrm{silu}$, $\\mathrm{silu}(g) = g\\,\\sigma(g)$.

    **Slots.** `gate` and `up` map `(..., D)` to `(..., F)` (the same shape), `down` maps
    `(..., F)` to the output; each is any part, frozen or learning (`frozen.linear`,
    `transplant.from_linear`), called on all rows at once. `fusedpc.frozen.swiglu` builds
    one with frozen linears, `fusedpc.transplant.from_swiglu` one whose three linears learn.
    The reference GPT's SwiGLU has no biases; the slots may have them.

    **Backward** (descent errors, $E = \\partial L/\\partial y$), with $g = \\mathrm{gate}(x)$,
    $u = \\mathrm{up}(x)$ and $h = a(g) \\odot u$:

    $$e_h = \\mathrm{down}^\\top(E), \\qquad e_g = e_h \\odot u \\odot a'(g), \\qquad
    e_u = e_h \\odot a(g),$$

    $$\\partial L/\\partial x = \\mathrm{gate}^\\top(e_g) + \\mathrm{up}^\\top(e_u),$$

    with the closed-form $\\mathrm{silu}'(g) = \\sigma(g)\\,(1 + g\\,(1 - \\sigma(g)))$. Each
    slot learns from the error at its own output ($E$, $e_g$, $e_u$): a learning linear's
    `precision_weighted` gradient is then exactly backprop's.

    `activation` is any name of `fusedpc.frozen.activation` (`"gelu"` gives GEGLU). The state
    is a `GatedState`, the metrics `named(gate=..., up=..., down=...)` in forward order, so
    report rows read `...feed_forward.gate`. `export_arrays` returns three `LinearParams`, in
    the order gate, up, down.
    """

    defers_updates: ClassVar[bool] = True

    gate: AbstractPart
    up: AbstractPart
    down: AbstractPart
    activation: str = eqx.field(static=True)

    def __init__(
        self,
        gate: AbstractPart,
        up: AbstractPart,
        down: AbstractPart,
        activation: str = "silu",
    ):
        self.gate = check_part(gate, "GatedFeedForward.gate")
        self.up = check_part(up, "GatedFeedForward.up")
        self.down = check_part(down, "GatedFeedForward.down")
        get_activation(activation, "GatedFeedForward: activation")
        self.activation = activation

    def children(self) -> tuple[tuple[str, AbstractPart], ...]:
        """The slots in forward order: `gate`, `up`, `down`."""
        return tuple((name, getattr(self, name)) for name in _SLOTS)

    def replace_children(self, children: Sequence[AbstractPart]) -> GatedFeedForward:
        return replace_fields(self, **dict(zip(_SLOTS, children, strict=True)))

    def validate_input(self, x: Any, path: str) -> None:
        """The input goes to `gate` and `up`: both check it."""
        self.gate.validate_input(x, join_path(path, "gate"))
        self.up.validate_input(x, join_path(path, "up"))

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        return (*self.gate.input_checks(x, join_path(path, "gate")),
                *self.up.input_checks(x, join_path(path, "up")))

    def export_arrays(self, path: str = "") -> tuple[LinearParams, ...]:
        """Three `LinearParams`: gate `(F, D)`, up `(F, D)`, down `(D, F)`, each slot's single
        affine map; a slot exporting anything else raises a `TypeError` naming its path."""

        def one_linear(name: str) -> LinearParams:
            where = join_path(path, name)
            records = getattr(self, name).export_arrays(where)
            if len(records) != 1 or not isinstance(records[0], LinearParams):
                raise TypeError(
                    f"{display_path(where)}: a gated feed-forward slot must export exactly one "
                    f"LinearParams, got {[type(r).__name__ for r in records]}."
                )
            return records[0]

        return tuple(one_linear(name) for name in _SLOTS)

    def init_state(self, key: jax.Array) -> GatedState:
        keys = jax.random.split(key, len(_SLOTS))
        return GatedState(*(getattr(self, n).init_state(k) for n, k in zip(_SLOTS, keys)))

    def compile(self, path: str) -> Core:
        cores = {name: getattr(self, name).compile(join_path(path, name)) for name in _SLOTS}
        act = get_activation(self.activation, "GatedFeedForward: activation")

        def forward(state: GatedState, x, ctx):
            g, c_gate = cores["gate"].forward(state.gate, x, ctx)
            u, c_up = cores["up"].forward(state.up, x, ctx)
            if g.shape != u.shape:
                raise ValueError(
                    f"{display_path(path)}: the slots gate and up must output the same shape, "
                    f"got {tuple(g.shape)} (gate) and {tuple(u.shape)} (up) for an input of "
                    f"shape {tuple(x.shape)}."
                )
            y, c_down = cores["down"].forward(state.down, act.value(g) * u, ctx)
            return y, GatedCache(c_gate, c_up, c_down, g, u)

        def backward(state: GatedState, cache: GatedCache, error, ctx):
            g, u = cache.g, cache.u
            e_h, s_down, m_down = cores["down"].backward(state.down, cache.down, error, ctx)
            e_gate, s_gate, m_gate = cores["gate"].backward(
                state.gate, cache.gate, e_h * u * act.first(g), ctx
            )
            e_up, s_up, m_up = cores["up"].backward(state.up, cache.up, e_h * act.value(g), ctx)
            metrics = named(gate=m_gate, up=m_up, down=m_down)
            return e_gate + e_up, GatedState(s_gate, s_up, s_down), metrics

        def write_back(state: GatedState) -> GatedFeedForward:
            return replace_fields(
                self, **{n: cores[n].write_back(getattr(state, n)) for n in _SLOTS}
            )

        return Core(forward, backward, write_back)
