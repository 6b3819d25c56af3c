"""Image parts: the frozen convolution, pools and flatten, the learning convolution, the
shapes set, and a small VGG-style network trained fused beside its backprop twin.

Oracles: `jax.lax.conv_general_dilated` / `reduce_window` for the forwards, `jax.vjp` of each
forward for the hand-derived backwards, and `jax.grad` of the matched loss plus the same optax
optimiser on a plain-JAX twin of the same weights for the learning steps. Every figure is at
float32 rounding (about 1e-7 relative), so no float64 twin is needed here.
"""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_tree_allclose,
    capture_gradients,
    norm_rel_error,
    normal,
    run_at_default_level,
)

import fusedpc
from fusedpc import LearningConv2d, frozen
from fusedpc.parts import conv
from fusedpc.training.shapes import SHAPES, make_shapes
from fusedpc.transplant import from_conv2d

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def lax_padding(padding):
    return ((padding, padding), (padding, padding)) if isinstance(padding, int) else padding


def conv_reference(x, kernel, bias, stride, padding):
    """The twin's convolution: `lax.conv_general_dilated`, channels-last."""
    y = jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), lax_padding(padding), dimension_numbers=DIMENSIONS
    )
    return y if bias is None else y + bias


def forward_backward(part, x, error=None, state=None, *, jit=True):
    """y, input error and new state of one forward + backward (error: y itself, or given)."""
    core = part.compile("")
    state = part.init_state(jax.random.key(0)) if state is None else state

    def run(state, x, error):
        y, cache = core.forward(state, x, CTX)
        input_error, new_state, metrics = core.backward(state, cache,
                                                        y if error is None else error, CTX)
        return y, input_error, new_state, metrics

    return (jax.jit(run) if jit else run)(state, x, error)


def vjp_input_error(part, x, error):
    core = part.compile("")
    state = part.init_state(jax.random.key(0))
    return jax.vjp(lambda inp: core.forward(state, inp, CTX)[0], x)[1](error)[0]


# --------------------------------------------------------------------------- frozen parts
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", ["SAME", "VALID", 1])
def test_conv2d_forward_is_the_convolution_and_backward_its_transpose(stride, padding):
    kernel, bias = normal(1, (3, 3, 3, 4)) / 3.0, normal(2, (4,))
    x = normal(3, (2, 7, 6, 3))  # odd height: strided SAME pads unevenly, VALID drops a row
    part = conv.conv2d(kernel, bias, stride=stride, padding=padding)
    y, input_error, _, _ = forward_backward(part, x, jit=False)  # eager: a few conv ops
    assert_tree_allclose(y, conv_reference(x, kernel, bias, stride, padding), rtol=1e-5,
                         atol=1e-6)
    assert float(fusedpc.check_backward(part, x)) <= 1e-6
    # atol: entries that cancel to ~0 carry the float32 rounding of O(1) terms
    assert_tree_allclose(input_error, vjp_input_error(part, x, y), rtol=1e-5, atol=1e-6)


def test_conv2d_from_eqx_is_the_module_channels_last():
    module = eqx.nn.Conv2d(3, 4, (3, 2), stride=2, padding=1, key=jax.random.key(4))
    part = conv.conv2d(module)
    x = normal(5, (2, 6, 7, 3))
    y, _, _, _ = forward_backward(part, x)
    want = jax.vmap(module)(jnp.transpose(x, (0, 3, 1, 2))).transpose(0, 2, 3, 1)
    assert_tree_allclose(y, want, rtol=1e-5, atol=1e-6)
    (record,) = part.export_arrays()
    assert isinstance(record, conv.ConvParams)
    assert record.kernel.shape == (3, 2, 3, 4) and record.bias.shape == (4,)
    assert float(fusedpc.check_backward(part, x)) <= 1e-6


