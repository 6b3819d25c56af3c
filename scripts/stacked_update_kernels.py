"""Fused kernels of an optimiser update run per block, or once over the stacked blocks.

A small model of the question behind `Repeat`'s optimiser steps over the stack
(docs/benchmarks.md, "Optimiser steps over the stack"): two blocks of five parameter shapes,
each block's gradient computed from its own input, `optax.adam`, state donated, in four
forms. With the blocks' arrays kept apart (`apart_*`, what "blocks apart" tried):

* `apart_per_block`: each block updated on its own;
* `apart_stacked`: the update run once, `jax.vmap` over the stacked blocks, the results
  handed back apart.

With the blocks' arrays stacked on a leading axis (`stacked_*`, a `Repeat`'s state):

* `stacked_per_block`: each block reads its rows, is updated on its own, and the new rows
  are stacked again (what an unrolled `Repeat` did before);
* `stacked_once`: each block's gradient from its rows, then the update once, `jax.vmap`
  over the stacked gradients, parameters and moments, written stacked (what it does now).

It prints one JSON line per form with the compiled program's fusions and distinct fused
computations, counted as `count_kernels.py` counts them.

    python scripts/stacked_update_kernels.py
"""

from __future__ import annotations

import json

from fusedpc.bench._kernels import count_fusions

SHAPES = [(64, 64), (64,), (256, 64), (64, 256), (256,)]
BLOCKS = 2


def programs():
    """The four forms, as functions of (inputs, parameters, optimiser states) returning the
    new parameters and states (a list of blocks' or stacked, as they came), and each form's
    example arguments."""
    import jax
    import jax.numpy as jnp
    import optax

    optimiser = optax.adam(1e-3)

    def gradients(x, params):  # a block's "backward": depends on the block's own input
        return [jnp.tanh(jnp.sum(x) * p) for p in params]

    def update(g, state, params):
        with jax.numpy_dtype_promotion("standard"):  # optax mixes floats and int counts
            updates, state = optimiser.update(g, state, params)
        return optax.apply_updates(params, updates), state

    def stack(*arrays):
        return jnp.stack(arrays)

    def row(tree, i):
        return jax.tree.map(lambda a: a[i], tree)

    def apart_per_block(xs, blocks, states):
        return [update(gradients(x, p), s, p) for x, p, s in zip(xs, blocks, states)]

    def apart_stacked(xs, blocks, states):
        grads = jax.tree.map(stack, *[gradients(x, p) for x, p in zip(xs, blocks)])
        new = jax.vmap(update)(grads, jax.tree.map(stack, *states), jax.tree.map(stack, *blocks))
        return [(row(new[0], i), row(new[1], i)) for i in range(len(blocks))]

    def stacked_per_block(xs, params, states):
        new = [update(gradients(x, row(params, i)), row(states, i), row(params, i))
               for i, x in enumerate(xs)]
        return (jax.tree.map(stack, *[n[0] for n in new]),
                jax.tree.map(stack, *[n[1] for n in new]))

    def stacked_once(xs, params, states):
        grads = jax.tree.map(stack, *[gradients(x, row(params, i)) for i, x in enumerate(xs)])
        return jax.vmap(update)(grads, states, params)

    xs = [jnp.full((8,), i + 1.0) for i in range(BLOCKS)]
    blocks = [[jnp.full(s, i + 1.0) for s in SHAPES] for i in range(BLOCKS)]
    apart = (xs, blocks, [optimiser.init(b) for b in blocks])
    params = [jnp.stack([b[j] for b in blocks]) for j in range(len(SHAPES))]
    stacked = (xs, params, jax.vmap(optimiser.init)(params))
    return {
        "apart_per_block": (apart_per_block, apart),
        "apart_stacked": (apart_stacked, apart),
        "stacked_per_block": (stacked_per_block, stacked),
        "stacked_once": (stacked_once, stacked),
    }


def main() -> int:
    import jax

    for name, (function, args) in programs().items():
        compiled = jax.jit(function, donate_argnums=(1, 2)).lower(*args).compile()
        print(json.dumps({"form": name, "n_blocks": BLOCKS, "shapes": len(SHAPES),
                          **count_fusions(compiled.as_text()), "jax": jax.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
