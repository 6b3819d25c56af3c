"""Error functions: the descent error at the tree's output, formed inside the compiled step.

An `ErrorFunction` pairs `error(output, target)` — the per-row descent error
$E = \\partial \\ell_r / \\partial \\text{output}$ — with the scalar loss it is the gradient of
(the row mean of $\\ell_r$), which the executor reports as `loss`, and the row losses
$\\ell_r$ themselves, which a step with a row mask averages over the real rows only.

* `squared`: $E = y - t$, loss $\\operatorname{mean}_r \\tfrac12 \\lVert y_r - t_r \\rVert^2$.
* `softmax_cross_entropy`: the output holds logits;
  $E = \\mathrm{softmax}(y) - \\mathrm{onehot}(t)$, loss = mean cross-entropy.
* `cross_entropy`: the output holds probabilities (a categorical head);
  $E = p - \\mathrm{onehot}(t)$ (the error at the head's logits, which the categorical head
  expects), loss $-\\log p_t$.
* `sigmoid_cross_entropy`: the output holds probabilities of a binary head; $E = p - t$.
* `observed_squared`: the squared error over the target's observed entries only: a NaN in
  the target marks an entry as not observed, $E = [t \\text{ observed}](y - t)$, loss
  $\\operatorname{mean}_r \\tfrac12 \\sum_{j \\text{ observed}} (y_{rj} - t_{rj})^2$. For
  inference from part of an output (generative latents: `docs/pc-depth.md`).

Targets for the cross-entropies are integer class ids of shape `output.shape[:-1]` or one-hot /
probability rows of the output's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class ErrorFunction(NamedTuple):
    """A descent error with the loss it is the gradient of.

    Args:
        error: `error(output, target) -> E`, the per-row descent error, shaped like `output`.
        loss: `loss(output, target) -> scalar` (the row mean), or `None` when unknown.
        name: shown in messages and reports.
        class_ids: whether integer targets are class ids (one-hot rows of the output's
            width), so that the executor checks them against `[0, width)`.
        row_loss: `row_loss(output, target) -> (rows...)`, the loss of each row ($\\ell_r$,
            whose mean is `loss`), or `None`; a masked step reports
            $\\sum_r w_r \\ell_r / \\sum_r w_r$ with it (NaN without it).
    """

    error: Callable[[jax.Array, jax.Array], jax.Array]
    loss: Callable[[jax.Array, jax.Array], jax.Array] | None
    name: str
    class_ids: bool = False
    row_loss: Callable[[jax.Array, jax.Array], jax.Array] | None = None


def _as_distribution(output: jax.Array, target: jax.Array) -> jax.Array:
    if jnp.issubdtype(target.dtype, jnp.integer):
        if target.shape != output.shape[:-1]:
            raise ValueError(
                f"target: expected integer class ids of shape {tuple(output.shape[:-1])} "
                f"(the output's shape without its last axis), got {tuple(target.shape)}."
            )
        return jax.nn.one_hot(target, output.shape[-1], dtype=output.dtype)
    if target.shape != output.shape:
        raise ValueError(
            f"target: expected integer ids of shape {tuple(output.shape[:-1])} or rows of shape "
            f"{tuple(output.shape)}, got shape {tuple(target.shape)} of dtype {target.dtype}"
            + (
                " (class ids must be an integer dtype: convert with .astype(np.int32))."
                if target.shape == output.shape[:-1]
                else "."
            )
        )
    return target.astype(output.dtype)


def _check_same_shape(output: jax.Array, target: jax.Array) -> None:
    if target.shape != output.shape:
        raise ValueError(
            f"target: expected shape {tuple(output.shape)} (the output's shape), got "
            f"{tuple(target.shape)}."
        )


def _squared_error(output, target):
    _check_same_shape(output, target)
    return output - target.astype(output.dtype)


def _squared_rows(output, target):
    diff = output - target.astype(output.dtype)
    return 0.5 * jnp.sum(diff * diff, axis=-1)


def _observed_squared_error(output, target):
    _check_same_shape(output, target)
    t = target.astype(output.dtype)
    return jnp.where(jnp.isnan(t), jnp.zeros_like(output), output - t)


def _observed_squared_rows(output, target):
    t = target.astype(output.dtype)
    diff = jnp.where(jnp.isnan(t), jnp.zeros_like(output), output - t)
    return 0.5 * jnp.sum(diff * diff, axis=-1)


def _softmax_ce_error(output, target):
    return jax.nn.softmax(output, axis=-1) - _as_distribution(output, target)


def _softmax_ce_rows(output, target):
    logp = jax.nn.log_softmax(output, axis=-1)
    return -jnp.sum(_as_distribution(output, target) * logp, axis=-1)


def _probs_ce_error(output, target):
    return output - _as_distribution(output, target)


def _probs_ce_rows(output, target):
    logp = jnp.log(jnp.clip(output, 1e-30, 1.0))
    return -jnp.sum(_as_distribution(output, target) * logp, axis=-1)


def _binary_error(output, target):
    _check_same_shape(output, target)
    return output - target.astype(output.dtype)


def _binary_rows(output, target):
    t = target.astype(output.dtype)
    p = jnp.clip(output, 1e-7, 1.0 - 1e-7)
    return -jnp.sum(t * jnp.log(p) + (1.0 - t) * jnp.log1p(-p), axis=-1)


def _row_mean(row_loss):
    """The loss of a row loss: its mean over every row."""

    def loss(output, target):
        return jnp.mean(row_loss(output, target))

    loss.__name__ = row_loss.__name__.replace("_rows", "_loss")
    return loss


def _make(error, row_loss, name: str, class_ids: bool = False) -> ErrorFunction:
    return ErrorFunction(error, _row_mean(row_loss), name, class_ids, row_loss)


squared = _make(_squared_error, _squared_rows, "squared")
softmax_cross_entropy = _make(
    _softmax_ce_error, _softmax_ce_rows, "softmax_cross_entropy", class_ids=True
)
cross_entropy = _make(_probs_ce_error, _probs_ce_rows, "cross_entropy", class_ids=True)
sigmoid_cross_entropy = _make(_binary_error, _binary_rows, "sigmoid_cross_entropy")
observed_squared = _make(_observed_squared_error, _observed_squared_rows, "observed_squared")

BY_NAME = {
    f.name: f for f in (squared, softmax_cross_entropy, cross_entropy, sigmoid_cross_entropy,
                        observed_squared)
}


def resolve(error_fn: ErrorFunction | str | Callable | None) -> ErrorFunction:
    """`None` is `squared`; a name picks a ready-made one; a bare callable has no loss."""
    if error_fn is None:
        return squared
    if isinstance(error_fn, ErrorFunction):
        return error_fn
    if isinstance(error_fn, str):
        try:
            return BY_NAME[error_fn]
        except KeyError:
            raise ValueError(
                f"error_fn: unknown name {error_fn!r}; choose one of {sorted(BY_NAME)} or pass "
                "a callable error_fn(output, target) -> descent error."
            ) from None
    from fusedpc.core._part import AbstractPart  # _part does not import this module

    if isinstance(error_fn, AbstractPart):  # callable (its forward), but not an error
        raise TypeError(
            f"error_fn: got the part {type(error_fn).__name__}; an error function is a name, "
            "an ErrorFunction or a callable error_fn(output, target) -> descent error (the "
            "part tree is the pipeline's first argument)."
        )
    if callable(error_fn):
        return ErrorFunction(error_fn, None, getattr(error_fn, "__name__", "custom"))
    raise TypeError(
        f"error_fn: expected None, a name, an ErrorFunction or a callable, got "
        f"{type(error_fn).__name__}."
    )
