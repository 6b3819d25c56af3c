"""Global gradient-norm clipping across parts (`clip_global_norm`).

Every learning part runs its own optimiser, so `optax.clip_by_global_norm` inside a part's
optimiser clips by that part's norm only. `clip_global_norm=c` clips every optax-driven
part's gradient by the global norm over all of them, before the optimisers, as a backprop
step with `optax.chain(optax.clip_by_global_norm(c), optimiser)` does: the parity claims
below are against that twin.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import norm_rel_error, normal

import fusedpc
from fusedpc import frozen
from fusedpc.transformer.reference import cross_entropy

PARITY_TOLERANCE = 1e-5  # norm-relative, float32: the learning parts' parity gate
CLIP = 0.05


def _two_networks(optimiser):
    a = fusedpc.PCNetwork([4, 6, 5], "tanh", key=jax.random.key(1))
    b = fusedpc.PCNetwork([5, 4, 3], "tanh", key=jax.random.key(2))
    tree = fusedpc.Sequential([
        fusedpc.LearningNetwork(a, optimiser),
        frozen.tanh(),
        fusedpc.LearningNetwork(b, optimiser),
    ])
    params = {
        "a": {"w": list(a.weights), "b": list(a.biases)},
        "b": {"w": list(b.weights), "b": list(b.biases)},
    }
    return tree, params


def _mlp(p, x):
    for i, (w, b) in enumerate(zip(p["w"], p["b"], strict=True)):
        x = x @ w.T + b
        if i < len(p["w"]) - 1:
            x = jnp.tanh(x)
    return x


def _loss(params, x, t):
    y = _mlp(params["b"], jnp.tanh(_mlp(params["a"], x)))
    return jnp.mean(0.5 * jnp.sum((y - t) ** 2, axis=-1))


def _fused_params(pipeline):
    """Host copies (the live buffers are donated to the next step)."""
    parts = pipeline.state.parts
    return {
        name: {
            "w": [np.array(w) for w in parts[i].params.weights],
            "b": [np.array(b) for b in parts[i].params.biases],
        }
        for name, i in (("a", 0), ("b", 2))
    }


def _global_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)))
                             for g in jax.tree_util.tree_leaves(tree))))


@pytest.mark.gpu_parity
@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.slow
def test_every_step_equals_the_twin_with_clip_by_global_norm(name):
    optimiser = {"sgd": optax.sgd(0.5), "adam": optax.adam(1e-2)}[name]
    tree, params = _two_networks(optimiser)
    pipeline = fusedpc.FusedPipeline(tree, clip_global_norm=CLIP)
    twin = optax.chain(optax.clip_by_global_norm(CLIP), optimiser)
    twin_state = twin.init(params)
    grad = jax.jit(jax.grad(_loss))
    clipped_steps = 0
    for step in range(6):
        x, t = normal(10 + step, (8, 4)), normal(20 + step, (8, 3))
        before = _fused_params(pipeline)
        pipeline.step(x, t)
        g = grad(params, x, t)
        clipped_steps += int(_global_norm(g) > CLIP)
        with jax.numpy_dtype_promotion("standard"):
            updates, twin_state = twin.update(g, twin_state, params)
        new = optax.apply_updates(params, updates)
        got = _fused_params(pipeline)
        for part in ("a", "b"):
            for kind in ("w", "b"):
                for layer, (f, r, o) in enumerate(
                    zip(got[part][kind], new[part][kind], before[part][kind], strict=True)
                ):
                    err = norm_rel_error(f - o, np.asarray(r) - o)
                    assert err <= PARITY_TOLERANCE, (name, step, part, kind, layer, err)
        params = new
    assert clipped_steps >= 3  # the bound really clipped


def test_per_part_clipping_is_not_global_clipping():
    # The reason for the option: clip_by_global_norm inside each part's optimiser clips by
    # that part's own norm, a different (and, for the twin, wrong) step.
    x, t = normal(10, (8, 4)), normal(20, (8, 3))
    local = optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(0.5))
    per_part = fusedpc.FusedPipeline(_two_networks(local)[0])
    global_ = fusedpc.FusedPipeline(_two_networks(optax.sgd(0.5))[0], clip_global_norm=CLIP)
    per_part.step(x, t)
    global_.step(x, t)
    a, b = _fused_params(per_part), _fused_params(global_)
    assert norm_rel_error(a["a"]["w"][0], b["a"]["w"][0]) > 1e-4


def _clipped_twin(model, optimiser, batches):
    """The backprop twin: `clip_by_global_norm(0.1)` then `optimiser`, on `batches`, in the
    dtype of `model`'s arrays."""
    twin = optax.chain(optax.clip_by_global_norm(0.1), optimiser)
    state = twin.init(eqx.filter(model, eqx.is_array))
    for x, t in batches:
        g = eqx.filter_grad(lambda m, x=x, t=t: cross_entropy(m(x), t))(model)
        assert _global_norm(g) > 0.1  # clipped
        updates, state = twin.update(g, state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
    return model


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.gpu_parity)])
@pytest.mark.slow
def test_a_gpt_with_global_clipping_follows_its_twin(scan):
    config = fusedpc.GPTConfig(
        vocab_size=11, width=16, n_heads=4, n_blocks=2, ff_width=32, max_len=8, learn="all",
        scan=scan,
    )
    optimiser = optax.sgd(0.5)
    part, reference = fusedpc.build_gpt(config, optimiser, jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(part, config.error_fn, clip_global_norm=0.1)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        ids = rng.integers(0, 11, (3, 9)).astype(np.int32)
        batches.append((jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])))
        pipeline.step(*batches[-1])
    model = _clipped_twin(reference, optimiser, batches)
    with jax.enable_x64(True):
        wide = jax.tree_util.tree_map(
            lambda a: jnp.asarray(a, jnp.float64) if eqx.is_inexact_array(a) else a, reference)
        model64 = _clipped_twin(wide, optimiser, batches)
        leaves64 = [np.asarray(a) for a in
                    jax.tree_util.tree_leaves(eqx.filter(model64, eqx.is_array))]
    got = fusedpc.to_reference(pipeline.merge(), reference)
    leaves = zip(
        jax.tree_util.tree_leaves_with_path(eqx.filter(got, eqx.is_array)),
        jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array)),
        leaves64,
        jax.tree_util.tree_leaves(eqx.filter(reference, eqx.is_array)),
        strict=True,
    )
    for (path, a), (_, b), c, o in leaves:
        o = np.asarray(o, np.float64)
        change_got, change_want = np.asarray(a, np.float64) - o, np.asarray(b, np.float64) - o
        change_exact = c - o
        if np.linalg.norm(change_want) == 0:  # the key bias: exactly 0 in the twin
            assert np.max(np.abs(change_got)) <= 1e-6
            continue
        # the GPT's float32 floor, as for its unclipped parity (tests/transformer/test_gpt.py);
        # where float32 itself is further off (a small change, a LayerNorm weight's, after
        # three steps at rate 0.5, whose w + delta rounds in float32), the fused step must be
        # no further from the float64 twin than float32 backprop is, up to a factor 2 (two
        # roundings of the same size in different orders, as in test_options.py)
        to_float32 = norm_rel_error(change_got, change_want)
        to_float64 = norm_rel_error(change_got, change_exact)
        float32_to_float64 = norm_rel_error(change_want, change_exact)
        assert to_float32 <= 1e-4 or to_float64 <= 2.0 * float32_to_float64, (
            jax.tree_util.keystr(path), to_float32, to_float64, float32_to_float64)


