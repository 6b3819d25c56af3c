"""The GPT part: exactness against the backprop twin, scanned blocks, builders, generation."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.training import data
from fusedpc.transformer._reference_maths import layer_norm, linear
from fusedpc.transformer.reference import GPT, cross_entropy, make_backprop_step

TINY = {"vocab_size": 11, "width": 16, "n_heads": 4, "n_blocks": 2, "ff_width": 32, "max_len": 8}


def _ids(key, shape, vocab):
    return jax.random.randint(key, shape, 0, vocab, dtype=jnp.int32)


def _norm_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.linalg.norm(b)
    return np.linalg.norm(a - b) / max(scale, 1e-30)


def _array_leaves(model):
    return jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))


def _char_batches(n_steps, batch, seq, seed=0):
    text = data.load_text()[:4000]
    tok = data.CharTokenizer.from_text(text)
    it = data.BatchIterator(tok.encode(text), batch, seq, seed=seed)
    xs, ys = it.next_batches(n_steps)
    return tok.vocab_size, np.asarray(xs, np.int32), np.asarray(ys, np.int32)


@pytest.mark.gpu_parity
def test_all_frozen_gpt_reproduces_reference_logits(key):
    reference = GPT(**TINY, key=key)
    pipeline = fusedpc.FusedPipeline(fusedpc.hybrid_from_gpt(reference), "softmax_cross_entropy")
    ids = _ids(jax.random.key(1), (3, 8), TINY["vocab_size"])
    np.testing.assert_allclose(pipeline.predict(ids), reference(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu_parity
@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("head_kind", ["gaussian", "categorical"])
@pytest.mark.slow
def test_every_weight_learning_one_sgd_step_equals_backprop(key, fused_qkv, head_kind):
    config = fusedpc.GPTConfig(**TINY, learn="all", fused_qkv=fused_qkv, head_kind=head_kind)
    optimiser = optax.sgd(0.5)
    part, reference = fusedpc.build_gpt(config, optimiser, key)
    ids = _ids(jax.random.key(1), (3, 8), TINY["vocab_size"])
    targets = _ids(jax.random.key(2), (3, 8), TINY["vocab_size"])

    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    pipeline.step(ids, targets)
    learned = fusedpc.to_reference(pipeline.merge(), reference)

    params = eqx.filter(reference, eqx.is_array)
    grads = eqx.filter_grad(lambda m: cross_entropy(m(ids), targets))(reference)
    updates, _ = optimiser.update(grads, optimiser.init(params), params)
    twin = eqx.apply_updates(reference, updates)

    before = dict(_array_leaves(reference))
    checked = 0
    for (path, got), (_, want) in zip(_array_leaves(learned), _array_leaves(twin), strict=True):
        change_got = np.asarray(got) - np.asarray(before[path])
        change_want = np.asarray(want) - np.asarray(before[path])
        if path[-2:] == (jax.tree_util.GetAttrKey("wk"), jax.tree_util.GetAttrKey("bias")):
            # the key bias adds the same score to every column of a softmax row: its gradient
            # is exactly zero in the twin, and float32 rounding in ours
            assert np.max(np.abs(change_got)) <= 1e-6
        else:
            assert np.linalg.norm(change_want) > 0, jax.tree_util.keystr(path)
            assert _norm_rel(change_got, change_want) <= 1e-4, jax.tree_util.keystr(path)
        checked += 1
    # embeddings, 2 blocks x (4 attention weights+biases, 2 ff weights+biases, 2 LN x 2), norm, head
    assert checked == 2 + 2 * (8 + 4 + 4) + 2 + 2


@pytest.mark.gpu_parity
@pytest.mark.slow
def test_input_error_is_per_row_gradient_of_the_summed_loss(key):
    config = fusedpc.GPTConfig(**TINY, learn="all")
    part, reference = fusedpc.build_gpt(config, optax.sgd(0.0), key)
    ids = _ids(jax.random.key(1), (2, 8), TINY["vocab_size"])
    targets = _ids(jax.random.key(2), (2, 8), TINY["vocab_size"])
    _, input_error = fusedpc.FusedPipeline(part, config.error_fn).step(ids, targets)

    def loss_from_embedding(embedded):
        h = embedded
        for block in reference.blocks:
            h = block(h)
        logits = linear(reference.head, layer_norm(reference.norm_f, h))
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    embedded = reference.tok_emb.weight[ids] + reference.pos_emb.weight[jnp.arange(8)][None]
    want = jax.grad(loss_from_embedding)(embedded)
    assert _norm_rel(input_error, want) <= 1e-5


@pytest.mark.gpu_parity
@pytest.mark.parametrize("learn_norms", [True, False])
@pytest.mark.slow
def test_hundred_sgd_steps_follow_the_backprop_loss_curve(key, learn_norms):
    vocab, xs, ys = _char_batches(100, 4, 16)
    slots = ("token", "position", "attention", "feed_forward", "head")
    if learn_norms:
        slots += ("norm",)
    config = fusedpc.GPTConfig(
        vocab_size=vocab, width=16, n_heads=2, n_blocks=2, ff_width=32, max_len=16, learn=slots
    )
    optimiser = optax.sgd(0.1)
    part, reference = fusedpc.build_gpt(config, optimiser, key)
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    _, _, metrics = pipeline.run(xs, ys, keep_outputs=False)
    fused_losses = np.asarray(metrics.loss)

    step = make_backprop_step(optimiser, frozen_layer_norm=not learn_norms)
    model = reference
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    twin_losses = []
    for x, y in zip(xs, ys, strict=True):
        model, opt_state, loss = step(model, opt_state, jnp.asarray(x), jnp.asarray(y))
        twin_losses.append(float(loss))
    twin_losses = np.asarray(twin_losses)
    assert twin_losses[-1] < twin_losses[0] - 0.3  # the task is really being learned
    assert np.max(np.abs(fused_losses - twin_losses)) <= 1e-3


@pytest.mark.slow
def test_scanned_gpt_equals_unrolled(key):
    ids = _ids(jax.random.key(1), (3, 8), TINY["vocab_size"])
    targets = _ids(jax.random.key(2), (3, 8), TINY["vocab_size"])
    results = []
    for scan in (True, False):
        config = fusedpc.GPTConfig(**TINY, learn="all", scan=scan)
        # SGD: Adam would turn float32 noise in the (exactly zero) key-bias gradient into
        # full-size steps, differently for any two summation orders
        part, reference = fusedpc.build_gpt(config, optax.sgd(0.5), key)
        pipeline = fusedpc.FusedPipeline(part, config.error_fn)
        outs = [pipeline.step(ids, targets)[0] for _ in range(3)]
        results.append((outs, fusedpc.to_reference(pipeline.merge(), reference)))
    assert isinstance(fusedpc.build_gpt(fusedpc.GPTConfig(**TINY), None, key)[0].blocks,
                      fusedpc.Repeat)
    for a, b in zip(results[0][0], results[1][0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for (path, a), (_, b) in zip(_array_leaves(results[0][1]), _array_leaves(results[1][1]),
                                 strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_scan_auto_unrolls_few_blocks_and_scans_many(key):
    from fusedpc.transformer._stacking import AUTO_UNROLL_BLOCKS

    def blocks(n_blocks, **kw):
        config = fusedpc.GPTConfig(**{**TINY, "n_blocks": n_blocks}, **kw)
        return fusedpc.build_gpt(config, None, key)[0].blocks

    assert fusedpc.GPTConfig().scan == "auto"
    few, many = blocks(AUTO_UNROLL_BLOCKS), blocks(AUTO_UNROLL_BLOCKS + 1)
    assert isinstance(few, fusedpc.Repeat) and few.unroll
    assert isinstance(many, fusedpc.Repeat) and not many.unroll
    assert not blocks(2, scan=True).unroll
    assert isinstance(blocks(2, scan=False), fusedpc.transformer.Blocks)
    # the unrolled Repeat keeps the scanned one's state layout: its states load into it
    scanned = fusedpc.FusedPipeline(blocks(2, scan=True))
    unrolled = fusedpc.FusedPipeline(blocks(2))
    assert jax.tree_util.tree_structure(scanned.state) == jax.tree_util.tree_structure(
        unrolled.state
    )
    with pytest.raises(ValueError, match="scan must be True, False or 'auto', got 'yes'"):
        fusedpc.GPTConfig(**TINY, scan="yes").validate()
    gpt = fusedpc.transformer.reference.GPT(11, 16, 4, 1, 32, 8, key=key)
    with pytest.raises(ValueError, match="scan must be True, False or 'auto', got 'never'"):
        fusedpc.hybrid_from_gpt(gpt, scan="never")


def _step_equations(n_blocks, scan=True):
    config = fusedpc.GPTConfig(**{**TINY, "n_blocks": n_blocks}, learn="all", scan=scan)
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    ids = jnp.zeros((2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(pipeline.program.step)(pipeline.carry, ids, ids)
    return len(jaxpr.jaxpr.eqns)


@pytest.mark.slow
def test_step_trace_does_not_grow_with_blocks():
    one, eight, sixteen = _step_equations(1), _step_equations(8), _step_equations(16)
    assert sixteen == one
    # at 8 blocks one fewer: a stacked (8, 16) leaf then has the (8, 16) position table's
    # shape, and leaves of one shape share one sum-of-squares reduction (sums_of_squares)
    assert eight <= one
    # the unrolled variant does grow, so the count is a real measure of the trace
    assert _step_equations(4, scan=False) > _step_equations(1, scan=False)


@pytest.mark.slow
def test_hybrid_with_feed_forward_and_head_learning_lowers_the_loss(key):
    vocab, xs, ys = _char_batches(60, 8, 16, seed=3)
    config = fusedpc.GPTConfig(
        vocab_size=vocab, width=32, n_heads=2, n_blocks=1, ff_width=64, max_len=16, learn="ff_head"
    )
    part, _ = fusedpc.build_gpt(config, optax.adam(3e-3), key)
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    _, _, metrics = pipeline.run(xs, ys, keep_outputs=False)
    losses = np.asarray(metrics.loss)
    assert losses[-10:].mean() < losses[:10].mean() - 0.5
    learning_parts = {row["part"] for row in pipeline.report()}
    assert learning_parts == {"blocks[0].feed_forward", "head"}


@pytest.mark.slow
def test_report_names_every_learning_slot_in_forward_order(key):
    config = fusedpc.GPTConfig(**TINY, learn="all")
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), key)
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    ids = _ids(jax.random.key(1), (2, 8), TINY["vocab_size"])
    pipeline.step(ids, ids)
    names = [row["part"] for row in pipeline.report()]
    block = ["n1", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "n2",
             "feed_forward"]
    expected = (["token", "position"] + [f"blocks[{i}].{n}" for i in range(2) for n in block]
                + ["norm_f", "head"])
    assert names == expected
    assert all(row["finite"] and row["update_norm"] > 0 for row in pipeline.report())


def test_generation_is_deterministic_and_greedy_at_zero_temperature(key):
    config = fusedpc.GPTConfig(**TINY, learn="none")
    part, reference = fusedpc.build_gpt(config, None, key)
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    prompt = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    a = fusedpc.generate(pipeline, prompt, 12, temperature=1.0, key=jax.random.key(7))
    b = fusedpc.generate(pipeline, prompt, 12, temperature=1.0, key=jax.random.key(7))
    c = fusedpc.generate(pipeline, prompt, 12, temperature=1.0, key=jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 15)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(a[:, :3], prompt)

    greedy = fusedpc.generate(pipeline, prompt, 12, temperature=0.0, key=jax.random.key(9))
    # reference greedy decoding with a sliding window of max_len tokens (jitted: run eagerly,
    # its six window lengths dispatched op by op took most of this test's time)
    forward = eqx.filter_jit(reference)
    seq = prompt.copy()
    for _ in range(12):
        window = seq[:, -TINY["max_len"]:]
        logits = forward(jnp.asarray(window))
        seq = np.concatenate([seq, np.asarray(jnp.argmax(logits[:, -1], -1))[:, None]], 1)
    np.testing.assert_array_equal(greedy, seq)


def test_bad_token_ids_are_refused_before_compiling(key):
    config = fusedpc.GPTConfig(**TINY)
    part, _ = fusedpc.build_gpt(config, optax.sgd(0.1), key)
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    good = np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 11\), got 11"):
        pipeline.step(np.full((2, 8), 11, np.int32), good)
    with pytest.raises(ValueError, match="sequence length 9 exceeds the position table's 8"):
        pipeline.step(np.zeros((2, 9), np.int32), np.zeros((2, 9), np.int32))
    with pytest.raises(TypeError, match="expected integer token ids, got dtype float32"):
        pipeline.step(np.zeros((2, 8), np.float32), good)
    with pytest.raises(ValueError, match=r"expected token ids of shape \(batch, seq\)"):
        pipeline.step(np.zeros((8,), np.int32), good[0])
    assert pipeline.steps == 0 and pipeline.trace_counts["step"] == 0


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="n_heads=3 must divide width=16"):
        fusedpc.build_gpt(fusedpc.GPTConfig(**{**TINY, "n_heads": 3}), None, jax.random.key(0))
    with pytest.raises(ValueError, match="unknown slots"):
        fusedpc.GPTConfig(**TINY, learn=("head", "wings")).validate()


@pytest.mark.slow
def test_slot_optimisers_give_a_slot_its_own_rate(key):
    config = fusedpc.GPTConfig(**TINY, learn="all")
    part, reference = fusedpc.build_gpt(
        config, optax.sgd(0.5), key, slot_optimisers={"head": optax.sgd(0.0)}
    )
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    ids = _ids(jax.random.key(1), (2, 8), TINY["vocab_size"])
    pipeline.step(ids, ids)
    rows = {row["part"]: row["update_norm"] for row in pipeline.report()}
    assert rows["head"] == 0.0 and rows["blocks[0].feed_forward"] > 0.0
    with pytest.raises(ValueError, match=r"slot_optimisers has unknown slots \['wings'\]"):
        fusedpc.build_gpt(config, optax.sgd(0.5), key, slot_optimisers={"wings": None})


def test_generate_checks_every_argument_by_name(key):
    config = fusedpc.GPTConfig(**TINY)
    part, _ = fusedpc.build_gpt(config, optax.sgd(0.1), key)
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    prompt = np.zeros((1, 3), np.int32)
    cases = [
        (dict(n_new=2.7), TypeError, r"n_new must be an integer number of tokens, got 2.7"),
        (dict(n_new="5"), TypeError, r"n_new must be an integer number of tokens, got '5'"),
        (dict(n_new=0), ValueError, r"n_new must be >= 1, got 0"),
        (dict(n_new=2, temperature=float("nan")), ValueError, r"finite number >= 0.*got nan"),
        (dict(n_new=2, temperature=-1.0), ValueError, r"finite number >= 0.*got -1.0"),
        (dict(n_new=2, temperature="hot"), TypeError, r"temperature must be a number"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            fusedpc.generate(pipeline, prompt, **kwargs)
    with pytest.raises(TypeError, match="prompt_ids must be integer token ids, got dtype float"):
        fusedpc.generate(pipeline, prompt.astype(np.float32), 2)
    # A prompt longer than the position table: the model sees its last max_len tokens.
    long = np.arange(TINY["max_len"] + 3, dtype=np.int32)[None] % TINY["vocab_size"]
    out = fusedpc.generate(pipeline, long, 2, temperature=0.0)
    assert out.shape == (1, TINY["max_len"] + 5)
    np.testing.assert_array_equal(np.asarray(out[:, : long.shape[1]]), long)
    tail = fusedpc.generate(pipeline, long[:, -TINY["max_len"]:], 2, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out[:, -2:]), np.asarray(tail[:, -2:]))


def _per_block_optimisers(gpt, shared):
    from fusedpc import transplant

    one = optax.adam(1e-3)

    def ff(i):
        # not shared: one per block, and block 3's rate differs (equal settings made per
        # block would stack: tests/transformer/test_stacking.py)
        optimiser = one if shared else optax.adam(2e-3 if i == 3 else 1e-3)
        return transplant.from_feedforward(gpt.blocks[i].ff.fc1, gpt.blocks[i].ff.fc2,
                                           optimiser=optimiser)

    return ff


def test_blocks_that_cannot_be_scanned_are_said_with_the_field_that_differs():
    gpt = GPT(11, 16, 2, 6, 32, 8, key=jax.random.key(0))  # 6 blocks: scanned by default
    with pytest.warns(UserWarning, match=r"the 6 blocks run as an unscanned chain") as caught:
        part = fusedpc.hybrid_from_gpt(gpt, ff_parts=_per_block_optimisers(gpt, False))
    assert isinstance(part.blocks, fusedpc.Blocks)
    message = str(caught[0].message)
    assert "block 3 is not structurally identical to block 0" in message
    assert "first difference at .feed_forward.optimiser" in message
    assert "Pass one optimiser object" in message and "learn=" in message
    with pytest.raises(ValueError, match=r"hybrid_from_gpt\(scan=True\): the blocks cannot"):
        fusedpc.hybrid_from_gpt(gpt, ff_parts=_per_block_optimisers(gpt, False), scan=True)
    shared = fusedpc.hybrid_from_gpt(gpt, ff_parts=_per_block_optimisers(gpt, True))
    assert isinstance(shared.blocks, fusedpc.Repeat) and not shared.blocks.unroll
