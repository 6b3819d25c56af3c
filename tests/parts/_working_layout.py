"""Worker for tests/parts/test_repeat.py: an unrolled `Repeat` stepped in its working layout
(the blocks' states apart, as `FusedPipeline` keeps them) against the same step over the
public, stacked state. Prints one JSON line: for each tree, whether the states, outputs,
input errors and metrics of three steps (and of a 3-step `run`) agree bit for bit."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import fusedpc
from fusedpc import frozen
from fusedpc.parts._repeat import BlockStates, Repeat


def _mlp_block(key):
    k1, k2 = jr.split(key)
    return fusedpc.Residual(
        fusedpc.Sequential([
            fusedpc.LearningNetwork(fusedpc.PCNetwork([4, 6], "tanh", key=k1), optax.adam(1e-2)),
            frozen.tanh(),
            fusedpc.LearningNetwork(fusedpc.PCNetwork([6, 4], "tanh", key=k2), optax.adam(1e-2)),
        ])
    )


def _trees():
    config = fusedpc.GPTConfig(vocab_size=17, width=16, n_heads=2, n_blocks=3, ff_width=32,
                               max_len=8)
    gpt, _ = fusedpc.build_gpt(config, optax.adam(3e-3), jr.key(0))
    ids = np.random.default_rng(0).integers(0, 17, size=(4, 3, 8), dtype=np.int32)
    repeat = Repeat.from_factory(_mlp_block, 3, jr.key(1), unroll=True)
    # an unrolled Repeat inside a Sequential, itself inside a Residual: the layout travels
    chain = fusedpc.Residual(fusedpc.Sequential([frozen.tanh(), repeat]))
    xs = jr.normal(jr.key(2), (4, 5, 4))
    ts = jr.normal(jr.key(3), (4, 5, 4))
    return {
        "gpt": (gpt, "softmax_cross_entropy", ids, ids),
        "nested": (chain, None, xs, ts),
    }


def _same(a, b) -> bool:
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )


def _stacked_run(program, carry, xs, ts):
    """`run`'s scan over a public (stacked) carry, never converted."""
    return jax.lax.scan(lambda c, xt: program.working_step(c, *xt), carry, (xs, ts))


def compare() -> dict:
    out = {}
    for name, (tree, error_fn, xs, ts) in _trees().items():
        pipeline = fusedpc.FusedPipeline(tree, error_fn)
        program = pipeline.program
        working = pipeline._carry_flat.tree
        kept_apart = any(
            isinstance(node, BlockStates)
            for node in jax.tree_util.tree_leaves(
                working, is_leaf=lambda n: isinstance(n, BlockStates)
            )
        )
        stacked_step = jax.jit(program.working_step)  # a public carry: the stacked program
        public_step = jax.jit(program.step)
        stacked = public = program.init(jr.key(0))
        same = True
        for x, t in zip(xs[:3], ts[:3], strict=True):
            fused = pipeline.step(x, t)
            stacked, s_out = stacked_step(stacked, x, t)
            public, p_out = public_step(public, x, t)
            same &= _same(fused, (s_out.output, s_out.input_error))
            same &= _same(fused, (p_out.output, p_out.input_error))
            same &= _same(pipeline.last_metrics, s_out.metrics)
            same &= _same(pipeline.last_metrics, p_out.metrics)
        same &= _same(pipeline.carry, stacked) and _same(public, stacked)
        same &= (
            jax.tree_util.tree_structure(pipeline.state)
            == jax.tree_util.tree_structure(stacked.state)
        )
        _, _, ran = pipeline.run(xs, ts)
        stacked, s_run = jax.jit(functools.partial(_stacked_run, program))(
            stacked, jnp.asarray(xs), jnp.asarray(ts)
        )
        same_run = _same(pipeline.carry, stacked) and _same(ran, s_run.metrics)
        out[name] = {"kept_apart": kept_apart, "steps_equal": bool(same),
                     "run_equal": bool(same_run)}
    return out


if __name__ == "__main__":
    print(json.dumps(compare()))
