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
# # Swapping GPT slots from frozen to learning
#
# `fusedpc.hybrid_from_gpt(reference)` turns a reference equinox GPT
# (`fusedpc.transformer.reference.GPT`) into a tree of parts. Every slot you do not hand it
# stays **frozen** at the reference weights, so the all-frozen tree reproduces the reference's
# logits. Each
# slot (token and position tables, the attention projections, the feed-forward networks, the
# LayerNorms, the head) can be swapped for a **learning** part made by `fusedpc.transplant`
# from the very same weights, so swapping changes what learns, never what the model computes.
#
# Finally, with every slot learning (`precision_weighted`, fixed precisions), the hybrid
# follows the backprop twin's loss curve: the local learning steps add up to backprop.

# %%
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import transplant
from fusedpc.training import data
from fusedpc.transformer.reference import GPT, make_backprop_step

text = data.load_text()[:20_000]
tokenizer = data.CharTokenizer.from_text(text)
batches = data.BatchIterator(tokenizer.encode(text), batch_size=8, seq_len=16, seed=0)
STEPS = 40
xs, ys = batches.next_batches(STEPS)  # (STEPS, 8, 16) token ids and next-token targets
reference = GPT(tokenizer.vocab_size, width=32, n_heads=4, n_blocks=1, ff_width=64,
                max_len=16, key=jax.random.key(0))
print("vocabulary", tokenizer.vocab_size, "| batches", xs.shape)

# %% [markdown]
# ## 1. All frozen: the reference's logits, exactly

# %%
frozen_tree = fusedpc.hybrid_from_gpt(reference)
frozen_pipeline = fusedpc.FusedPipeline(frozen_tree, "softmax_cross_entropy")
gap = float(jnp.max(jnp.abs(frozen_pipeline.predict(xs[0]) - reference(jnp.asarray(xs[0])))))
print(f"all frozen: max |logits - reference logits| = {gap:.2e}")
assert gap < 1e-4

# %% [markdown]
# ## 2. Swap the feed-forward networks and the head for learning parts
# `transplant.from_feedforward(fc1, fc2, "gelu")` is one learning network `[W, F, W]` at the
# weights of the two linears; `transplant.from_linear(head)` a one-matrix network. Before any
# step the hybrid still computes the reference's logits.

# %%
adam = optax.adam(3e-3)
hybrid = fusedpc.hybrid_from_gpt(
    reference,
    ff_parts=[transplant.from_feedforward(b.ff.fc1, b.ff.fc2, "gelu", optimiser=adam)
              for b in reference.blocks],
    head_part=transplant.from_linear(reference.head, optimiser=adam),
)
pipeline = fusedpc.FusedPipeline(hybrid, "softmax_cross_entropy")
assert float(jnp.max(jnp.abs(pipeline.predict(xs[0]) - reference(jnp.asarray(xs[0]))))) < 1e-4
_, _, metrics = pipeline.run(xs, ys, keep_outputs=False)
hybrid_losses = np.asarray(metrics.loss)
print(f"feed-forward + head learning: loss {hybrid_losses[0]:.3f} -> "
      f"{hybrid_losses[-5:].mean():.3f} over {STEPS} steps")
print("learning parts:", [row["part"] for row in pipeline.report()])

# %% [markdown]
# ## 3. Every slot learning, against the backprop twin
# The same swap for every slot, with plain SGD; the backprop twin trains a copy of the
# reference with `jax.grad` and the same optimiser on the same batches.

# %%
sgd = optax.sgd(0.3)
# `learn` gives each slot one optimiser: every block's part of that slot is transplanted at
# the reference weights and learns with it (so the blocks stack into one Repeat)
everything = fusedpc.hybrid_from_gpt(
    reference, learn={slot: sgd for slot in fusedpc.transformer.SLOTS}
)
full = fusedpc.FusedPipeline(everything, "softmax_cross_entropy")
_, _, metrics = full.run(xs, ys, keep_outputs=False)
fused_losses = np.asarray(metrics.loss)

# The twin's step donates its model, so it trains a copy of the reference.
twin = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), reference)
twin_state = sgd.init(eqx.filter(twin, eqx.is_array))
backprop_step = make_backprop_step(sgd)
twin_losses = []
for x, y in zip(xs, ys, strict=True):
    twin, twin_state, loss = backprop_step(twin, twin_state, jnp.asarray(x), jnp.asarray(y))
    twin_losses.append(float(loss))
twin_losses = np.asarray(twin_losses)
curve_gap = float(np.max(np.abs(fused_losses - twin_losses)))
print(f"every slot learning: loss {fused_losses[0]:.3f} -> {fused_losses[-5:].mean():.3f}; "
      f"backprop twin {twin_losses[0]:.3f} -> {twin_losses[-5:].mean():.3f}")
print(f"largest gap between the two loss curves over {STEPS} steps: {curve_gap:.2e}")
assert curve_gap < 1e-3

# %% [markdown]
# The report of the fully learning tree names every slot by its path:

# %%
for row in full.report():
    print(f"{row['part']:<26} update/weight {row['update_ratio']:.2e}")
