"""Generative latents in a GPT: hidden tokens inferred from both sides
(`fusedpc.transformer.infill`; `docs/pc-depth.md`, "Generative latents in the GPT").

A causal GPT predicts token $i$ from the tokens before it. Hide some tokens of a sequence and
make each hidden one a free latent: a distribution $q_i = \\mathrm{softmax}(u_i)$ over the
vocabulary, read by the GPT as the row $q_i T$ of its token table. The rows the GPT reads are
$r_i = q_i$ where token $i$ is hidden and $\\mathrm{onehot}(x_i)$ where it is shown, and the
energy is the GPT's own prediction error over the whole sequence, the cross-entropy of every
row under the prediction of the rows before it:

$$F(u) = -\\sum_{j=0}^{T-2} \\sum_v r_{j+1,v} \\log p_{j,v}(r_{\\le j}), \\qquad
p_j = \\mathrm{softmax}(\\ell_j).$$

A hidden $q_i$ enters $F$ twice: as the row that position $i-1$ predicts (the causal prior,
$-\\log p_{i-1}$) and as an input to every later prediction (the evidence of the tokens after
it). Its descent gradient is

$$g_i = -\\log p_{i-1} + \\big(J^\\top \\delta\\big)_i, \\qquad
\\delta_j = p_j \\textstyle\\sum_v r_{j+1,v} - r_{j+1}, \\qquad
\\frac{\\partial F}{\\partial u_i} = q_i \\odot \\big(g_i - \\langle q_i, g_i\\rangle\\big),$$

$\\delta$ being the prediction errors at the logits and $J^\\top\\delta$ their pullback to the
input rows, which the GPT's parts compute with nothing learning (`StepContext(learning=False)`:
the error at the embedding output times $T^\\top$). The relaxation descends $F$ in $u$ from
the causal prediction ($u_i = \\ell_{i-1}$ of a first walk with the hidden rows uniform) for
`steps` sweeps, at `rate` or through an optax optimiser; the filled token is
$\\arg\\max_v q_{i,v}$. The other activities are held at their feed-forward values (the
equilibrium of the GPT's error with infinite precision at its hidden layers), so the relaxed
latents are exactly the hidden tokens: nothing else moves, and the GPT's weights do not.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from fusedpc.core._checks import positive_number
from fusedpc.core._context import StepContext
from fusedpc.core._part import replace_fields
from fusedpc.parts import frozen
from fusedpc.transformer._gpt import GPTPart
from fusedpc.transformer._hybrid import hybrid_from_gpt
from fusedpc.transformer.reference import GPT


class Infill(eqx.Module):
    """What `infill` returns.

    Attributes:
        ids: the input ids with every hidden token replaced by its inferred one,
            $\\arg\\max_v q_{i,v}$ `(B, T)`.
        probabilities: $q_i$ at the hidden positions, one-hot elsewhere `(B, T, V)`.
        causal: the causal readout, for comparison: at every position the most likely token
            given the shown tokens before it (hidden ones read as uniform rows) `(B, T)`;
            0 at position 0, which nothing predicts.
        energy: $F$ before every sweep, then after the last `(steps + 1,)`, summed over rows.
    """

    ids: Int[Array, "batch seq"]  # noqa: F722 - a jaxtyping shape
    probabilities: Float[Array, "batch seq vocab"]  # noqa: F722 - a jaxtyping shape
    causal: Int[Array, "batch seq"]  # noqa: F722 - a jaxtyping shape
    energy: Float[Array, " sweeps"]  # noqa: F722 - a jaxtyping shape


def distributions_gpt(reference: GPT) -> GPTPart:
    """A frozen `GPTPart` at `reference`'s weights that reads distributions over the
    vocabulary `(B, T, V)` instead of ids (`GPTPart(token_input="distributions")`; its token
    slot is `frozen.linear(table.T)`)."""
    part = hybrid_from_gpt(reference, token_part=frozen.linear(reference.tok_emb.weight.T))
    return replace_fields(part, token_input="distributions")


def _check_arguments(reference: Any, ids: Any, hidden: Any, steps: Any) -> None:
    if not isinstance(reference, GPT):
        raise TypeError(f"infill: reference must be a fusedpc.transformer.reference.GPT (e.g. "
                        f"to_reference of a trained GPTPart), got {type(reference).__name__}.")
    shape = tuple(jnp.shape(ids))
    if len(shape) != 2 or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise ValueError(f"infill: ids must be integer ids of shape (batch, seq), got shape "
                         f"{shape} and dtype {jnp.result_type(ids)}.")
    if tuple(jnp.shape(hidden)) != shape or jnp.result_type(hidden) != jnp.bool_:
        raise ValueError(f"infill: hidden must be a boolean mask of the ids' shape {shape}, "
                         f"got shape {tuple(jnp.shape(hidden))} and dtype "
                         f"{jnp.result_type(hidden)}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"infill: steps must be an integer >= 0, got {steps!r}.")


def infill(
    reference: GPT,
    ids: Int[Array, "batch seq"],  # noqa: F722 - a jaxtyping shape
    hidden: Bool[Array, "batch seq"],  # noqa: F722 - a jaxtyping shape
    *,
    steps: int = 64,
    rate: float = 1.0,
    optimiser: optax.GradientTransformation | None = None,
) -> Infill:
    """Infer the hidden tokens of `ids` from the tokens on both sides (module docstring).

    Args:
        reference: the GPT, as its equinox twin (`fusedpc.transformer.to_reference` of a
            trained `GPTPart`; `fusedpc infill RUN` builds it from a run).
        ids: the tokens `(B, T)`, `T` at most the GPT's `max_len`; the values at hidden
            positions are not read.
        hidden: `True` where a token is to be inferred `(B, T)`.
        steps: relaxation sweeps (0: the causal prediction itself).
        rate: the step size of plain descent on the latents' logits $u$ (unused with
            `optimiser`).
        optimiser: an optax optimiser over $u$ instead of plain descent, e.g.
            `optax.adam(0.3)`.

    Jit it with `steps` and `optimiser` static (`eqx.filter_jit` does).
    """
    _check_arguments(reference, ids, hidden, steps)
    if optimiser is None:
        optimiser = optax.sgd(positive_number(rate, "infill: rate"))
    core = (gpt := distributions_gpt(reference)).compile("")
    state = gpt.init_state(jax.random.key(0))  # frozen: the state is the reference's weights
    ctx = StepContext(detailed=False, learning=False)
    vocab = gpt.vocab_size
    shown = jax.nn.one_hot(ids, vocab, dtype=jnp.float32)
    mask = hidden[..., None]

    def rows(u):
        q = jax.nn.softmax(u, axis=-1)
        return q, jnp.where(mask, q, shown)

    def walk(u):
        q, r = rows(u)
        logits, cache = core.forward(state, r, ctx)
        log_p = jax.nn.log_softmax(logits, axis=-1)
        following = jnp.concatenate([r[:, 1:], jnp.zeros_like(r[:, :1])], axis=1)
        return -jnp.sum(following * log_p), (q, cache, log_p, following, logits)

    def energy_and_gradient(u):
        energy, (q, cache, log_p, following, _) = walk(u)
        delta = jnp.exp(log_p) * jnp.sum(following, -1, keepdims=True) - following
        pulled, _, _ = core.backward(state, cache, delta, ctx)
        as_target = jnp.concatenate([jnp.zeros_like(log_p[:, :1]), -log_p[:, :-1]], axis=1)
        g = pulled + as_target
        grad_u = q * (g - jnp.sum(q * g, axis=-1, keepdims=True))
        return energy, jnp.where(mask, grad_u, 0.0)

    uniform = 0.0 * shown  # zeros that XLA does not constant-fold through the softmax
    first = walk(uniform)[1][-1]
    before = jnp.concatenate([jnp.zeros_like(first[:, :1]), first[:, :-1]], axis=1)
    u0 = jnp.where(mask, before, 0.0)

    def sweep(carry, _):
        u, opt_state = carry
        energy, grad_u = energy_and_gradient(u)
        updates, opt_state = optimiser.update(grad_u, opt_state, u)
        return (optax.apply_updates(u, updates), opt_state), energy

    (u, _), energies = jax.lax.scan(sweep, (u0, optimiser.init(u0)), None, length=steps)
    last = walk(u)[0]
    q, r = rows(u)
    filled = jnp.where(hidden, jnp.argmax(q, axis=-1).astype(ids.dtype), ids)
    causal = jnp.argmax(before, axis=-1).astype(ids.dtype)
    return Infill(filled, r, causal, jnp.concatenate([energies, last[None]]))


__all__ = ["Infill", "distributions_gpt", "infill"]
