"""Parts as equinox layers: `part(x)` and `fusedpc.as_module(part)` run the forward inside
ordinary equinox code (under `eqx.filter_jit`, `jax.vmap`, `eqx.partition`); a trained tree
equals `pipeline.predict`; a part whose weights are drawn at `init_state` needs a key."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, linear_params, normal

import fusedpc
from fusedpc import frozen
from fusedpc.core import PartModule, as_module, state_drawn_from_key

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

X = normal(0, (6, 4))


class Model(eqx.Module):
    """An equinox model of the user's: a linear, a fusedpc part as a layer, a linear."""

    first: eqx.nn.Linear
    middle: eqx.Module
    last: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.last)(self.middle(jax.vmap(self.first)(x)))


class Rows(eqx.Module):
    """A one-example equinox layer applied to every row, as a layer of `eqx.nn.Sequential`."""

    layer: eqx.nn.Linear

    def __call__(self, x, *, key=None):
        return jax.vmap(self.layer)(x)


def _forward(part, x):
    return part.compile("").forward(part.init_state(jax.random.key(0)), x, CTX)[0]


def _untrained_tree() -> fusedpc.AbstractPart:
    # The PCNetwork has no weights: they are drawn when the state is initialised.
    network = fusedpc.PCNetwork([5, 6, 5], "tanh")
    return fusedpc.Sequential(
        [frozen.layer_norm(width=5), fusedpc.LearningNetwork(network, optax.sgd(0.1))]
    )


def test_a_part_is_a_layer_of_an_equinox_model_also_under_filter_jit():
    k1, k2 = jax.random.split(jax.random.key(1))
    part = fusedpc.Sequential([frozen.linear(*linear_params(2, 5, 5)), frozen.tanh()])
    first, last = eqx.nn.Linear(4, 5, key=k1), eqx.nn.Linear(5, 3, key=k2)
    hidden = jax.vmap(first)(X)
    want = jax.vmap(last)(_forward(part, hidden))
    for middle in (part, as_module(part)):
        model = Model(first, middle, last)
        np.testing.assert_array_equal(np.asarray(model(X)), np.asarray(want))
        # Fusion under jit reorders float32 arithmetic: a few ulps.
        assert_tree_allclose(eqx.filter_jit(Model.__call__)(model, X), want, rtol=1e-6, atol=1e-7)
        # eqx.nn.Sequential hands every layer a key; the part takes it and ignores it.
        chain = eqx.nn.Sequential([Rows(first), middle, Rows(last)])
        np.testing.assert_array_equal(
            np.asarray(chain(X, key=jax.random.key(9))), np.asarray(want)
        )


def test_a_merged_tree_called_equals_predict_and_the_untrained_one_needs_a_key():
    tree = _untrained_tree()
    x = normal(3, (6, 5))
    assert state_drawn_from_key(tree)
    with pytest.raises(ValueError, match=r"drawn from the PRNG key .* Pass as_module\(part, key="):
        tree(x)
    with pytest.raises(ValueError, match="as_module: the state of this Sequential"):
        as_module(tree)
    key = jax.random.key(5)
    pipeline = fusedpc.FusedPipeline(tree, key=key)
    # The call is eager, predict jitted: float32 rounding apart.
    assert_tree_allclose(as_module(tree, key=key)(x), pipeline.predict(x), rtol=1e-6, atol=1e-7)

    for _ in range(3):
        pipeline.step(x, jnp.zeros_like(x))
    merged = pipeline.merge()
    assert not state_drawn_from_key(merged)
    predicted = pipeline.predict(x)
    assert_tree_allclose(merged(x), predicted, rtol=1e-6, atol=1e-7)
    module = as_module(merged)
    call = eqx.filter_jit(lambda m, inp: m(inp))
    assert_tree_allclose(call(module, x), predicted, rtol=1e-6, atol=1e-7)
    assert not bool(jnp.allclose(call(module, x), as_module(tree, key=key)(x)))  # it trained


def test_the_module_arrays_are_the_state_and_modules_of_equal_parts_vmap():
    parts = [frozen.linear(*linear_params(seed, 4, 3)) for seed in (10, 20)]
    modules = [as_module(part) for part in parts]
    arrays, _ = eqx.partition(modules[0], eqx.is_array)
    state_leaves = jax.tree_util.tree_leaves(parts[0].init_state(jax.random.key(0)))
    assert jax.tree_util.tree_leaves(arrays) == state_leaves  # the very buffers, nothing else
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *modules)
    xs = jnp.stack([X, 2.0 * X])
    got = jax.vmap(lambda m, x: m(x))(stacked, xs)
    for i, part in enumerate(parts):
        assert_tree_allclose(got[i], _forward(part, xs[i]), rtol=1e-6, atol=1e-7)


def test_an_init_state_that_cannot_be_traced_is_checked_on_two_keys():
    class HostDrawn(fusedpc.AbstractPart):
        """A user part whose init_state reads the key's value on the host."""

        def init_state(self, key):
            return {"scale": jnp.asarray(float(jax.random.uniform(key)), jnp.float32)}

        def compile(self, path):
            def forward(state, x):
                return x * state["scale"], None

            return fusedpc.Core(forward, lambda s, c, e: (e * s["scale"], s, None), lambda s: self)

    assert state_drawn_from_key(HostDrawn())
    assert not state_drawn_from_key(frozen.tanh())
    with pytest.raises(ValueError, match="HostDrawn is drawn from the PRNG key"):
        HostDrawn()(X)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match=r"as_module\(part\): expected a part"):
        as_module(eqx.nn.Linear(4, 3, key=jax.random.key(0)))
    with pytest.raises(TypeError, match=r"PartModule\(part\): expected a part"):
        PartModule(jnp.tanh, None)
    with pytest.raises(ValueError, match=r"<root>: expected input of shape \(\.\.\., 3\)"):
        frozen.linear(*linear_params(1, 3, 2))(X)


def test_a_part_is_refused_where_a_function_is_expected():
    # Parts are callable now; where a formula, an error function or a norm factory is
    # expected, a part is refused by name instead of failing later on its forward.
    part = frozen.tanh()
    with pytest.raises(TypeError, match="error_fn: got the part Frozen"):
        fusedpc.FusedPipeline(part, part)
    with pytest.raises(TypeError, match=r"Frozen\(forward, backward, params\).*got a part"):
        fusedpc.Frozen(part, lambda params, cache, error: error)
    config = fusedpc.GPTConfig(vocab_size=11, width=8, n_heads=2, n_blocks=1, ff_width=16,
                               max_len=4)
    _, reference = fusedpc.build_gpt(config, None, jax.random.key(0))
    with pytest.raises(TypeError, match="norm_parts must be a function from a reference norm"):
        fusedpc.hybrid_from_gpt(reference, norm_parts=frozen.layer_norm(width=8))
