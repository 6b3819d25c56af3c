"""pyhgf 0.3.2's side of scripts/pyhgf_speed.py: its all-learning hybrid GPT at its benchmark
configuration, timed in `step` mode. Runs in pyhgf's own virtual environment (Python >= 3.12,
jax < 0.7; pyhgf is GPL-3.0: this file uses its public API and copies none of it).

Reads a JSON request on stdin (`vocab`, `width`, `n_heads`, `n_blocks`, `ff_width`, `seq`,
`batch`, `lr`, `steps`, `warmup`, `seed`) and prints one JSON row. The caller sets
`XLA_FLAGS=--xla_cpu_use_thunk_runtime=true`, which pyhgf then leaves alone (on import it
would switch jaxlib 0.4.32-0.6.2 to the legacy CPU runtime); the row says which runtime ran.
"""

from __future__ import annotations

import json
import os
import sys

import equinox as eqx
import jax
import numpy as np
import optax
from _worker import cross_entropy, timed_steps  # this folder, beside this file
from pyhgf.model.fused import FusedPipeline
from pyhgf.model.hybrid import DeepNetworkAdapter
from pyhgf.model.transformer import hybrid_from_gpt
from pyhgf.model.transplant import from_embedding, from_feedforward, from_linear


class _Attention(eqx.Module):
    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    n_heads: int = eqx.field(static=True)


class _FeedForward(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear


class _Block(eqx.Module):
    n1: eqx.nn.LayerNorm
    attn: _Attention
    n2: eqx.nn.LayerNorm
    ff: _FeedForward


class _GPT(eqx.Module):
    """Only the attribute layout `hybrid_from_gpt` reads; no forward of its own."""

    tok_emb: eqx.nn.Embedding
    pos_emb: eqx.nn.Embedding
    blocks: list
    norm_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear


def _gpt(r: dict, key) -> _GPT:
    d, f = r["width"], r["ff_width"]
    keys = iter(jax.random.split(key, 3 + 6 * r["n_blocks"]))
    blocks = [
        _Block(eqx.nn.LayerNorm(d),
               _Attention(*(eqx.nn.Linear(d, d, key=next(keys)) for _ in range(4)),
                          n_heads=r["n_heads"]),
               eqx.nn.LayerNorm(d),
               _FeedForward(eqx.nn.Linear(d, f, key=next(keys)),
                            eqx.nn.Linear(f, d, key=next(keys))))
        for _ in range(r["n_blocks"])
    ]
    return _GPT(eqx.nn.Embedding(r["vocab"], d, key=next(keys)),
                eqx.nn.Embedding(r["seq"], d, key=next(keys)), blocks, eqx.nn.LayerNorm(d),
                eqx.nn.Linear(d, r["vocab"], key=next(keys)))


def main() -> int:
    r = json.loads(sys.stdin.read())
    gpt = _gpt(r, jax.random.key(r["seed"]))

    def learning(net):
        return DeepNetworkAdapter(net, optimiser=optax.adam(r["lr"]))

    hybrid = hybrid_from_gpt(
        gpt,
        ff_parts=[learning(from_feedforward(b.ff.fc1, b.ff.fc2)) for b in gpt.blocks],
        attention_parts=[{k: learning(from_linear(getattr(b.attn, k)))
                          for k in ("wq", "wk", "wv", "wo")} for b in gpt.blocks],
        head_part=learning(from_linear(gpt.head)),
        token_part=learning(from_embedding(gpt.tok_emb)),
        position_part=learning(from_embedding(gpt.pos_emb)),
    )
    vocab = r["vocab"]
    # the softmax cross-entropy's descent error at the logits, averaged over the rows: the
    # objective of fusedpc's GPT (`GPTConfig.error_fn`)
    pipeline = FusedPipeline(
        hybrid, error_fn=lambda out, ids: jax.nn.softmax(out) - jax.nn.one_hot(ids, vocab),
        error_normalisation="rows")
    ids = jax.random.randint(jax.random.key(r["seed"] + 1), (r["batch"], r["seq"] + 1), 0, vocab)
    x, y = ids[:, :-1], ids[:, 1:]
    first, step_s, output_first, output = timed_steps(
        lambda: pipeline.step(x, y)[0], jax.block_until_ready, r["warmup"], r["steps"])
    loss_first = cross_entropy(output_first, y)
    loss = cross_entropy(output, y)
    print(json.dumps({
        "side": "pyhgf", "step_ms": step_s * 1e3,
        "tokens_per_s": r["batch"] * r["seq"] / step_s, "first_call_s": first,
        "loss_first": loss_first, "loss_last": loss,
        "finite": bool(np.isfinite(loss)), "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
