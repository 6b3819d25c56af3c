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
# # A generative network on digits
#
# Predictive coding need not run from image to label. Here the network runs the other way:
# a small code at the input decodes to the 64 pixels of an 8 x 8 digit. The code is a
# `fusedpc.Latent` placed first in the tree, so it is not clamped. Its prediction is the
# step's input (the prior mean) at the latent's precision, and the relaxation moves it
# towards whatever explains the observed pixels. With `"observed_squared"` a pixel given as
# NaN is not observed: it adds no error, and the network is free to fill it in.
#
# The code has 10 class places and 4 free places. Its prior mean is the one-hot class where
# the class is given, and zeros where it is not. We train with the class given in a random
# half of the rows, so that one network can do two things:
#
# - infer a code from part of a digit, with no class given, and so fill in the rest;
# - generate a digit from its class alone, with nothing observed.
#
# The data are scikit-learn's bundled digits (1797 images, pixels scaled to [0, 1]), with
# 360 held out.

# %%
import os
import tempfile
from pathlib import Path

import jax
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits

import fusedpc

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="fusedpc_digits_"))
OUT.mkdir(parents=True, exist_ok=True)

digits = load_digits()
images = (digits.data / 16.0).astype(np.float32)
order = np.random.default_rng(0).permutation(len(images))
x_train, y_train = images[order[360:]], digits.target[order[360:]]
x_test, y_test = images[order[:360]], digits.target[order[:360]]
CLASSES, FREE = 10, 4
CODE = CLASSES + FREE
STEPS, BATCH = 1500, 64
print(f"{len(x_train)} training and {len(x_test)} held-out digits of {images.shape[1]} pixels")

# %% [markdown]
# ## The tree
# A code latent (precision 1) and a learning tanh network from the 14 code places to the 64
# pixels. The network is built without `key=`, so its weights are drawn from the key given
# to `program.init`: one compiled step serves every seed.

# %%
tree = fusedpc.Sequential([
    fusedpc.Latent(1.0),
    fusedpc.LearningNetwork(fusedpc.PCNetwork([CODE, 128, 64], "tanh"), optax.adam(1e-3)),
])
program = fusedpc.make_step(tree, "observed_squared",
                            relaxation=fusedpc.Relaxation(steps=20, rate=0.3))
step = jax.jit(program.step, donate_argnums=0)
infer = jax.jit(program.infer)


def code_prior(labels):
    """The prior mean of the code: one-hot where a label is given (>= 0), zeros elsewhere."""
    prior = np.zeros((len(labels), CODE), np.float32)
    given = np.flatnonzero(labels >= 0)
    prior[given, labels[given]] = 1.0
    return prior


def train(seed):
    """`STEPS` steps of `BATCH` rows; the seed sets the weights (the init key) and the
    batches, and which rows are given their class."""
    carry = program.init(jax.random.key(seed))
    rows = np.random.default_rng(seed)
    for _ in range(STEPS):
        batch = rows.choice(len(x_train), BATCH, replace=False)
        labels = np.where(rows.random(BATCH) < 0.5, y_train[batch], -1)
        carry, _ = step(carry, code_prior(labels), x_train[batch])
    return carry.state


# %% [markdown]
# ## Filling in the bottom half
# Every held-out digit loses its bottom half (pixels 32 to 63 become NaN). With no class
# given (the prior is zeros), the relaxation infers a code from the top half alone, and the
# output at that code fills in the bottom half. The baseline is the mean training image,
# which knows nothing of the digit at hand. Three seeds, each trained from scratch.

# %%
observed = x_test.copy()
observed[:, 32:] = np.nan
hidden = x_test[:, 32:]
no_class = code_prior(np.full(len(x_test), -1))
mean_mse = float(np.mean((x_train.mean(0)[32:] - hidden) ** 2))

