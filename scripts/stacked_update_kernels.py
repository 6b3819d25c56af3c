"""Fused kernels of an optimiser update run per block, or once over the stacked blocks.

A small model of one question from docs/benchmarks.md ("Blocks apart"): if each block of an
unrolled `Repeat` kept its arrays apart, would applying the optimiser once to the blocks'
stacked gradients (`jax.vmap` over the blocks, the results handed back apart) let XLA:CPU
compile fewer kernels than updating each block on its own? Two blocks of five parameter
shapes, each block's gradient computed from its own input, `optax.adam`, state donated. It
prints one JSON line per form with the compiled program's fusions and distinct fused
computations, counted as `count_kernels.py` counts them.

    python scripts/stacked_update_kernels.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # when loaded from elsewhere (tests)
from count_kernels import count  # noqa: E402

SHAPES = [(64, 64), (64,), (256, 64), (64, 256), (256,)]
BLOCKS = 2


def programs():
    """The two forms, as functions of (inputs, blocks' parameters, blocks' optimiser states)
    returning each block's new parameters and state, and example arguments."""
    import jax
    import jax.numpy as jnp
    import optax

    optimiser = optax.adam(1e-3)

    def gradients(x, params):  # a block's "backward": depends on the block's own input
        return [jnp.tanh(jnp.sum(x) * p) for p in params]

    def update(g, state, params):
        updates, state = optimiser.update(g, state, params)
        return optax.apply_updates(params, updates), state

    def per_block(xs, blocks, states):
        return [update(gradients(x, p), s, p) for x, p, s in zip(xs, blocks, states)]

    def stacked(xs, blocks, states):
        stack = lambda *arrays: jnp.stack(arrays)  # noqa: E731
        grads = jax.tree.map(stack, *[gradients(x, p) for x, p in zip(xs, blocks)])
        new_params, new_states = jax.vmap(update)(
            grads, jax.tree.map(stack, *states), jax.tree.map(stack, *blocks)
        )
        return [
            (jax.tree.map(lambda a, i=i: a[i], new_params),
             jax.tree.map(lambda a, i=i: a[i], new_states))
            for i in range(len(blocks))
        ]

    xs = [jnp.full((8,), i + 1.0) for i in range(BLOCKS)]
    blocks = [[jnp.full(s, i + 1.0) for s in SHAPES] for i in range(BLOCKS)]
    states = [optimiser.init(b) for b in blocks]
    return {"per_block": per_block, "stacked": stacked}, (xs, blocks, states)


def main() -> int:
    import jax

    forms, args = programs()
    for name, function in forms.items():
        compiled = jax.jit(function, donate_argnums=(1, 2)).lower(*args).compile()
        print(json.dumps({"form": name, "blocks": BLOCKS, "shapes": len(SHAPES),
                          **count(compiled.as_text()), "jax": jax.__version__}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
