"""Fill-in of hidden tokens by a trained run (`fusedpc infill RUN`, the `infill_every`
setting of `fusedpc train`; `docs/pc-depth.md`, "Generative latents in the GPT").

Every `hide_every`-th token of the validation windows is hidden and inferred by relaxing it
as a generative latent on the GPT's energy (`fusedpc.transformer.infill`), and scored
against the causal readout, the model's most likely next token from the shown tokens before
it: the fraction of hidden tokens each gets right.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.training import data
from fusedpc.training._config import TrainConfig
from fusedpc.training._setup import reference_skeleton
from fusedpc.transformer._export import to_reference
from fusedpc.transformer._infill import infill
from fusedpc.transformer.reference import GPT

INFILL_STEPS = 64
"""The relaxation's sweeps by default."""
INFILL_RATE = 1.0
"""Its step size by default (plain descent on the latents' logits)."""


def run_reference(pipeline: Any, config: TrainConfig, vocab_size: int) -> GPT:
    """The run's GPT at its current weights as the equinox reference model (its
    feed-forward readout: latents, if the run has any, do not enter it)."""
    return to_reference(pipeline.merge(), reference_skeleton(config, vocab_size))


def hidden_positions(shape: tuple[int, ...], hide_every: int) -> np.ndarray:
    """`True` at positions `hide_every`, `2 hide_every`, ... of every row (position 0, which
    nothing predicts, is always shown)."""
    if isinstance(hide_every, bool) or not isinstance(hide_every, int) or hide_every < 2:
        raise ValueError(f"hide_every: expected an integer >= 2 (every token hidden leaves "
                         f"nothing to infer from), got {hide_every!r}.")
    hidden = np.zeros(shape, bool)
    hidden[..., hide_every::hide_every] = True
    return hidden


def _example(tokenizer: data.Tokenizer, row: np.ndarray, filled: np.ndarray,
             hidden: np.ndarray) -> dict[str, str]:
    shown = "".join("_" if h else tokenizer.decode(np.asarray([t])) for t, h in zip(row, hidden))
    marked = "".join(f"[{tokenizer.decode(np.asarray([f]))}]" if h
                     else tokenizer.decode(np.asarray([t])) for t, f, h in zip(row, filled, hidden))
    return {"shown": shown, "filled": marked, "truth": tokenizer.decode(row)}


def infill_score(
    pipeline: Any, config: TrainConfig, tokenizer: data.Tokenizer, ids: np.ndarray, *,
    hide_every: int = 8, batches: int | None = None, steps: int = INFILL_STEPS,
    rate: float = INFILL_RATE,
) -> dict[str, Any]:
    """Fill-in against the causal readout on `batches` windows of `ids` (the run's batch size
    and `max_len`, drawn as `fusedpc eval` draws them; default: the run's `eval_batches`).

    Returns a JSON-ready dict: `hidden_tokens`, `causal_accuracy`, `infill_accuracy`,
    `energy_before`, `energy_after` (the summed cross-entropy of the hidden windows),
    `steps`, `rate`, `hide_every`, `seconds` (the relaxation, its compilation included) and
    `example` (the first window: `shown` with `_` for hidden tokens, `filled` with them in
    brackets, `truth`).
    """
    batches = config.eval_batches if batches is None else batches
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches: expected an integer >= 1, got {batches!r}.")
    windows = data.BatchIterator(ids, config.batch, config.model.max_len, seed=config.seed)
    x, _ = windows.next_batches(batches)
    rows = x.reshape(-1, x.shape[-1]).astype(np.int32)
    hidden = hidden_positions(rows.shape, hide_every)
    reference = run_reference(pipeline, config, tokenizer.vocab_size)
    relax = jax.jit(lambda r, i, h: infill(r, i, h, steps=steps, rate=rate))
    start = time.perf_counter()
    out = relax(reference, jnp.asarray(rows), jnp.asarray(hidden))
    filled, causal = np.asarray(out.ids), np.asarray(out.causal)
    seconds = time.perf_counter() - start
    energy = np.asarray(out.energy)
    return {
        "hidden_tokens": int(hidden.sum()),
        "causal_accuracy": float(np.mean(causal[hidden] == rows[hidden])),
        "infill_accuracy": float(np.mean(filled[hidden] == rows[hidden])),
        "energy_before": float(energy[0]),
        "energy_after": float(energy[-1]),
        "steps": steps, "rate": rate, "hide_every": hide_every,
        "seconds": seconds,
        "example": _example(tokenizer, rows[0], filled[0], hidden[0]),
    }


def format_infill(score: dict[str, Any]) -> str:
    """Two lines of `infill_score`'s figures, then its example."""
    ex = score["example"]
    return (f"every {score['hide_every']}th token hidden ({score['hidden_tokens']} tokens): "
            f"causal readout {score['causal_accuracy']:.3f}, fill-in "
            f"{score['infill_accuracy']:.3f}\n"
            f"({score['steps']} sweeps at rate {score['rate']:g}, energy "
            f"{score['energy_before']:.1f} -> {score['energy_after']:.1f}, "
            f"{score['seconds']:.1f} s)\n"
            f"shown:  {ex['shown']!r}\nfilled: {ex['filled']!r}")


__all__ = ["INFILL_RATE", "INFILL_STEPS", "format_infill", "hidden_positions", "infill_score",
           "run_reference"]