@pytest.mark.parametrize(("window", "stride"), [(2, None), ((3, 2), (2, 1))])
@pytest.mark.slow
def test_pools_match_reduce_window_and_their_vjp(window, stride):
    x = normal(6, (2, 7, 7, 3))  # odd sizes: the last row and column are in no 2x2 window
    pair = (window, window) if isinstance(window, int) else window
    dims, steps = (1, *pair, 1), (1, *(pair if stride is None else stride), 1)
    parts = (conv.max_pool(window, stride), conv.avg_pool(window, stride))
    cores = [part.compile("") for part in parts]
    state = parts[0].init_state(jax.random.key(0))  # FrozenState(None), as for every pool
    zero = np.zeros((), np.float32)

    @jax.jit
    def run(x):
        results = []
        for core in cores:
            y, cache = core.forward(state, x, CTX)
            input_error = core.backward(state, cache, y, CTX)[0]
            _, vjp = jax.vjp(lambda inp, core=core: core.forward(state, inp, CTX)[0], x)
            results.append((y, input_error, vjp(y)[0]))
        references = (
            jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, steps, "VALID"),
            jax.lax.reduce_window(x, zero, jax.lax.add, dims, steps, "VALID")
            / (pair[0] * pair[1]),
        )
        return results, references

    results, references = run(x)
    for (y, input_error, vjp_error), reference in zip(results, references, strict=True):
        assert_tree_allclose(y, reference, rtol=1e-6, atol=1e-7)
        assert_tree_allclose(input_error, vjp_error, rtol=1e-6, atol=1e-7)
    if stride is not None:  # overlapping windows; the public checker too
        for part in parts:
            assert float(fusedpc.check_backward(part, x)) <= 1e-6


@pytest.mark.slow
def test_max_pool_ties_go_to_the_first_maximum():
    x = jnp.zeros((1, 4, 4, 2), jnp.float32).at[0, 3, 3, 1].set(1.0)  # one window with a winner
    part = conv.max_pool(2)
    _, input_error, _, _ = forward_backward(part, x, jnp.ones((1, 2, 2, 2), jnp.float32),
                                            jit=False)
    want = np.zeros((1, 4, 4, 2), np.float32)
    want[0, ::2, ::2, :] = 1.0  # every tied window: its top-left entry
    want[0, 2, 2, 1], want[0, 3, 3, 1] = 0.0, 1.0  # the window that has a strict maximum
    np.testing.assert_array_equal(np.asarray(input_error), want)
    assert float(fusedpc.check_backward(part, x)) == 0.0  # autodiff of the forward agrees


def test_flatten_is_row_major_and_reshapes_back():
    x = normal(7, (2, 3, 4, 5))
    part = conv.flatten()
    y, input_error, _, _ = forward_backward(part, x, jit=False)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x).reshape(2, -1))
    np.testing.assert_array_equal(np.asarray(input_error), np.asarray(x))


def test_equal_parts_have_equal_static_structure():
    kernel = normal(8, (3, 3, 2, 2))
    same = [conv.conv2d(kernel, stride=2), conv.conv2d(kernel + 1.0, stride=2)]
    assert jax.tree_util.tree_structure(same[0]) == jax.tree_util.tree_structure(same[1])
    assert jax.tree_util.tree_structure(conv.max_pool(2)) == jax.tree_util.tree_structure(
        conv.max_pool((2, 2), 2))
    assert jax.tree_util.tree_structure(same[0]) != jax.tree_util.tree_structure(
        conv.conv2d(kernel, stride=1))


def _message(fn) -> str:
    with pytest.raises((ValueError, TypeError)) as info:
        fn()
    return str(info.value)


