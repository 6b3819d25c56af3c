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
# # Calibrating per-part learning rates from step reports
#
# Each learning part learns with its own optimiser, so each can have its own rate. The step
# report says, per part, how far one step moves its weights:
#
# $$\rho = \lVert \Delta\theta \rVert / \lVert \theta \rVert .$$
#
# A ratio near $10^{-3}$ per step is a good working point; far above it the part churns or
# diverges, far below it the part hardly learns. Since an optimiser's step is (to first
# order) proportional to its rate, multiplying a part's rate by $\rho^* / \tilde\rho$ (target
# over the median observed ratio) brings it to the target. `fusedpc report LOG` prints the
# same table from a `fusedpc train` log; here we do it by hand on a small tree whose three
# learning parts start with badly chosen rates.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import calibrate, format_table, frozen

TARGET = 1e-3
K, BATCH = 40, 32
k_data, k_teacher, k_parts = jax.random.split(jax.random.key(0), 3)
xs = jax.random.normal(k_data, (K, BATCH, 8))
teacher = jax.random.normal(k_teacher, (8, 4)) / jnp.sqrt(8.0)
targets = jnp.tanh(xs @ teacher) + 0.1 * jnp.sin(3.0 * xs[..., :4])


def make_tree(rates: dict[str, float]):
    """Encoder, a residual mixer and a readout, each learning with Adam at its own rate; the
    rates are keyed by the paths the report uses."""
    k_enc, k_mix, k_out = jax.random.split(k_parts, 3)
    encoder = fusedpc.LearningNetwork(
        fusedpc.PCNetwork([8, 32], key=k_enc), optax.adam(rates["parts[0]"]))
    mixer = fusedpc.LearningNetwork(
        fusedpc.PCNetwork([32, 32, 32], "tanh", key=k_mix), optax.adam(rates["parts[2].branch"]))
    readout = fusedpc.LearningNetwork(
        fusedpc.PCNetwork([32, 4], key=k_out), optax.adam(rates["parts[3]"]))
    return fusedpc.Sequential([encoder, frozen.tanh(), fusedpc.Residual(mixer), readout])


def train(rates: dict[str, float], calls: int = 3):
    """Train `calls` x K steps; return the per-step losses and every step's report rows."""
    pipeline = fusedpc.FusedPipeline(make_tree(rates))
    losses, rows = [], []
    for _ in range(calls):
        _, _, metrics = pipeline.run(xs, targets, keep_outputs=False)
        losses.extend(np.asarray(metrics.loss).tolist())
        for i in range(0, K, 4):  # a report row every 4th step is plenty
            rows.extend({"step": len(losses) - K + i + 1, **row}
                        for row in pipeline.report(index=i))
    return np.asarray(losses), rows


# %% [markdown]
# ## Round 1: rates picked by guesswork

# %%
rates = {"parts[0]": 3e-2, "parts[2].branch": 1e-3, "parts[3]": 1e-5}
losses_before, rows = train(rates)
table = calibrate(rows, target=TARGET, fraction=0.5)  # the second half: past Adam's warm-up
print(format_table(table, TARGET))
print(f"loss: {losses_before[0]:.4f} -> {losses_before[-K:].mean():.4f}")

# %% [markdown]
# ## Round 2: every rate times its multiplier

# %%
calibrated = {c.part: rates[c.part] * c.multiplier for c in table}
print({part: f"{rate:.2e}" for part, rate in calibrated.items()})
losses_after, rows_after = train(calibrated)
table_after = calibrate(rows_after, target=TARGET, fraction=0.5)
print(format_table(table_after, TARGET))
print(f"loss: {losses_after[0]:.4f} -> {losses_after[-K:].mean():.4f}")

# %% [markdown]
# The ratios now sit near the target: every part moves by about the same fraction per
# step. That is a working point, not a promise of the lowest loss after a fixed number of
# steps (here the over-eager encoder had solved much of this easy task on its own); on long
# runs it is what keeps a part from churning or from hardly learning at all.

# %%
spread_before = max(abs(np.log10(c.median_ratio / TARGET)) for c in table)
spread_after = max(abs(np.log10(c.median_ratio / TARGET)) for c in table_after)
print(f"largest distance from the target: 10^{spread_before:.2f} before, "
      f"10^{spread_after:.2f} after calibrating")
assert spread_after < 0.5 < spread_before
assert losses_after[-K:].mean() < 0.25 * losses_after[0]  # the calibrated tree learns
