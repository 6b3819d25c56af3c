"""Tests of the multi-head causal self-attention part (`fusedpc.parts._attention`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import DeltaLinear, assert_tree_allclose

import fusedpc
from fusedpc import frozen
from fusedpc.parts import AttentionCache, AttentionState, MultiHeadAttention
from fusedpc.parts._attention import DotProductAttentionCache
from fusedpc.parts._attention_mixing import (
    causal_mix,
    causal_mix_backward,
    causal_mix_backward_rows,
    causal_mix_dot_product,
    causal_mix_dot_product_backward_rows,
    causal_mix_tiles,
    causal_tiles_for,
)
from fusedpc.transformer.reference import CausalSelfAttention

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

B, T, D, H = 2, 5, 8, 2


def delta(lin: eqx.nn.Linear, optimiser) -> DeltaLinear:
    return DeltaLinear(lin.weight, lin.bias, optimiser)


def delta_fused(lins, optimiser) -> DeltaLinear:
    weight = jnp.concatenate([lin.weight for lin in lins], axis=0)
    bias = jnp.concatenate([lin.bias for lin in lins], axis=0)
    return DeltaLinear(weight, bias, optimiser)


# --------------------------------------------------------------------------- builders
def reference(seed=0, width=D, n_heads=H) -> CausalSelfAttention:
    return CausalSelfAttention(width, n_heads, key=jr.key(seed))


def frozen_attention(ref: CausalSelfAttention, fused: bool) -> MultiHeadAttention:
    if fused:
        weight = jnp.concatenate([ref.wq.weight, ref.wk.weight, ref.wv.weight], axis=0)
        bias = jnp.concatenate([ref.wq.bias, ref.wk.bias, ref.wv.bias], axis=0)
        return MultiHeadAttention(
            wqkv=frozen.linear(weight, bias), wo=frozen.linear(ref.wo), n_heads=ref.n_heads
        )
    return MultiHeadAttention(
        wq=frozen.linear(ref.wq),
        wk=frozen.linear(ref.wk),
        wv=frozen.linear(ref.wv),
        wo=frozen.linear(ref.wo),
        n_heads=ref.n_heads,
    )


# Learning slots: the tests' own delta-rule learner, or the library's learning part.
LEARNERS = {
    "delta": (delta, delta_fused, lambda part: part.weight),
    "transplant": (
        lambda lin, opt: fusedpc.transplant.from_linear(lin, optimiser=opt),
        lambda lins, opt: fusedpc.transplant.from_linears(lins, optimiser=opt),
        lambda part: part.network.weights[0],
    ),
}


def learning_attention(
    ref: CausalSelfAttention, fused: bool, optimiser, kind: str = "delta"
) -> MultiHeadAttention:
    single, stacked, _ = LEARNERS[kind]
    wo = single(ref.wo, optimiser)
    if fused:
        return MultiHeadAttention(
            wqkv=stacked([ref.wq, ref.wk, ref.wv], optimiser), wo=wo, n_heads=ref.n_heads
        )
    return MultiHeadAttention(
        wq=single(ref.wq, optimiser),
        wk=single(ref.wk, optimiser),
        wv=single(ref.wv, optimiser),
        wo=wo,
        n_heads=ref.n_heads,
    )


def batch(seed=1, shape=(B, T, D)) -> jax.Array:
    return jr.normal(jr.key(seed), shape)


def run_part(part, x, error):
    """`(core, state, y, (input_error, new_state, metrics))`, forward and backward in one jit."""
    core = part.compile("")
    state = part.init_state(jr.key(0))

    @jax.jit
    def both(state, x, error):
        y, cache = core.forward(state, x, CTX)
        return y, core.backward(state, cache, error, CTX)

    return core, state, *both(state, x, error)


# --------------------------------------------------------------------------- forward/backward
@pytest.mark.gpu_parity
@pytest.mark.parametrize("fused", [False, True])
def test_forward_matches_reference_attention(fused):
    ref = reference()
    x = batch()
    _, _, y, _ = run_part(frozen_attention(ref, fused), x, jnp.zeros_like(x))
    assert_tree_allclose(y, ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu_parity
@pytest.mark.parametrize("fused", [False, True])
def test_backward_matches_vjp(fused):
    part = frozen_attention(reference(), fused)
    x, error = batch(1), batch(2)
    core, state, _, (input_error, new_state, metrics) = run_part(part, x, error)
    _, vjp = jax.vjp(lambda inp: core.forward(state, inp, CTX)[0], x)
    (expected,) = vjp(error)
    assert_tree_allclose(input_error, expected, rtol=1e-4, atol=1e-5)
    assert metrics.names == (("wqkv", "wo") if fused else ("wq", "wk", "wv", "wo"))
    assert isinstance(new_state, AttentionState)


@pytest.mark.gpu_parity
def test_mixing_backward_matches_vjp_for_each_of_q_k_v():
    """The mixing's own errors dQ, dK, dV (not only their sum through the slots)."""
    q, k, v = (jr.normal(jr.key(i), (B, H, T, 4)) for i in range(3))
    d_context = jr.normal(jr.key(3), (B, H, T, 4))
    context, weights = causal_mix(q, k, v)
    _, vjp = jax.vjp(lambda a, b, c: causal_mix(a, b, c)[0], q, k, v)
    for got, want in zip(causal_mix_backward(q, k, v, weights, d_context), vjp(d_context)):
        assert_tree_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(jnp.sum(weights, axis=-1), jnp.ones((B, H, T)), rtol=1e-6)