def test_bad_inputs_name_the_argument_the_expected_and_the_actual_value():
    part = conv.conv2d(normal(9, (3, 3, 2, 4)))
    core, state = part.compile("parts[1]"), part.init_state(jax.random.key(0))
    message = _message(lambda: core.forward(state, jnp.zeros((4, 6, 2), jnp.float32), CTX))
    assert "parts[1]" in message and "(batch, height, width, channels)" in message
    assert "(4, 6, 2)" in message
    message = _message(lambda: core.forward(state, jnp.zeros((1, 6, 6, 3), jnp.float32), CTX))
    assert "parts[1]" in message and "(..., 2)" in message and "(1, 6, 6, 3)" in message
    valid = conv.conv2d(normal(9, (3, 3, 2, 4)), padding="VALID")
    message = _message(lambda: valid.compile("parts[2]").forward(
        valid.init_state(jax.random.key(0)), jnp.zeros((1, 2, 5, 2), jnp.float32), CTX))
    assert "parts[2]" in message and "3x3 window does not fit" in message and "2x5" in message
    assert "padding" in _message(lambda: conv.conv2d(normal(9, (3, 3, 2, 4)), padding="FULL"))
    assert "'FULL'" in _message(lambda: conv.conv2d(normal(9, (3, 3, 2, 4)), padding="FULL"))
    assert "stride" in _message(lambda: conv.conv2d(normal(9, (3, 3, 2, 4)), stride=0))
    assert "(kh, kw, in_channels, out_channels)" in _message(
        lambda: conv.conv2d(normal(9, (3, 2, 4))))
    assert "bias must have shape (4,)" in _message(
        lambda: conv.conv2d(normal(9, (3, 3, 2, 4)), normal(10, (3,))))
    assert "window" in _message(lambda: conv.max_pool(0))
    module = eqx.nn.Conv2d(2, 4, 3, key=jax.random.key(0))
    dilated = fusedpc.core.replace_fields(module, dilation=(2, 2))
    assert "dilation must be 1" in _message(lambda: conv.conv2d(dilated))
    assert "dilation must be 1" in _message(lambda: from_conv2d(dilated))
    assert "module's" in _message(lambda: conv.conv2d(module, stride=2))
    assert "kernel must have shape (3, 3, 2, 4)" in _message(
        lambda: LearningConv2d(2, 4, 3, kernel=normal(9, (3, 3, 4, 2))))
    assert "LearningConv2d: unknown learning_kind 'backprop'" in _message(
        lambda: LearningConv2d(2, 4, 3, learning_kind="backprop"))
    assert "unknown keywords ['rate']" in _message(
        lambda: from_conv2d(module, rate=0.1))
    learning = LearningConv2d(2, 4, 3, key=jax.random.key(0))
    lcore = learning.compile("parts[0]")
    message = _message(
        lambda: lcore.forward(learning.init_state(jax.random.key(0)),
                              jnp.zeros((1, 6, 6, 3), jnp.float32), CTX))
    assert "parts[0]" in message and "2 channels" in message and "(1, 6, 6, 3)" in message


# --------------------------------------------------------------------------- learning conv
def test_learning_conv_computes_the_module_and_exports_its_kernel():
    module = eqx.nn.Conv2d(3, 4, 3, stride=2, padding=1, key=jax.random.key(11))
    part = from_conv2d(module, optimiser=optax.sgd(0.1))
    x = normal(12, (2, 2, 7, 6, 3))  # two row axes
    y, _, _, _ = forward_backward(part, x)
    want = jax.vmap(jax.vmap(module))(jnp.moveaxis(x, -1, -3))
    assert_tree_allclose(y, jnp.moveaxis(want, -3, -1), rtol=1e-5, atol=1e-6)
    (record,) = part.export_arrays()
    np.testing.assert_array_equal(record.kernel, jnp.transpose(module.weight, (2, 3, 1, 0)))
    np.testing.assert_array_equal(record.bias, module.bias.reshape(-1))
    weight = part.network.network.weights[0]  # (C_out, kh*kw*C_in), patch order (i, j, c)
    np.testing.assert_array_equal(weight.T.reshape(3, 3, 3, 4), record.kernel)
    drawn = LearningConv2d(3, 4, 3)
    assert "drawn when the state is initialised" in _message(lambda: drawn.export_arrays("slot"))


@pytest.mark.parametrize(
    ("optimiser", "stride", "padding"),
    [(optax.adam(1e-2), 2, "VALID"), (optax.sgd(0.5), 2, 1)],
    ids=["adam-valid-stride2", "sgd-pad1-stride2"],
)
def test_one_step_equals_backprop_of_the_mean_over_images(optimiser, stride, padding):
    part = LearningConv2d(3, 4, 3, optimiser, stride=stride, padding=padding,
                          key=jax.random.key(13))
    x = normal(14, (3, 7, 6, 3))
    params = {"kernel": part.kernel, "bias": part.bias}
    target = normal(15, conv_reference(x, part.kernel, part.bias, stride, padding).shape)

    def loss(p, images):  # 1/2 |y - t|^2 summed per image, averaged over the images
        y = conv_reference(images, p["kernel"], p["bias"], stride, padding)
        return 0.5 * jnp.sum((y - target) ** 2) / images.shape[0]

    grads = jax.grad(loss)(params, x)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
        updates, _ = optimiser.update(grads, optimiser.init(params), params)
    twin = optax.apply_updates(params, updates)

    error = conv_reference(x, part.kernel, part.bias, stride, padding) - target
    _, input_error, new_state, _ = forward_backward(part, x, error)
    learned = part.compile("").write_back(new_state)
    for name, got in (("kernel", learned.kernel), ("bias", learned.bias)):
        change = np.asarray(twin[name]) - np.asarray(params[name])
        assert np.linalg.norm(change) > 0
        assert norm_rel_error(np.asarray(got) - np.asarray(params[name]), change) <= 1e-5, name
    # the input error is the per-image gradient of the summed loss (not divided by N)
    want = x.shape[0] * jax.grad(loss, argnums=1)(params, x)
    assert norm_rel_error(input_error, want) <= 1e-5


