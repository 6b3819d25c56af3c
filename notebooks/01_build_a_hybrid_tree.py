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
# # Building a hybrid tree by hand
#
# A fusedpc model is a tree of **parts**. *Frozen* parts only translate errors, through a
# hand-derived backward formula; *learning* parts (predictive-coding networks) learn locally
# from the error at their output. Composites (`Sequential`, `Residual`) wire them together.
# `FusedPipeline` compiles the whole training step (forward walk, error at the output, every
# local learning step, error at the input) into one XLA program.
#
# Here we fit a small regression problem with a tree that mixes all of these:
#
# ```
# Sequential
# ├── frozen linear (a fixed random projection 3 -> 16)
# ├── frozen tanh
# ├── Residual( learning network 16 -> 32 -> 16 )
# └── learning network 16 -> 1  (the readout)
# ```

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import frozen

key = jax.random.key(0)
k_data, k_proj, k_branch, k_head = jax.random.split(key, 4)

# %% [markdown]
# ## The task
# Rows of three inputs; the target is a smooth function of them. `run` takes K batches at once:
# arrays of shape `(K, batch, features)`.

# %%
K, BATCH = 60, 32
xs = jax.random.uniform(k_data, (K, BATCH, 3), minval=-2.0, maxval=2.0)
targets = jnp.sin(xs[..., :1]) * jnp.cos(xs[..., 1:2]) + 0.3 * xs[..., 2:]
print("inputs", xs.shape, "targets", targets.shape)

# %% [markdown]
# ## The parts
# * `frozen.linear(weight)` is $y = x W^\top$ with backward $\partial L/\partial x = E W$.
# * `frozen.tanh()` has backward $E \odot (1 - y^2)$.
# * A `LearningNetwork` wraps a `PCNetwork` (sizes, activations, precisions) and an optax
#   optimiser. Its learning step routes the output error down through its layers and updates
#   each matrix with the row mean of (child error) $\otimes$ (parent activation); with the
#   default `precision_weighted` kind that is exactly the backprop gradient.
# * `Residual(branch)` computes $x + \mathrm{branch}(x)$; its backward adds the two messages.

# %%
projection = frozen.linear(jax.random.normal(k_proj, (16, 3)) / jnp.sqrt(3.0))
branch = fusedpc.LearningNetwork(
    fusedpc.PCNetwork([16, 32, 16], "tanh", key=k_branch), optax.adam(3e-3)
)
readout = fusedpc.LearningNetwork(fusedpc.PCNetwork([16, 1], key=k_head), optax.adam(3e-3))
tree = fusedpc.Sequential([projection, frozen.tanh(), fusedpc.Residual(branch), readout])

# %% [markdown]
# ## The pipeline
# The default error function is the squared error ($E = y - t$). One call of `run` trains K
# steps inside one compiled `lax.scan`; the state is donated, so memory is reused in place.

# %%
pipeline = fusedpc.FusedPipeline(tree)
initial_loss = float(jnp.mean(0.5 * (pipeline.predict(xs[0]) - targets[0]) ** 2))
losses = []
for _ in range(5):
    _, _, metrics = pipeline.run(xs, targets, keep_outputs=False)
    losses.extend(np.asarray(metrics.loss).tolist())
final_loss = float(np.mean(losses[-K:]))
print(f"initial loss {initial_loss:.4f}  ->  final loss {final_loss:.4f} "
      f"after {pipeline.steps} steps")

# %% [markdown]
# ## The step report
# Every learning part reports its update norm, the norm of the error at its output, its
# weight norm and their ratio. The frozen parts report nothing but whether the error they
# emitted was finite. Paths name each part by its place in the tree.

# %%
report = pipeline.report()
for row in report:
    print(f"{row['part']:<28} sizes {str(row['layer_sizes']):<12} "
          f"update {row['update_norm']:.2e}  weight {row['weight_norm']:.2e}  "
          f"ratio {row['update_ratio']:.2e}  finite {row['finite']}")

# %% [markdown]
# ## Back to a tree
# `merge()` writes the trained state back into a new tree of parts (copies, safe to keep):
# the frozen projection is unchanged, the learning parts hold their new weights. A frozen
# linear part holds its parameters as a named record, `fusedpc.core.LinearParams(weight,
# bias)` (here without a bias).

# %%
trained = pipeline.merge()
same_projection = bool(jnp.array_equal(trained.parts[0].params.weight,
                                        projection.params.weight))
moved = float(jnp.linalg.norm(trained.parts[3].network.weights[0]
                              - readout.network.weights[0]))
print("frozen projection unchanged:", same_projection, "| readout moved by", f"{moved:.3f}")
assert final_loss < initial_loss

# %% [markdown]
# ## Your own loop: the pure step
# `FusedPipeline` wraps a pure step program that you can drive yourself:
# `fusedpc.make_step(tree)` gives `init(key)`, `step(carry, x, target)`,
# `run(carry, xs, targets)` and `predict(state, x)`, plain functions over an explicit
# `StepCarry` (the state and the step counters). Jit them yourself; `donate_argnums=0` writes
# the new state into the old buffers, as the pipeline does; `write_back(state)` gives the tree
# back. The same 300 steps from the same tree give the pipeline's weights.

# %%
program = fusedpc.make_step(tree)
run = jax.jit(program.run, donate_argnums=0, static_argnames="keep_outputs")
carry = program.init(jax.random.key(0))
for _ in range(5):
    carry, out = run(carry, xs, targets, keep_outputs=False)
print("steps", int(carry.counters.steps), "skipped", int(carry.counters.skipped),
      "| last loss", f"{float(out.metrics.loss[-1]):.4f}")
mine = np.asarray(program.write_back(carry.state).parts[3].network.weights[0])
np.testing.assert_allclose(mine, np.asarray(trained.parts[3].network.weights[0]),
                           rtol=1e-5, atol=1e-6)
