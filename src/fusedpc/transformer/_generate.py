"""Sampling from a GPT part's predictions, compiled once per prompt shape and length."""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.core._context import StepContext


def _sampler(predict, max_len: int, n_new: int, probabilities: bool, top_k: int | None):
    def sample(state, prompt, temperature, key):
        batch, prompt_len = prompt.shape
        window_len = min(max_len, prompt_len + n_new)
        # The window holds the last `window_len` tokens; it starts as the prompt's tail.
        start = max(prompt_len - window_len, 0)
        tail = prompt[:, start:]
        window = jnp.zeros((batch, window_len), prompt.dtype)
        window = window.at[:, : tail.shape[1]].set(tail)
        filled = jnp.asarray(tail.shape[1], jnp.int32)

        def body(i, carry):
            window, filled, key, out = carry
            scores = predict(state, window)
            last = jax.lax.dynamic_index_in_dim(scores, filled - 1, axis=1, keepdims=False)
            logits = jnp.log(jnp.clip(last, 1e-30, 1.0)) if probabilities else last
            if top_k is not None and top_k < logits.shape[-1]:
                kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            key, sub = jax.random.split(key)
            greedy = jnp.argmax(logits, axis=-1)
            sampled = jax.random.categorical(
                sub, logits / jnp.maximum(temperature, 1e-6), axis=-1
            )
            token = jnp.where(temperature > 0, sampled, greedy).astype(prompt.dtype)
            full = filled >= window_len
            shifted = jnp.where(full, jnp.roll(window, -1, axis=1), window)
            position = jnp.where(full, window_len - 1, filled)
            window = shifted.at[:, position].set(token)
            filled = jnp.minimum(filled + 1, window_len)
            out = out.at[:, i].set(token)
            return window, filled, key, out

        out = jnp.zeros((batch, n_new), prompt.dtype)
        _, _, _, out = jax.lax.fori_loop(0, n_new, body, (window, filled, key, out))
        return jnp.concatenate([prompt, out], axis=1)

    return jax.jit(sample)


class FusedPipelineLike(Protocol):
    """What `generate` reads of a pipeline: its tree, its step program and its state."""

    tree: Any
    program: Any  # a StepProgram (`derived` holds the compiled samplers)

    @property
    def state(self) -> Any: ...


def generate(
    pipeline: FusedPipelineLike,
    prompt_ids: Any,
    n_new: int,
    temperature: float = 1.0,
    key: jax.Array | None = None,
    *,
    top_k: int | None = None,
) -> jax.Array:
    """Extend `prompt_ids` `(batch, prompt_len)` by `n_new` tokens sampled from the model.

    Each new token is drawn from $\\mathrm{softmax}(\\text{logits}/\\tau)$ at the last position
    ($\\tau$ = `temperature`; `temperature=0` takes the argmax, greedy); with `top_k` only the
    `top_k` most likely tokens can be drawn (ties at the k-th value included). The context is
    the last `max_len` tokens (a longer prompt is kept whole in the result; the model sees its
    tail).
    The whole loop is one compiled program (`lax.fori_loop`), compiled once
    per (prompt shape, `n_new`) and cached for the pipeline's step program; the state is read,
    never donated.
    Returns the prompt followed by the new tokens, `(batch, prompt_len + n_new)`.
    """
    tree = pipeline.tree
    max_len = getattr(tree, "max_len", None)
    if max_len is None:
        raise TypeError("generate: the pipeline's tree must be a GPT part (it has no max_len).")
    prompt = np.asarray(prompt_ids) if not isinstance(prompt_ids, jax.Array) else prompt_ids
    if prompt.ndim == 1:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"generate: prompt_ids must have shape (batch, prompt_len) with prompt_len >= 1, "
            f"got {tuple(prompt.shape)}."
        )
    if not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise TypeError(
            f"generate: prompt_ids must be integer token ids, got dtype {prompt.dtype}; "
            "convert with .astype(np.int32)."
        )
    if isinstance(n_new, bool) or not isinstance(n_new, int | np.integer):
        raise TypeError(
            f"generate: n_new must be an integer number of tokens, got {n_new!r} "
            f"({type(n_new).__name__})."
        )
    if n_new < 1:
        raise ValueError(f"generate: n_new must be >= 1, got {n_new!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float | np.number):
        raise TypeError(
            f"generate: temperature must be a number, got {temperature!r} "
            f"({type(temperature).__name__})."
        )
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"generate: temperature must be a finite number >= 0 (0 samples greedily), got "
            f"{temperature!r}."
        )
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1
    ):
        raise ValueError(f"generate: top_k must be None or an integer >= 1, got {top_k!r}.")
    tree.validate_input(prompt, "")
    probabilities = getattr(tree, "output", "logits") == "probabilities"
    program = pipeline.program
    # one compiled sampler per (n_new, output kind, top_k), kept with the program
    cache = program.derived.setdefault("generate", {})
    top_k = None if top_k is None else int(top_k)
    sample_key = (int(n_new), probabilities, top_k)
    if sample_key not in cache:
        forward, ctx = program.core.forward, StepContext()  # the forward in its own dtype

        def predict(state, window):
            return forward(state, window, ctx)[0]

        cache[sample_key] = _sampler(predict, max_len, int(n_new), probabilities, top_k)
    key = jax.random.key(0) if key is None else key
    return cache[sample_key](
        pipeline.state, jnp.asarray(prompt, jnp.int32), jnp.asarray(temperature, jnp.float32),
        key,
    )
