"""A learning lookup table.

`LearningEmbedding` is the one-matrix learning network fed one-hot rows, computed at
$O(R \\cdot D)$ instead of $O(R \\cdot V \\cdot D)$: the forward gathers rows of the table and the
backward scatter-adds the error into them. For ids $i_r$ and output errors $E_r$ (gaussian
output of unit precision), the row-mean gradient of the table $T$ (`(V, D)`, the layout of
`eqx.nn.Embedding.weight`) is

$$\\bar G_v = \\frac{k}{R} \\sum_{r: i_r = v} E_r,$$

exactly $\\mathrm{mean}_r\\, E_r \\otimes \\mathrm{onehot}(i_r)$ of the dense network. The
synaptic importance increment is $\\bar p \\,\\bar q_v$ with $\\bar p = k$ (unit output precision)
and $\\bar q_v = |\\{r : i_r = v\\}| / R$, the batch mean of the squared one-hot input.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._checks import check_ids, expect_last_axis, id_range_check, lookup_rows
from fusedpc.core._part import (
    AbstractPart,
    Core,
    PyTree,
    TableParams,
    display_path,
    replace_fields,
)
from fusedpc.core._precision import widened
from fusedpc.parts.learning._local_update import (
    SynapticSettings,
    resolve_learning,
    scaled_synaptic_gradient,
    synaptic_step,
)
from fusedpc.parts.learning._rules import LearningRule, learning_rule, rule_spelling


class EmbeddingState(eqx.Module):
    """`table` `(V, D)`, optax `opt_state`, `weight_precision` (synaptic kind only)."""

    table: jax.Array
    opt_state: PyTree
    weight_precision: jax.Array | None


class LearningEmbedding(AbstractPart):
    """A learning lookup table: integer ids `(...)` in, rows `(..., D)` out.

    Learns like a learning network with one matrix, no bias and a unit-precision gaussian
    output fed one-hot rows (`precision_weighted` and `standard` coincide there), through an
    optax `optimiser` or `synaptic_uncertainty`. Its input error is `None` (ids carry none).
    """

    defers_updates: ClassVar[bool] = True

    table: jax.Array
    optimiser: Any = eqx.field(static=True)
    learning_kind: str = eqx.field(static=True)
    learning_kwargs: tuple = eqx.field(static=True)
    weight_reuse: float = eqx.field(static=True)
    synaptic: SynapticSettings | None = eqx.field(static=True)
    opt_state: PyTree
    weight_precision: jax.Array | None

    def __init__(
        self,
        table: jax.Array,
        optimiser: optax.GradientTransformation | None = None,
        learning_kind: str | LearningRule = "precision_weighted",
        learning_kwargs: dict | None = None,
        *,
        weight_reuse: float = 1.0,
        opt_state: PyTree = None,
        weight_precision: jax.Array | None = None,
    ):
        table = jnp.asarray(table, jnp.float32)
        if table.ndim != 2:
            raise ValueError(
                f"LearningEmbedding: table must have shape (vocab, width), got {table.shape}."
            )
        learning_kind, learning_kwargs = rule_spelling("LearningEmbedding", learning_kind,
                                                       learning_kwargs)
        # Validated once, here (the errors name the bad setting); compile reads the result.
        self.synaptic = resolve_learning(
            "LearningEmbedding", optimiser, learning_kind, learning_kwargs, weight_reuse
        )
        self.table = table
        self.optimiser = optimiser
        self.learning_kind = learning_kind
        self.learning_kwargs = tuple(sorted((learning_kwargs or {}).items()))
        self.weight_reuse = float(weight_reuse)
        self.opt_state = opt_state
        self.weight_precision = weight_precision

    @property
    def rule(self) -> LearningRule:
        """The learning rule as a typed object (`PrecisionWeighted()`, `Standard()`,
        `SynapticUncertainty(...)`)."""
        return learning_rule(self.learning_kind, dict(self.learning_kwargs))

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    def validate_input(self, x: Any, path: str) -> None:
        check_ids(x, self.vocab_size, path)

    def input_checks(self, x: Any, path: str) -> tuple[Any, ...]:
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            return ()  # the forward's trace-time check names the dtype
        return (id_range_check(x, self.vocab_size, path),)

    def export_arrays(self, path: str = "") -> tuple[TableParams]:
        """`(TableParams(table),)`, the `(V, D)` table."""
        del path
        return (TableParams(self.table),)

    def init_state(self, key: jax.Array) -> EmbeddingState:
        del key
        opt_state = self.opt_state
        if opt_state is None and self.optimiser is not None:
            opt_state = self.optimiser.init(self.table)
        weight_precision = self.weight_precision
        if weight_precision is None and self.learning_kind == "synaptic_uncertainty":
            weight_precision = jnp.zeros_like(self.table)
        return EmbeddingState(self.table, opt_state, weight_precision)

    def compile(self, path: str) -> Core:
        vocab, width = self.table.shape
        synaptic = self.synaptic
        k = self.weight_reuse

        def forward(state: EmbeddingState, ids, ctx):
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise TypeError(
                    f"{display_path(path)}: expected integer token ids, got dtype {ids.dtype} "
                    f"(shape {tuple(ids.shape)}); convert with .astype(jnp.int32)."
                )
            return ctx.to_compute(lookup_rows(state.table, ids)), ids

        def backward(state: EmbeddingState, ids, error, ctx):
            expect_last_axis(path, error, width, what="error")
            flat_ids = ids.reshape(-1)
            rows = widened(error).reshape(-1, width)
            n_rows = rows.shape[0]
            gradient = jnp.zeros_like(state.table).at[flat_ids].add(rows) * (k / n_rows)
            table, opt_state, weight_precision = state.table, state.opt_state, None
            if synaptic is not None:
                counts = jnp.zeros((vocab,), state.table.dtype).at[flat_ids].add(1.0)
                increment = jnp.broadcast_to((k * counts / n_rows)[:, None], table.shape)
                extra = cast(jax.Array, state.weight_precision)  # kept by the synaptic kind
                gradient, opt_state = scaled_synaptic_gradient(self.optimiser, gradient, opt_state)
                table, weight_precision = synaptic_step(
                    synaptic, table, gradient, extra, increment
                )
            elif self.optimiser is not None:
                table, opt_state = ctx.optimiser_step(self.optimiser, table, gradient, opt_state)
            new_state = EmbeddingState(table, opt_state, weight_precision)
            metrics = ctx.learning_metrics(state.table, table, error, None, (vocab, width))
            return None, new_state, metrics

        def write_back(state: EmbeddingState) -> LearningEmbedding:
            return replace_fields(
                self,
                table=state.table,
                opt_state=state.opt_state,
                weight_precision=state.weight_precision,
            )

        return Core(forward, backward, write_back)


__all__ = ["EmbeddingState", "LearningEmbedding"]
