# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Iterative inference, fused
#
# `fusedpc.IterativeNetwork` is predictive coding as most of the literature runs it. The
# hidden activities relax for T steps on the energy of their precision-weighted prediction
# errors, with the output clamped by the error the tree hands in. Then the weights learn from
# the relaxed errors. The T steps are a `lax.scan` inside the part's backward, so they run
# inside the one compiled training step, beside any other parts.
#
# This notebook shows its two exact regimes against `jax.grad`, then the default relaxation:
# its energy falling step by step, and the part learning inside a small tree. The maths is
# in `docs/iterative.md`.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import IterativeNetwork, PCNetwork, frozen

SIZES = [6, 12, 12, 3]  # three weight matrices, two hidden layers
x = jax.random.normal(jax.random.key(1), (16, 6))
y = jax.random.normal(jax.random.key(2), (16, 3))
net = PCNetwork(SIZES, "tanh", key=jax.random.key(0))
params = {"weights": list(net.weights), "biases": list(net.biases)}


def mlp(p, inputs):
    a = inputs
    for l, (w, b) in enumerate(zip(p["weights"], p["biases"])):
        a = a @ w.T + b
        if l < len(p["weights"]) - 1:
            a = jnp.tanh(a)
    return a


def mean_loss(p):
    return jnp.mean(0.5 * jnp.sum((mlp(p, x) - y) ** 2, axis=-1))


backprop = jax.grad(mean_loss)(params)  # the reference: the backprop gradient


def keep_gradient():
    """An 'optimiser' that stores the gradient it is given as its state (so we can read it)."""
    return optax.GradientTransformation(
        lambda p: jax.tree_util.tree_map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree_util.tree_map(jnp.zeros_like, g), g),
    )


def relaxed_gradient(**settings):
    pipeline = fusedpc.FusedPipeline(IterativeNetwork(net, keep_gradient(), **settings))
    pipeline.step(x, y)
    g = pipeline.state.opt_state
    return {"weights": list(g.weights), "biases": list(g.biases)}, pipeline


def distance(a, b):
    fa = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(a)])
    fb = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(b)])
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


# %% [markdown]
# ## Z-IL: one step is a backprop step
# With `schedule="z_il"` and rate 1, hidden layer $l$ moves only at step $L - l$, and each
# weight reads its gradient when its child error is final. Two hidden layers need two steps.

# %%
zil, _ = relaxed_gradient(schedule="z_il", inference_rate=1.0, inference_steps=2)
zil_gap = distance(zil, backprop)
print(f"Z-IL gradient vs backprop: {zil_gap:.1e} (norm-relative)")
assert zil_gap < 1e-5

# %% [markdown]
# ## Fixed prediction: converging to backprop as T grows
# Holding the predictions at their feed-forward values makes the relaxation linear. Its errors
# approach the backprop deltas geometrically in T.

# %%
STEPS = (1, 2, 4, 8, 16, 32)
fixed_gaps = [
    distance(relaxed_gradient(fixed_prediction=True, inference_rate=0.5,
                              inference_steps=t)[0], backprop)
    for t in STEPS
]
for t, gap in zip(STEPS, fixed_gaps):
    print(f"T = {t:2d}: distance to backprop {gap:.1e}")
assert all(b < a for a, b in zip(fixed_gaps, fixed_gaps[1:]))

# %% [markdown]
# ## The default: predictions move, the energy falls
# With moving predictions (the default) the relaxation settles at the energy's own
# equilibrium, which is not the backprop gradient. `record_energy=True` reports the energy
# before every step.

# %%
moving, pipeline = relaxed_gradient(inference_steps=16, inference_rate=0.1, record_energy=True)
trajectory = np.asarray(pipeline.report()[0]["energy_trajectory"])
print("energy before steps 0, 4, 8, 12 and after the last:", np.round(trajectory[::4], 4))
print(f"its gradient vs backprop: {distance(moving, backprop):.2f}")
assert np.all(np.diff(trajectory) < 0)

# %% [markdown]
# ## Inside a tree
# A residual block whose branch relaxes, between a frozen input projection and a frozen
# readout, learns a smooth target in one compiled call per 25 steps (`run`).

# %%
teacher = jax.random.normal(jax.random.key(3), (3, 6)) / 2.0
tree = fusedpc.Sequential([
    frozen.linear(jax.random.normal(jax.random.key(4), (12, 6)) / 3.0),
    fusedpc.Residual(IterativeNetwork(PCNetwork([12, 24, 12], "tanh", key=jax.random.key(5)),
                                      optax.adam(1e-2), inference_steps=8)),
    frozen.linear(jax.random.normal(jax.random.key(6), (3, 12)) / 4.0),
])
trained = fusedpc.FusedPipeline(tree)
xs = jax.random.normal(jax.random.key(7), (100, 32, 6))
_, _, metrics = trained.run(xs, jnp.sin(xs @ teacher.T))
losses = np.asarray(metrics.loss)
initial_loss, final_loss = float(losses[:5].mean()), float(losses[-5:].mean())
(row,) = trained.report()
print(f"loss {initial_loss:.4f} -> {final_loss:.4f}; the branch's energy "
      f"{row['energy_before']:.4f} -> {row['energy_after']:.4f} in its last step")
assert final_loss < 0.5 * initial_loss