def test_clip_setting_is_checked():
    tree = _two_networks(optax.sgd(0.1))[0]
    with pytest.raises(ValueError, match="clip_global_norm: expected None or a finite number > 0"):
        fusedpc.FusedPipeline(tree, clip_global_norm=0.0)
    assert "clip_global_norm=1.0" in repr(fusedpc.make_step(tree, clip_global_norm=1.0))


def test_fusedpc_train_clip_sets_global_clipping():
    from fusedpc.training import _config_file, _setup

    config = _config_file.resolve_config(None, {"clip": 1.0, "width": 16, "n_heads": 2,
                                                "n_blocks": 1, "ff_width": 32, "max_len": 8})
    assert _setup.build_pipeline(config, 11).program.clip_global_norm == 1.0
    assert _setup.build_pipeline(
        _config_file.resolve_config(None, {"width": 16, "n_heads": 2, "n_blocks": 1,
                                           "ff_width": 32, "max_len": 8}), 11
    ).program.clip_global_norm is None
    with pytest.raises(ValueError, match="clip must be a finite number >= 0"):
        _config_file.resolve_config(None, {"clip": -1.0})
    with pytest.raises(ValueError, match="synaptic_uncertainty' has none"):
        _config_file.resolve_config(
            None, {"clip": 1.0, "learning_kind": "synaptic_uncertainty", "window": 10}
        )