def test_weight_reuse_one_is_the_gradient_of_the_mean_over_positions():
    part = LearningConv2d(2, 3, 3, capture_gradients(), weight_reuse=1.0,
                          key=jax.random.key(16))
    x, error = normal(17, (2, 5, 5, 2)), normal(18, (2, 5, 5, 3))

    def loss(p):  # <y, E> averaged over the 2 * 5 * 5 output positions
        return jnp.sum(conv_reference(x, p["kernel"], p["bias"], 1, "SAME") * error) / 50

    grads = jax.grad(loss)({"kernel": part.kernel, "bias": part.bias})
    _, _, state, _ = forward_backward(part, x, error)
    fed = state.opt_state  # the gradient the optimiser was fed, in the patch layout
    assert norm_rel_error(fed.weights[0].T.reshape(3, 3, 2, 3), grads["kernel"]) <= 1e-6
    assert norm_rel_error(fed.biases[0], grads["bias"]) <= 1e-6


def _train_scanned(part, xs, targets):
    """Squared-error losses of len(xs) local steps, in one compiled scan (no pipeline)."""
    core = part.compile("")

    def body(state, batch):
        x, target = batch
        y, cache = core.forward(state, x, CTX)
        _, state, _ = core.backward(state, cache, y - target, CTX)
        return state, 0.5 * jnp.mean(jnp.sum((y - target) ** 2, axis=(1, 2, 3)))

    _, losses = jax.jit(lambda s: jax.lax.scan(body, s, (xs, targets)))(
        part.init_state(jax.random.key(0)))
    return np.asarray(losses)


def test_the_three_learning_kinds_lower_the_loss():
    teacher = normal(19, (3, 3, 2, 3)) / 3.0
    xs = normal(20, (12, 4, 6, 6, 2))
    targets = jax.vmap(lambda x: conv_reference(x, teacher, None, 1, "SAME"))(xs)
    settings = {
        "precision_weighted": (optax.sgd(0.05), None),
        "standard": (optax.sgd(0.05), None),
        "synaptic_uncertainty": (None, {"window": 8, "learning_rate": 0.05}),
    }
    curves = {}
    for kind, (optimiser, kwargs) in settings.items():
        part = LearningConv2d(2, 3, 3, optimiser, kind, kwargs, key=jax.random.key(21))
        curves[kind] = _train_scanned(part, xs, targets)
        assert curves[kind][-1] < 0.5 * curves[kind][0], (kind, curves[kind])
    # one matrix at unit output precision: standard steps by u = E, as precision_weighted
    # (rtol: the two kinds compile to different programs, rounded differently)
    np.testing.assert_allclose(curves["standard"], curves["precision_weighted"], rtol=1e-5)
    assert not np.allclose(curves["synaptic_uncertainty"], curves["precision_weighted"])


# --------------------------------------------------------------------------- shapes set
def test_make_shapes_is_deterministic_balanced_and_checked():
    images, labels = make_shapes(12, 8, seed=3, classes=SHAPES, noise=0.0)
    assert images.shape == (12, 8, 8, 1) and images.dtype == np.float32
    assert labels.dtype == np.int32 and np.bincount(labels).tolist() == [2] * 6
    assert set(np.unique(images).tolist()) == {0.0, 1.0}
    assert all(images[i].sum() > 0 for i in range(12))  # every image shows its shape
    again = make_shapes(12, 8, seed=3, classes=SHAPES, noise=0.0)
    np.testing.assert_array_equal(images, again[0])
    np.testing.assert_array_equal(labels, again[1])
    assert not np.array_equal(images, make_shapes(12, 8, seed=4, classes=SHAPES, noise=0.0)[0])
    assert "distinct names" in _message(lambda: make_shapes(4, seed=0, classes=("star",)))
    assert "size must be" in _message(lambda: make_shapes(4, 3, seed=0))