@pytest.mark.parametrize("tiles", [2, pytest.param(4, marks=pytest.mark.gpu_parity), 3, 20])
@pytest.mark.slow
def test_causal_tiles_equal_the_whole_mixing_and_its_vjp(tiles):
    """Equal tiles (2, 4), uneven ones (3 over 8 rows: 2, 3, 3) and more tiles than rows (one
    per row)."""
    seq, heads, d = 8, 2, 4
    q, k, v = (jr.normal(jr.key(i), (B, heads, seq, d)) for i in range(3))
    d_context = jr.normal(jr.key(3), (B, heads, seq, d))
    context, weights = causal_mix(q, k, v)
    tiled_context, tiled_weights = causal_mix_tiles(q, k, v, tiles)
    assert_tree_allclose(tiled_context, context, rtol=1e-5, atol=1e-6)
    n = min(tiles, seq)
    bounds = [(i * seq // n, (i + 1) * seq // n) for i in range(n)]
    assert [w.shape for w in tiled_weights] == [(B, heads, b - a, b) for a, b in bounds]
    for (a, b), w in zip(bounds, tiled_weights):  # each tile: its rows of A, its key prefix
        assert_tree_allclose(w, weights[..., a:b, :b], rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(weights[..., a:b, b:]))

    def rows(a):
        return a.transpose(0, 2, 1, 3).reshape(B, seq, heads * d)

    got = causal_mix_backward_rows(rows(q), k, v, tiled_weights, rows(d_context), heads)
    _, vjp = jax.vjp(lambda a, b, c: causal_mix(a, b, c)[0], q, k, v)
    for g, want in zip(got, vjp(d_context), strict=True):
        assert_tree_allclose(g, rows(want), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_attention_part_in_causal_tiles_equals_one_tile():
    ref, seq = reference(), 8
    x, error = batch(1, (B, seq, D)), batch(2, (B, seq, D))
    runs = {}
    for tiles in (1, 2, 4, 3):
        part = frozen_attention(ref, False)
        part = MultiHeadAttention(
            wq=part.wq, wk=part.wk, wv=part.wv, wo=part.wo, n_heads=H, causal_tiles=tiles
        )
        runs[tiles] = run_part(part, x, error)
    for tiles in (2, 4, 3):
        assert_tree_allclose(runs[tiles][2], runs[1][2], rtol=1e-5, atol=1e-6)
        assert_tree_allclose(runs[tiles][3][0], runs[1][3][0], rtol=1e-5, atol=1e-6)
    # and the part's backward is still the vjp of its forward
    core, state, _, (input_error, _, _) = runs[4]
    _, vjp = jax.vjp(lambda inp: core.forward(state, inp, CTX)[0], x)
    assert_tree_allclose(input_error, vjp(error)[0], rtol=1e-4, atol=1e-5)


def test_causal_tiles_by_default_follow_the_sequence_length():
    assert [causal_tiles_for(n) for n in (8, 63, 64, 66, 127, 128, 130, 256)] == [
        1, 1, 1, 1, 1, 4, 2, 4
    ]


def test_fused_equals_separate_frozen():
    ref = reference()
    x, error = batch(1), batch(2)
    _, _, y_sep, (e_sep, _, _) = run_part(frozen_attention(ref, False), x, error)
    _, _, y_fused, (e_fused, _, _) = run_part(frozen_attention(ref, True), x, error)
    assert_tree_allclose(y_fused, y_sep, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(e_fused, e_sep, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(LEARNERS))
def test_fused_equals_separate_learning_two_adam_steps(kind):
    ref = reference()
    optimiser = optax.adam(1e-2)
    weight = LEARNERS[kind][2]
    pipes = [
        fusedpc.FusedPipeline(learning_attention(ref, fused, optimiser, kind))
        for fused in (False, True)
    ]
    for step in range(2):
        x, target = batch(10 + step), batch(20 + step)
        (y_sep, e_sep), (y_fused, e_fused) = (p.step(x, target) for p in pipes)
        assert_tree_allclose(y_fused, y_sep, rtol=1e-4, atol=1e-6)
        assert_tree_allclose(e_fused, e_sep, rtol=1e-4, atol=1e-6)
    # Weights only: the key bias has an exactly zero gradient (it shifts every score of a row),
    # so Adam turns its rounding noise into full steps that differ between the two forms.
    separate, fused = (p.merge() for p in pipes)
    stacked = jnp.concatenate([weight(separate.wq), weight(separate.wk), weight(separate.wv)])
    assert_tree_allclose(weight(fused.wqkv), stacked, rtol=1e-4, atol=1e-6)
    assert_tree_allclose(weight(fused.wo), weight(separate.wo), rtol=1e-4, atol=1e-6)
    # The weights did move (the comparison is not between two untouched copies).
    assert not np.allclose(weight(separate.wq), ref.wq.weight, atol=1e-4)


@pytest.mark.gpu_parity
@pytest.mark.parametrize("fused", [False, True])
def test_learning_slots_take_the_backprop_step(fused):
    """One SGD step of learning slots equals autodiff of the reference attention."""
    ref = reference()
    lr = 0.5
    x, target = batch(3), batch(4)
    pipe = fusedpc.FusedPipeline(
        learning_attention(ref, fused, optax.sgd(lr)), error_normalisation="rows"
    )
    _, input_error = pipe.step(x, target)

    def loss(model, inp):  # the per-row loss summed over the rows
        return 0.5 * jnp.sum((model(inp) - target) ** 2)

    grads = eqx.filter_grad(loss)(ref, x)
    expected = jax.tree_util.tree_map(lambda p, g: p - lr * g / (B * T), ref, grads)
    merged = pipe.merge()
    if fused:
        got = jnp.split(merged.wqkv.weight, 3)
        want = [expected.wq.weight, expected.wk.weight, expected.wv.weight]
        for a, b in zip(got, want):
            assert_tree_allclose(a, b, rtol=1e-4, atol=1e-6)
    else:
        for name in ("wq", "wk", "wv"):
            assert_tree_allclose(
                getattr(merged, name).weight, getattr(expected, name).weight, rtol=1e-4, atol=1e-6
            )
            assert_tree_allclose(
                getattr(merged, name).bias, getattr(expected, name).bias, rtol=1e-4, atol=1e-6
            )
    assert_tree_allclose(merged.wo.weight, expected.wo.weight, rtol=1e-4, atol=1e-6)
    assert_tree_allclose(input_error, jax.grad(lambda inp: loss(ref, inp))(x), rtol=1e-4, atol=1e-5)


def test_causal_an_earlier_output_ignores_later_tokens():
    part = frozen_attention(reference(), fused=False)
    core, state = part.compile(""), part.init_state(jr.key(0))
    x = batch(1)
    changed = x.at[:, 3].set(jr.normal(jr.key(9), (B, D)))
    y, _ = core.forward(state, x, CTX)
    y_changed, _ = core.forward(state, changed, CTX)
    np.testing.assert_array_equal(y_changed[:, :3], y[:, :3])
    assert not np.allclose(y_changed[:, 3:], y[:, 3:], atol=1e-3)


def test_no_nan_with_large_scores():
    part = frozen_attention(reference(), fused=False)
    x, error = 1e3 * batch(1), batch(2)
    _, _, y, (input_error, _, metrics) = run_part(part, x, error)
    assert np.isfinite(np.asarray(y)).all()
    assert np.isfinite(np.asarray(input_error)).all()
    assert all(bool(m.finite) for m in metrics.children)


def test_report_rows_and_write_back_name_the_slots():
    ref = reference()
    optimiser = optax.sgd(0.1)
    tree = fusedpc.Sequential([learning_attention(ref, False, optimiser)])
    pipe = fusedpc.FusedPipeline(tree)
    pipe.step(batch(1), batch(2))
    rows = [row["part"] for row in pipe.report()]
    assert rows == [f"parts[0].{name}" for name in ("wq", "wk", "wv", "wo")]
    merged = pipe.merge().parts[0]
    assert isinstance(merged, MultiHeadAttention) and merged.n_heads == H
    assert not np.allclose(merged.wk.weight, ref.wk.weight, atol=1e-5)
    state = pipe.state.parts[0]
    np.testing.assert_array_equal(merged.wk.weight, state.wk.params["weight"])

    fused = fusedpc.FusedPipeline(learning_attention(ref, True, optimiser))
    fused.step(batch(1), batch(2))
    assert [row["part"] for row in fused.report()] == ["wqkv", "wo"]
    assert fused.state.wq is None and fused.state.wqkv is not None


# --------------------------------------------------------------------------- mixing
DPA = "dot_product_attention"
# The two mixings add the same products in another order, and the dot-product backward
# recomputes A as exp(S - lse) rather than as a normalised exp: float32 rounding of O(1)
# values summed over up to 128 keys (measured <= 1.2e-6 absolute on O(3) entries).
MIX_TOL = {"rtol": 1e-5, "atol": 2e-6}


def with_mixing(part: MultiHeadAttention, mixing: str, **kwargs) -> MultiHeadAttention:
    """`part` rebuilt through the constructor with another mixing."""
    return MultiHeadAttention(
        wq=part.wq, wk=part.wk, wv=part.wv, wo=part.wo, wqkv=part.wqkv, n_heads=part.n_heads,
        causal_tiles=part.causal_tiles, mixing=mixing, **kwargs,
    )


def _rows(a):
    """`(B, H, T, d)` heads -> `(B, T, H d)` rows."""
    b, h, t, d = a.shape
    return a.transpose(0, 2, 1, 3).reshape(b, t, h * d)


@pytest.mark.parametrize("seq, heads, d", [(5, 2, 4), (64, 4, 8), (128, 2, 16), (128, 8, 4)])
@pytest.mark.slow
def test_dot_product_mixing_equals_tiles_and_its_backward_is_its_vjp(seq, heads, d):
    q, k, v = (jr.normal(jr.key(i), (B, heads, seq, d)) for i in range(3))
    d_context = jr.normal(jr.key(3), (B, heads, seq, d))
    tiles = causal_tiles_for(seq)
    context, weights = causal_mix_tiles(q, k, v, tiles)
    # jax.nn.dot_product_attention's layout is (B, T, H, d); its residual is (B, T, H)
    q_t, k_t, v_t = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    dpa_context, lse = causal_mix_dot_product(q_t, k_t, v_t)
    assert dpa_context.shape == (B, seq, heads, d) and lse.shape == (B, seq, heads)
    assert_tree_allclose(dpa_context.transpose(0, 2, 1, 3), context, **MIX_TOL)
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / np.sqrt(d)
    masked = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
    lse_want = jax.scipy.special.logsumexp(masked, axis=-1)
    assert_tree_allclose(lse.transpose(0, 2, 1), lse_want, **MIX_TOL)

    tiled = causal_mix_backward_rows(_rows(q), k, v, weights, _rows(d_context), heads)
    _, vjp = jax.vjp(lambda a, b, c: causal_mix_dot_product(a, b, c)[0], q_t, k_t, v_t)
    want = [a.reshape(B, seq, heads * d) for a in vjp(d_context.transpose(0, 2, 1, 3))]
    for backward_tiles in sorted({1, 3, tiles}):  # tiles of the recomputation: any count
        got = causal_mix_dot_product_backward_rows(
            q_t, k_t, v_t, dpa_context, lse, _rows(d_context), backward_tiles
        )
        assert_tree_allclose(got, tiled, **MIX_TOL)
        assert_tree_allclose(got, tuple(want), **MIX_TOL)


def _attention_at(seq: int, n_heads: int, fused: bool, width: int = 16):
    ref = reference(width=width, n_heads=n_heads)
    x, error = batch(1, (B, seq, width)), batch(2, (B, seq, width))
    return ref, x, error


@pytest.mark.parametrize(
    "seq, n_heads, fused", [(5, 2, False), (64, 4, False), (64, 8, True), (128, 2, False)]
)
@pytest.mark.slow
def test_part_with_dot_product_mixing_equals_tiles(seq, n_heads, fused):
    """Output, input error and every slot's error (through the learning slots' new weights:
    the delta rule's update is the slot's error times its input) equal the tiled mixing's, and
    the part's backward is the vjp of its forward."""
    ref, x, error = _attention_at(seq, n_heads, fused)
    tiles_part = learning_attention(ref, fused, optax.sgd(0.1))
    runs = {m: run_part(with_mixing(tiles_part, m), x, error) for m in ("tiles", DPA)}
    (_, _, y, (e, new_state, _)), (core, state, y_dpa, (e_dpa, new_dpa, metrics)) = (
        runs["tiles"], runs[DPA]
    )
    assert_tree_allclose(y_dpa, y, **MIX_TOL)
    assert_tree_allclose(e_dpa, e, **MIX_TOL)
    assert_tree_allclose(new_dpa, new_state, **MIX_TOL)
    assert metrics.names == (("wqkv", "wo") if fused else ("wq", "wk", "wv", "wo"))
    _, vjp = jax.vjp(lambda inp: core.forward(state, inp, CTX)[0], x)
    assert_tree_allclose(e_dpa, vjp(error)[0], **MIX_TOL)


def test_dot_product_mixing_cache_holds_no_t_by_t_array():
    seq, n_heads, width = 64, 4, 16
    ref, x, _ = _attention_at(seq, n_heads, False, width)
    part = frozen_attention(ref, False)

    def cache_of(p):
        core = p.compile("")
        return jax.eval_shape(lambda s, x: core.forward(s, x, CTX), p.init_state(jr.key(0)), x)[1]

    def square(cache):  # leaves with two sequence-long axes (>= T/2: the tiles' (T/2, T) too)
        return [
            leaf.shape
            for leaf in jax.tree.leaves(cache)
            if sum(n >= seq // 2 for n in leaf.shape) > 1
        ]

    tiled = cache_of(part)
    assert isinstance(tiled, AttentionCache) and square(tiled)  # the control: A is there
    cache = cache_of(with_mixing(part, DPA))
    assert isinstance(cache, DotProductAttentionCache)
    assert square(cache) == []
    head = (B, seq, n_heads, width // n_heads)
    assert [a.shape for a in (cache.q, cache.k, cache.v, cache.context)] == [head] * 4
    assert cache.lse.shape == (B, seq, n_heads)


def test_dot_product_mixing_passes_an_implementation_through():
    ref, x, error = _attention_at(8, 2, False)
    part = with_mixing(frozen_attention(ref, False), DPA, mixing_implementation="xla")
    assert part.mixing_implementation == "xla"
    _, _, y, (e, _, _) = run_part(part, x, error)
    _, _, y_tiles, (e_tiles, _, _) = run_part(frozen_attention(ref, False), x, error)
    assert_tree_allclose((y, e), (y_tiles, e_tiles), **MIX_TOL)
    cudnn = with_mixing(frozen_attention(ref, False), DPA, mixing_implementation="cudnn")
    with pytest.raises(ValueError, match=r"net\.attention: mixing_implementation='cudnn' needs "
                       r"float16 or bfloat16 Q, K, V .*got float32"):
        _trace(cudnn, x)


def _swap_mixing(tree, mixing: str):
    """Every `MultiHeadAttention` in `tree` rebuilt with `mixing`."""
    def swap(node):
        return with_mixing(node, mixing) if isinstance(node, MultiHeadAttention) else node

    return jax.tree.map(swap, tree, is_leaf=lambda n: isinstance(n, MultiHeadAttention))


def _arrays(tree) -> list:
    """The array leaves of a part (its static fields, the mixing among them, left out)."""
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _two_steps(tree, error_fn, data):
    pipe = fusedpc.FusedPipeline(tree, error_fn)
    outputs = [pipe.step(x, target) for x, target in data]
    return outputs, pipe.merge()


def test_dot_product_mixing_in_a_transformer_block_steps_like_tiles():
    seq, width = 64, 16
    block = fusedpc.TransformerBlock(
        frozen.layer_norm(width=width),
        learning_attention(reference(width=width, n_heads=4), True, optax.sgd(0.1)),
        frozen.layer_norm(width=width),
        fusedpc.transplant.from_feedforward(
            eqx.nn.Linear(width, 32, key=jr.key(5)), eqx.nn.Linear(32, width, key=jr.key(6)),
            optimiser=optax.sgd(0.1),
        ),
    )
    tree = fusedpc.Sequential([block])
    data = [(batch(10 + i, (B, seq, width)), batch(20 + i, (B, seq, width))) for i in range(2)]
    out_tiles, merged_tiles = _two_steps(tree, "squared", data)
    out_dpa, merged_dpa = _two_steps(_swap_mixing(tree, DPA), "squared", data)
    assert merged_dpa.parts[0].attention.mixing == DPA
    assert_tree_allclose(out_dpa, out_tiles, **MIX_TOL)
    assert_tree_allclose(_arrays(merged_dpa), _arrays(merged_tiles), **MIX_TOL)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_dot_product_mixing_in_a_gpt_steps_like_tiles(scan):
    """A GPT whose every slot learns (blocks unrolled, or scanned by a `Repeat`), its
    attentions switched to the dot-product mixing: two SGD steps give the default's logits,
    input errors and weights."""
    seq = 64
    config = fusedpc.GPTConfig(
        vocab_size=11, width=16, n_heads=4, n_blocks=2, ff_width=32, max_len=seq, learn="all",
        scan=scan,
    )
    gpt, _ = fusedpc.build_gpt(config, optax.sgd(0.1), jr.key(0))
    data = [
        tuple(jr.randint(jr.key(30 + 2 * i + j), (B, seq), 0, 11) for j in range(2))
        for i in range(2)
    ]
    out_tiles, merged_tiles = _two_steps(gpt, config.error_fn, data)
    switched = _swap_mixing(gpt, DPA)
    mixings = [
        n.mixing for n in jax.tree.leaves(switched, is_leaf=lambda n: isinstance(
            n, MultiHeadAttention)) if isinstance(n, MultiHeadAttention)
    ]
    assert mixings and set(mixings) == {DPA}
    out_dpa, merged_dpa = _two_steps(switched, config.error_fn, data)
    assert_tree_allclose(out_dpa, out_tiles, **MIX_TOL)
    assert_tree_allclose(_arrays(merged_dpa), _arrays(merged_tiles), **MIX_TOL)


def test_mixing_construction_errors(monkeypatch):
    lin = _linear(D, D)
    with pytest.raises(ValueError, match=r"mixing must be one of \('tiles', "
                       r"'dot_product_attention'\), got 'flash'"):
        MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, mixing="flash")
    with pytest.raises(ValueError, match=r"mixing_implementation must be one of .*got 'triton'"):
        MultiHeadAttention(
            wq=lin, wk=lin, wv=lin, wo=lin, mixing=DPA, mixing_implementation="triton"
        )
    with pytest.raises(ValueError, match=r"mixing_implementation='xla' applies to "
                       r"mixing='dot_product_attention' only, got mixing='tiles'"):
        MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, mixing_implementation="xla")

    def old_dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                                  is_causal=False, implementation=None):
        raise AssertionError("not called")

    monkeypatch.setattr(jax.nn, "dot_product_attention", old_dot_product_attention)
    monkeypatch.setattr(jax, "__version__", "0.7.2")
    with pytest.raises(ValueError, match=r"mixing='dot_product_attention' needs .*"
                       r"return_residual.*this jax \(0\.7\.2\).*jax >= 0\.8\.1"):
        MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, mixing=DPA)
    MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin)  # the default mixing still builds


# --------------------------------------------------------------------------- errors
def _linear(out_width, in_width, seed=0):
    return frozen.linear(eqx.nn.Linear(in_width, out_width, key=jr.key(seed)))


def test_construction_errors():
    lin = _linear(D, D)
    with pytest.raises(ValueError, match="output slot `wo` is missing"):
        MultiHeadAttention(wq=lin, wk=lin, wv=lin)
    with pytest.raises(ValueError, match=r"fused `wqkv` and separate slots \['wk'\].*not both"):
        MultiHeadAttention(wk=lin, wo=lin, wqkv=_linear(3 * D, D))
    with pytest.raises(ValueError, match=r"slots \['wv'\] are missing"):
        MultiHeadAttention(wq=lin, wk=lin, wo=lin)
    with pytest.raises(ValueError, match="n_heads must be >= 1, got 0"):
        MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, n_heads=0)
    with pytest.raises(TypeError, match="n_heads must be an int, got float"):
        MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, n_heads=2.0)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"causal_tiles must be None .* got {bad!r}"):
            MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, causal_tiles=bad)
    with pytest.raises(TypeError, match=r"MultiHeadAttention\.wv: expected a part"):
        MultiHeadAttention(wq=lin, wk=lin, wv=eqx.nn.Linear(D, D, key=jr.key(0)), wo=lin)


