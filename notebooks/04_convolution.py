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
# # A convolutional network, trained fused
#
# Convolutions are parts like any other. `fusedpc.parts.conv` has the frozen ones (a 2-D
# convolution, max and average pooling, flatten), each with a hand-derived backward: the
# input error of a convolution is the *transposed* convolution of the error at its output.
# `LearningConv2d` is a convolution whose kernel learns locally: it is the one-matrix
# learning network applied to the input's patches, and because its weight is used $H' W'$
# times per image, its `weight_reuse` is $H' W'$. With the default `precision_weighted` kind
# its step is the backprop step.
#
# Here a small VGG-style network learns to tell four shapes apart, fused, beside its backprop
# twin, an equinox model with the same weights trained by `jax.grad` and the same optimiser:
#
# ```
# Sequential
# ├── LearningConv2d 1 -> 8, 3x3, SAME     (from an eqx.nn.Conv2d)
# ├── frozen relu
# ├── LearningConv2d 8 -> 8, 3x3, SAME     (from an eqx.nn.Conv2d)
# ├── frozen relu
# ├── frozen max_pool 2x2
# ├── frozen flatten                        (6 x 6 x 8 -> 288)
# └── learning linear head 288 -> 4         (from an eqx.nn.Linear)
# ```

# %%
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import frozen
from fusedpc.parts import conv
from fusedpc.training.shapes import make_shapes
from fusedpc.transplant import from_conv2d

started = time.perf_counter()
SIZE, CLASSES, CHANNELS = 12, ("square", "circle", "cross", "triangle"), 8
STEPS, BATCH = 60, 32

# %% [markdown]
# ## The data: shapes drawn by the code
# `make_shapes` draws grey-scale images, one shape each at a random place and scale, plus
# pixel noise: no download, and the same seed gives the same images everywhere. Images are
# channels-last, `(n, height, width, 1)`, the layout of every image part.

# %%
images, labels = make_shapes(STEPS * BATCH, SIZE, seed=0, classes=CLASSES, noise=0.1)
held_out_images, held_out_labels = make_shapes(256, SIZE, seed=1, classes=CLASSES, noise=0.1)
xs = images.reshape(STEPS, BATCH, SIZE, SIZE, 1)
ys = labels.reshape(STEPS, BATCH)
print("training batches", xs.shape, "labels", ys.shape, "| held out", held_out_images.shape)
print("\n".join("".join("#" if p > 0.5 else "." for p in row) for row in images[0, :, :, 0]),
      "<-", CLASSES[labels[0]])

# %% [markdown]
# ## The reference model, in equinox
# Equinox's convolutions are channels-first on one image `(C, H, W)`; its weight is
# `(C_out, C_in, kh, kw)`. `from_conv2d` turns it into a channels-last part whose kernel is
# `weight.transpose(2, 3, 1, 0)`, `(kh, kw, C_in, C_out)`.

# %%
class SmallVGG(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, CHANNELS, 3, padding="SAME", key=k1)
        self.conv2 = eqx.nn.Conv2d(CHANNELS, CHANNELS, 3, padding="SAME", key=k2)
        self.head = eqx.nn.Linear((SIZE // 2) ** 2 * CHANNELS, len(CLASSES), key=k3)

    def __call__(self, image):  # one channels-last image (H, W, 1) -> logits
        h = jnp.transpose(image, (2, 0, 1))  # equinox is channels-first
        h = jax.nn.relu(self.conv1(h))
        h = jax.nn.relu(self.conv2(h))
        h = eqx.nn.MaxPool2d(2, 2)(h)
        return self.head(jnp.transpose(h, (1, 2, 0)).reshape(-1))  # flatten as (H, W, C)


reference = SmallVGG(jax.random.key(0))
optimiser = optax.adam(1e-2)

# %% [markdown]
# ## The fused tree: the same weights
# Every convolution and the head learn; relu, pooling and flatten are frozen formulas.

# %%
tree = fusedpc.Sequential([
    from_conv2d(reference.conv1, optimiser=optimiser),
    frozen.relu(),
    from_conv2d(reference.conv2, optimiser=optimiser),
    frozen.relu(),
    conv.max_pool(2),
    conv.flatten(),
    fusedpc.transplant.from_linear(reference.head, optimiser=optimiser),
])
pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
logits = pipeline.predict(held_out_images)  # the same shape as below: one compile
gap = float(jnp.max(jnp.abs(logits - jax.vmap(reference)(held_out_images))))
print(f"fused vs equinox logits before training: max |difference| {gap:.1e}")
assert gap < 1e-5

# %% [markdown]
# ## Train both
# `run` trains all the steps in one compiled call. The twin takes the same batches with
# `jax.grad` of the mean cross-entropy and the same Adam.

# %%
_, _, metrics = pipeline.run(xs, ys, keep_outputs=False)
fused_losses = np.asarray(metrics.loss)


@eqx.filter_jit
def backprop_step(model, opt_state, x, y):
    def loss(m):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(x), y))

    value, grads = eqx.filter_value_and_grad(loss)(model)
    # optax mixes Python floats with int32 step counts (Adam's bias correction), which fails
    # under jax_numpy_dtype_promotion="strict" (the test suite's setting)
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


model, opt_state, twin_losses = reference, optimiser.init(eqx.filter(reference, eqx.is_array)), []
for x, y in zip(xs, ys, strict=True):
    model, opt_state, value = backprop_step(model, opt_state, x, y)
    twin_losses.append(float(value))
twin_losses = np.asarray(twin_losses)

curve_gap = float(np.max(np.abs(fused_losses - twin_losses)))
for step in range(0, STEPS, 10):
    print(f"step {step:3d}  fused {fused_losses[step]:.4f}  backprop {twin_losses[step]:.4f}")
print(f"largest gap between the two loss curves: {curve_gap:.1e}")
assert curve_gap <= 1e-3
assert fused_losses[-10:].mean() < 0.6 * fused_losses[0]

# %%
try:
    import matplotlib.pyplot as plt
except ImportError:
    print("(matplotlib is not installed: no plot)")
else:
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(fused_losses, label="fused (local learning)")
    ax.plot(twin_losses, "--", label="backprop twin")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    plt.show()

# %% [markdown]
# ## Held-out accuracy
# Images the network never saw, drawn from another seed.

# %%
predicted = np.argmax(np.asarray(pipeline.predict(held_out_images)), axis=-1)
accuracy = float(np.mean(predicted == held_out_labels))
chance = 1.0 / len(CLASSES)
print(f"held-out accuracy {accuracy:.1%} (chance {chance:.0%})")
assert accuracy > chance + 0.2

# %% [markdown]
# ## Back to arrays
# Each convolution exports its kernel channels-last, `ConvParams(kernel (kh, kw, C_in, C_out),
# bias (C_out,))`; the fused kernels are the twin's, to float32 rounding.

# %%
trained = pipeline.merge()
(first,) = trained.parts[0].export_arrays()
twin_kernel = jnp.transpose(model.conv1.weight, (2, 3, 1, 0))
kernel_gap = float(jnp.linalg.norm(first.kernel - twin_kernel) / jnp.linalg.norm(twin_kernel))
print("first kernel", first.kernel.shape, f"| relative distance to the twin's {kernel_gap:.1e}")
assert kernel_gap < 1e-4
print(pipeline.report()[0])
print(f"notebook ran in {time.perf_counter() - started:.1f} s")