# --------------------------------------------------------------------------- a VGG-style net
def vgg(key, optimiser, size=8, channels=4, classes=4):
    """conv-relu-conv-relu-maxpool-flatten-linear, every conv and the head learning."""
    k1, k2, k3 = jax.random.split(key, 3)
    width = (size // 2) ** 2 * channels
    head = fusedpc.LearningNetwork(
        fusedpc.PCNetwork([width, classes], (), key=k3), optimiser
    )
    return fusedpc.Sequential([
        LearningConv2d(1, channels, 3, optimiser, key=k1), frozen.relu(),
        LearningConv2d(channels, channels, 3, optimiser, key=k2), frozen.relu(),
        conv.max_pool(2), conv.flatten(), head,
    ])


def vgg_params(tree):
    first, second, head = tree.parts[0], tree.parts[2], tree.parts[6].network
    return {"k1": first.kernel, "b1": first.bias, "k2": second.kernel, "b2": second.bias,
            "w": head.weights[0], "b": head.biases[0]}


def vgg_twin(p, x):
    """The plain-JAX twin of `vgg`: the same weights, autodiff does the rest."""
    h = jax.nn.relu(conv_reference(x, p["k1"], p["b1"], 1, "SAME"))
    h = jax.nn.relu(conv_reference(h, p["k2"], p["b2"], 1, "SAME"))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return h.reshape(h.shape[0], -1) @ p["w"].T + p["b"]


def vgg_parity(steps: int = 30, batch: int = 16) -> dict:
    """The VGG-style net trained fused and its twin by `jax.grad`, SGD, `steps` steps: the
    largest loss-curve gap, the twin's own fall, every weight's norm-relative distance after
    training, and the report's parts and sizes."""
    images, labels = make_shapes(steps * batch, 8, seed=0)
    xs, ys = images.reshape(steps, batch, 8, 8, 1), labels.reshape(steps, batch)
    optimiser = optax.sgd(0.1)
    tree = vgg(jax.random.key(22), optimiser)
    pipeline = fusedpc.FusedPipeline(tree, "softmax_cross_entropy")
    _, _, metrics = pipeline.run(xs, ys, keep_outputs=False)
    fused = np.asarray(metrics.loss)

    def loss(p, x, y):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(vgg_twin(p, x), y))

    @jax.jit
    def step(p, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    params = vgg_params(tree)
    opt_state, twin = optimiser.init(params), []
    for x, y in zip(xs, ys, strict=True):
        params, opt_state, value = step(params, opt_state, x, y)
        twin.append(float(value))
    twin = np.asarray(twin)
    learned = vgg_params(pipeline.merge())
    return {
        "twin_fall": float(twin[0] - twin[-5:].mean()),
        "curve_gap": float(np.max(np.abs(fused - twin))),
        "weights": {name: float(norm_rel_error(learned[name], params[name])) for name in params},
        "rows": [(row["part"], row["layer_sizes"]) for row in pipeline.report()],
    }


def _assert_vgg_parity(figures: dict, fall: float) -> None:
    assert figures["twin_fall"] > fall, figures  # the shapes are really being learned
    assert figures["curve_gap"] <= 1e-3, figures
    assert all(error <= 1e-5 for error in figures["weights"].values()), figures
    parts = [part for part, _ in figures["rows"]]
    assert parts == ["parts[0]", "parts[2]", "parts[6]"], figures
    assert [list(sizes) for _, sizes in figures["rows"][:2]] == [[9, 4], [36, 4]], figures


def test_vgg_trains_fused_and_follows_the_backprop_loss_curve():
    _assert_vgg_parity(vgg_parity(), fall=0.3)


@pytest.mark.slow
def test_vgg_parity_at_xla_default_optimisation_level():
    # A fresh process without the suite's level-0 flag (tests/conftest.py): XLA's fusions
    # there reorder the float32 arithmetic of both the fused step and the twin.
    _assert_vgg_parity(run_at_default_level(__file__), fall=0.3)


if __name__ == "__main__":  # the default-level check above runs this file as a script
    print(json.dumps(vgg_parity()))