def _trace(part, x, path="net.attention"):
    core = part.compile(path)
    return jax.eval_shape(lambda s, v: core.forward(s, v, CTX), part.init_state(jr.key(0)), x)[0]


def test_trace_errors_name_the_path():
    lin = _linear(D, D)
    good = MultiHeadAttention(wq=lin, wk=lin, wv=lin, wo=lin, n_heads=H)
    assert _trace(good, batch()).shape == (B, T, D)
    with pytest.raises(ValueError, match=r"net\.attention: expected input of rank 3 .*\(2, 8\)"):
        _trace(good, jnp.zeros((2, D)))

    lin6 = _linear(6, 6)
    odd = MultiHeadAttention(wq=lin6, wk=lin6, wv=lin6, wo=lin6, n_heads=4)
    with pytest.raises(ValueError, match=r"net\.attention: n_heads=4 does not divide the width 6"):
        _trace(odd, jnp.zeros((B, T, 6)))

    narrow_k = MultiHeadAttention(wq=lin, wk=_linear(6, D), wv=lin, wo=lin, n_heads=H)
    with pytest.raises(ValueError, match=r"net\.attention: .*same width.*'wk': 6"):
        _trace(narrow_k, batch())

    fused = MultiHeadAttention(wqkv=_linear(10, D), wo=lin, n_heads=H)
    with pytest.raises(ValueError, match=r"net\.attention: .*width 10 is not divisible by 3"):
        _trace(fused, batch())

    with pytest.raises(
        ValueError, match=r"net\.attention\.wq: expected input of shape \(\.\.\., 8\)"
    ):
        _trace(good, jnp.zeros((B, T, 6)))