fill_mse, states = [], []
for seed in range(3):
    state = train(seed)
    got = infer(state, no_class, observed)
    fill_mse.append(float(np.mean((np.asarray(got.output)[:, 32:] - hidden) ** 2)))
    states.append(state)

print("seed  fill-in MSE  mean-image MSE")
for seed, f in enumerate(fill_mse):
    print(f"{seed:4d}  {f:11.4f}  {mean_mse:14.4f}")
print(f"fill-in error {1 - max(fill_mse) / mean_mse:.0%} below the mean image's at worst")
assert all(f < mean_mse for f in fill_mse)

# %% [markdown]
# The gain over the mean image is real but modest: the top half of an 8 x 8 digit often
# leaves its class open (a 5, a 6 and a 9 can start alike), and the fill-in then blends the
# candidates. The first held-out digit of each class, from the seed-0 network: the digit,
# the half the network saw (the hidden half in blue), and that half with the
# network's bottom half below it.

# %%
state = states[0]
shown = np.array([np.flatnonzero(y_test == c)[0] for c in range(CLASSES)])
output = np.asarray(infer(state, no_class[shown], observed[shown]).output)
filled = np.where(np.isnan(observed[shown]), output, observed[shown])  # seen top, its bottom
seen = np.ma.masked_invalid(observed[shown])  # the hidden half drawn in blue
ink = plt.get_cmap("gray_r").with_extremes(bad="lightsteelblue")
fig, axes = plt.subplots(3, len(shown), figsize=(1.2 * len(shown), 3.8))
for row, (name, pictures) in enumerate([("original", x_test[shown]), ("observed", seen),
                                        ("filled in", filled)]):
    for col in range(len(shown)):
        ax = axes[row, col]
        ax.imshow(pictures[col].reshape(8, 8), cmap=ink, vmin=0.0, vmax=1.0)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[row, 0].set_ylabel(name)
fig.tight_layout()
fill_in_figure = OUT / "fill_in.png"
fig.savefig(fill_in_figure)
plt.close(fig)

# %% [markdown]
# ## Generating from the class alone
# With the class given and every pixel NaN, nothing pulls on the code but its prior: the
# relaxation leaves it at the one-hot class (free places zero), and the output is the
# network's digit of that class. Each generated digit should be nearer the mean training
# image of its own class than the mean of any other class.

# %%
labels = np.arange(CLASSES)
nothing = np.full((CLASSES, images.shape[1]), np.nan, np.float32)
generated_run = infer(state, code_prior(labels), nothing)
generated = np.asarray(generated_run.output)
code_moved = float(np.max(np.abs(np.asarray(generated_run.latents[0]) - code_prior(labels))))
class_means = np.stack([x_train[y_train == c].mean(0) for c in labels])
distances = np.mean((generated[:, None, :] - class_means[None, :, :]) ** 2, axis=-1)
nearest = np.argmin(distances, axis=1)
recognised = int(np.sum(nearest == labels))
print("class:            ", " ".join(str(c) for c in labels))
print("nearest class mean:", " ".join(str(c) for c in nearest))
print(f"{recognised} of {CLASSES} generated digits are nearest their own class's mean "
      f"(the code moved {code_moved:.1e} from its prior)")
assert code_moved < 1e-5
assert recognised >= 8

fig, axes = plt.subplots(2, CLASSES, figsize=(1.2 * CLASSES, 2.8))
for c in labels:
    for row, pictures in enumerate([generated, class_means]):
        ax = axes[row, c]
        ax.imshow(pictures[c].reshape(8, 8), cmap="gray_r", vmin=0.0, vmax=1.0)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0, c].set_title(str(c))
axes[0, 0].set_ylabel("generated")
axes[1, 0].set_ylabel("class mean")
fig.tight_layout()
generated_figure = OUT / "generated.png"
fig.savefig(generated_figure)
plt.close(fig)

figure_paths = [fill_in_figure, generated_figure]
print("figures:", ", ".join(str(p) for p in figure_paths))
