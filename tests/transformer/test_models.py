"""Tests of the reference backprop GPT in `fusedpc.transformer.reference`."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from fusedpc.transformer.reference import GPT, count_flops, cross_entropy, make_backprop_step

V, W, H, L, F, MAX_LEN = 13, 16, 4, 2, 24, 8
B, T = 2, 6  # one batch shape throughout, so each compiled function is built once

# Eager op-by-op execution compiles every primitive for every new shape; jitting the calls
# keeps the suite fast.
_forward = eqx.filter_jit(lambda model, ids: model(ids))
_ADAM = optax.adam(1e-2)
_ADAM_STEP = make_backprop_step(_ADAM)


def _model(seed=0, **overrides):
    kwargs = dict(vocab_size=V, width=W, n_heads=H, n_blocks=L, ff_width=F, max_len=MAX_LEN)
    kwargs.update(overrides)
    return GPT(**kwargs, key=jr.key(seed))


def _ids(batch, seq, seed=0, vocab=V):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


def _randomise_layer_norms(model, key):
    """Give every LayerNorm non-trivial affine parameters."""

    def perturb(node):
        if isinstance(node, eqx.nn.LayerNorm):
            nonlocal key
            key, kw, kb = jr.split(key, 3)
            return eqx.tree_at(
                lambda ln: (ln.weight, ln.bias),
                node,
                (1.0 + 0.3 * jr.normal(kw, node.shape), 0.3 * jr.normal(kb, node.shape)),
            )
        return node

    return jax.tree.map(perturb, model, is_leaf=lambda x: isinstance(x, eqx.nn.LayerNorm))


@eqx.filter_jit
def _reference_logits(model, ids):
    """Slow per-position forward pass through the Equinox modules themselves."""

    def one(row):
        seq = row.shape[0]
        h = jax.vmap(model.tok_emb)(row) + jax.vmap(model.pos_emb)(jnp.arange(seq))
        for block in model.blocks:
            attn = block.attn
            x = jax.vmap(block.n1)(h)
            q, k, v = (jax.vmap(lin)(x) for lin in (attn.wq, attn.wk, attn.wv))
            d = W // attn.n_heads
            heads = []
            for i in range(attn.n_heads):
                qi, ki, vi = (a[:, i * d : (i + 1) * d] for a in (q, k, v))
                rows = []
                for t in range(seq):
                    scores = ki[: t + 1] @ qi[t] / math.sqrt(d)
                    rows.append(jax.nn.softmax(scores) @ vi[: t + 1])
                heads.append(jnp.stack(rows))
            h = h + jax.vmap(attn.wo)(jnp.concatenate(heads, axis=-1))
            x = jax.vmap(block.n2)(h)
            hidden = jax.nn.gelu(jax.vmap(block.ff.fc1)(x), approximate=True)
            h = h + jax.vmap(block.ff.fc2)(hidden)
        return jax.vmap(model.head)(jax.vmap(model.norm_f)(h))

    return jax.vmap(one)(ids)


def test_attributes_and_shapes():
    model = _model()
    assert isinstance(model.tok_emb, eqx.nn.Embedding)
    assert model.tok_emb.weight.shape == (V, W)
    assert model.pos_emb.weight.shape == (MAX_LEN, W)
    assert isinstance(model.blocks, tuple) and len(model.blocks) == L
    block = model.blocks[0]
    for lin in (block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo):
        assert lin.weight.shape == (W, W) and lin.bias.shape == (W,)
    assert block.attn.n_heads == H
    assert block.ff.fc1.weight.shape == (F, W)
    assert block.ff.fc2.weight.shape == (W, F)
    assert isinstance(block.n1, eqx.nn.LayerNorm) and isinstance(block.n2, eqx.nn.LayerNorm)
    assert isinstance(model.norm_f, eqx.nn.LayerNorm)
    assert model.head.weight.shape == (V, W) and model.head.bias.shape == (V,)
    assert _forward(model, _ids(B, T)).shape == (B, T, V)
    assert _forward(model, _ids(1, MAX_LEN)).shape == (1, MAX_LEN, V)


@pytest.mark.slow
def test_matches_per_position_reference():
    model = _randomise_layer_norms(_model(1), jr.key(7))
    ids = _ids(B, T, seed=1)
    fast = _forward(model, ids)
    slow = _reference_logits(model, ids)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), rtol=1e-5, atol=1e-5)


def test_initial_loss_close_to_uniform():
    model = _model(2)
    ids = _ids(B, T, seed=2)
    loss = eqx.filter_jit(cross_entropy)(_forward(model, ids), ids)
    assert abs(float(loss) - math.log(V)) < 0.3


def test_causal():
    model = _model(3)
    ids = _ids(B, T, seed=3)
    changed = np.array(ids)
    changed[:, 4] = (changed[:, 4] + 1) % V
    a, b = _forward(model, ids), _forward(model, jnp.asarray(changed))
    np.testing.assert_array_equal(np.asarray(a[:, :4]), np.asarray(b[:, :4]))
    assert not np.allclose(np.asarray(a[:, 4:]), np.asarray(b[:, 4:]))


def test_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"(?s)18.*4"):
        _model(width=18, n_heads=4)


def test_sequence_longer_than_max_len():
    with pytest.raises(ValueError, match="max_len"):
        _model()(_ids(1, MAX_LEN + 1))


def test_cross_entropy_matches_optax():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, V)), jnp.float32)
    targets = _ids(B, T)

    @jax.jit
    def both(z, y):
        return cross_entropy(z, y), optax.softmax_cross_entropy_with_integer_labels(z, y).mean()

    got, expected = both(logits, targets)
    np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)


def _snapshot(tree):
    return [np.array(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _layer_norm_leaves(model):
    lns = [model.norm_f] + [ln for b in model.blocks for ln in (b.n1, b.n2)]
    return [np.array(a) for ln in lns for a in (ln.weight, ln.bias)]


def test_backprop_step_lowers_loss():
    model = _model(4)
    ids = np.tile(np.arange(T + 1, dtype=np.int32) % 5, (B, 1))
    inputs, targets = jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])
    opt_state = _ADAM.init(eqx.filter(model, eqx.is_array))
    step = _ADAM_STEP
    model, opt_state, first = step(model, opt_state, inputs, targets)
    for _ in range(30):
        model, opt_state, loss = step(model, opt_state, inputs, targets)
    assert float(loss) < 0.5 * float(first)


@pytest.mark.parametrize("frozen", [True, False])
def test_frozen_layer_norm(frozen):
    model = _model(5)
    inputs, targets = _ids(B, T, seed=5), _ids(B, T, seed=6)
    optimiser = optax.adamw(1e-2, weight_decay=0.1)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    step = make_backprop_step(optimiser, frozen_layer_norm=frozen)
    ln_before = _layer_norm_leaves(model)
    head_before = np.array(model.head.weight)
    for _ in range(3):
        model, opt_state, _ = step(model, opt_state, inputs, targets)
    ln_after = _layer_norm_leaves(model)
    same = [np.array_equal(a, b) for a, b in zip(ln_before, ln_after, strict=True)]
    if frozen:
        assert all(same)
        for a, b in zip(ln_before, ln_after, strict=True):
            assert a.tobytes() == b.tobytes()
    else:
        assert not any(same)
    assert not np.array_equal(head_before, np.array(model.head.weight))


def test_step_donates_model_and_opt_state_but_not_inputs():
    model = _model(6)
    inputs, targets = _ids(B, T, seed=7), _ids(B, T, seed=8)
    opt_state = _ADAM.init(eqx.filter(model, eqx.is_array))
    step = _ADAM_STEP
    new_model, new_opt_state, _ = step(model, opt_state, inputs, targets)
    assert all(x.is_deleted() for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert all(x.is_deleted() for x in jax.tree.leaves(opt_state))
    assert not inputs.is_deleted() and not targets.is_deleted()
    assert not any(x.is_deleted() for x in jax.tree.leaves(eqx.filter(new_model, eqx.is_array)))
    # The new model and state can be fed straight back in.
    step(new_model, new_opt_state, inputs, targets)


def test_count_flops():
    vocab, width, heads, blocks, ff, seq, batch = 50, 32, 4, 3, 128, 16, 8
    n = batch * seq
    forward = (
        blocks
        * (
            2 * n * width * 3 * width  # q, k, v
            + 2 * n * width * width  # o
            + 2 * n * width * ff * 2  # fc1, fc2
            + 2 * batch * seq * seq * width * 2  # scores and mix
        )
        + 2 * n * width * vocab
    )
    got = count_flops(vocab, width, heads, blocks, ff, seq, batch)
    assert isinstance(got, int)
    assert got == 3 * forward
    assert count_flops(vocab, width, heads, blocks, ff, seq, 2 * batch) == 2 * got
