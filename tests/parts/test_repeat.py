"""Tests of `Repeat` (`fusedpc.parts._repeat`): scanned blocks with stacked state."""

import functools

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import DeltaLinear, assert_tree_allclose, count_equations

import fusedpc
from fusedpc import frozen
from fusedpc.core import iter_metrics, named
from fusedpc.parts import MultiHeadAttention, Repeat, RepeatState
from fusedpc.parts._repeat import _slice

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

D, F, B, T, H = 4, 6, 3, 4, 2
# One optimiser object shared by every block (it is static configuration).
ADAM = optax.adam(1e-2)
# The attention blocks learn by SGD: the key bias has an exactly zero gradient (a shift of every
# score in a row), and Adam would blow its rounding noise up to full-size steps.
SGD = optax.sgd(0.1)


def learner(key, in_width, out_width, optimiser=ADAM) -> DeltaLinear:
    kw, kb = jr.split(key)
    weight = jr.normal(kw, (out_width, in_width)) / np.float32(np.sqrt(in_width))
    return DeltaLinear(weight, 0.1 * jr.normal(kb, (out_width,)), optimiser)


def mlp_block(key, width=D, hidden=F) -> fusedpc.Residual:
    """`x + W2 tanh(W1 x + b1) + b2`, both linears learning."""
    k1, k2 = jr.split(key)
    return fusedpc.Residual(
        fusedpc.Sequential([learner(k1, width, hidden), frozen.tanh(), learner(k2, hidden, width)])
    )


def attention_block(key) -> fusedpc.Residual:
    """`x + attention(LN(x))` with learning Q, K, V, O slots."""
    kq, kk, kv, ko = jr.split(key, 4)
    attention = MultiHeadAttention(
        wq=learner(kq, D, D, SGD),
        wk=learner(kk, D, D, SGD),
        wv=learner(kv, D, D, SGD),
        wo=learner(ko, D, D, SGD),
        n_heads=H,
    )
    return fusedpc.Residual(fusedpc.Sequential([frozen.layer_norm(width=D), attention]))


def batch(seed, shape=(B, T, D)) -> jax.Array:
    return jr.normal(jr.key(seed), shape)


def train(tree, steps=2):
    """The `(output, input_error)` of `steps` pipeline steps, and the pipeline."""
    pipe = fusedpc.FusedPipeline(tree)
    results = [pipe.step(batch(10 + i), batch(20 + i)) for i in range(steps)]
    return results, pipe


FACTORIES = {"mlp": mlp_block, "attention": attention_block}
N = 4


@functools.cache
def trained(name: str) -> dict:
    """The same N blocks as a scanned Repeat, an unrolled Repeat and a plain Sequential chain,
    each trained for two steps (built once per module: compiling is the slow part)."""
    scanned = Repeat.from_factory(FACTORIES[name], N, jr.key(0))
    trees = {
        "scan": scanned,
        "unroll": Repeat(scanned.blocks, unroll=True),
        "chain": fusedpc.Sequential(scanned.blocks),
    }
    return {form: (tree, *train(tree)) for form, tree in trees.items()}


# --------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize(
    "name, atol",
    [
        ("mlp", 1e-7),
        # Entries of order 1; XLA fuses the LayerNorm and softmax reductions differently inside
        # the scan body than in the unrolled program, so small entries differ by ~1e-6 absolute.
        ("attention", 1e-5),
    ],
)
@pytest.mark.slow
def test_scanned_equals_unrolled_and_a_plain_chain(name, atol):
    runs = trained(name)
    _, scan_steps, scan_pipe = runs["scan"]
    _, unroll_steps, unroll_pipe = runs["unroll"]
    _, chain_steps, chain_pipe = runs["chain"]
    # Step 0's outputs are the forward pass; step 1's follow the first learning step.
    assert_tree_allclose(unroll_steps, scan_steps, rtol=1e-6, atol=atol)
    assert_tree_allclose(chain_steps, scan_steps, rtol=1e-6, atol=atol)
    assert_tree_allclose(unroll_pipe.state, scan_pipe.state, rtol=1e-6, atol=atol)
    stacked = [_slice(scan_pipe.state.blocks, i) for i in range(N)]
    assert_tree_allclose(list(chain_pipe.state.parts), stacked, rtol=1e-6, atol=atol)
    # The same report, row for row, from both compiled forms.
    assert [r["part"] for r in unroll_pipe.report()] == [r["part"] for r in scan_pipe.report()]
    assert_tree_allclose(
        [r["update_norm"] for r in unroll_pipe.report()],
        [r["update_norm"] for r in scan_pipe.report()],
        rtol=1e-5,  # norms of float32 updates, reduced in a different order
    )


def test_state_is_stacked_and_blocks_start_from_their_own_weights():
    rep = Repeat.from_factory(mlp_block, 4, jr.key(0))
    state = rep.init_state(jr.key(1))
    assert isinstance(state, RepeatState)
    stacked = state.blocks.branch.parts[0].params["weight"]
    assert stacked.shape == (4, F, D)
    for i, block in enumerate(rep.blocks):
        assert_tree_allclose(stacked[i], block.branch.parts[0].weight)
    assert not np.allclose(stacked[0], stacked[1])


def _step_equations(n: int, unroll: bool) -> int:
    rep = Repeat.from_factory(mlp_block, n, jr.key(0), unroll=unroll)
    core = rep.compile("blocks")

    def step(state, x, target):
        y, cache = core.forward(state, x, CTX)
        return core.backward(state, cache, y - target, CTX)

    return count_equations(
        jax.make_jaxpr(step)(rep.init_state(jr.key(1)), batch(1), batch(2)).jaxpr
    )


def test_the_step_trace_does_not_grow_with_depth():
    assert _step_equations(1, unroll=False) == _step_equations(8, unroll=False)
    # The unrolled form does grow: the count is sensitive to depth.
    assert _step_equations(8, unroll=True) > 4 * _step_equations(1, unroll=True)


# --------------------------------------------------------------------------- reports, merge
def test_report_rows_name_each_block():
    _, _, pipe = trained("mlp")["scan"]
    rows = [row["part"] for row in pipe.report()]
    assert rows == [f"[{i}].branch.parts[{j}]" for i in range(N) for j in (0, 2)]
    # As a child named "blocks" of a parent, the rows read blocks[i]...
    paths = [path for path, _ in iter_metrics(named(blocks=pipe.last_metrics.parts))]
    assert "blocks[3].branch.parts[2]" in paths
    # Each row carries that block's own numbers.
    norms = [row["weight_norm"] for row in pipe.report()]
    assert len(set(norms)) == len(norms)

    _, _, attn_pipe = trained("attention")["scan"]
    attn_rows = {row["part"] for row in attn_pipe.report()}
    assert "[3].branch.parts[1].wo" in attn_rows
    assert len(attn_rows) == N * 4


def test_merge_returns_n_blocks_holding_the_state_slices():
    rep, _, pipe = trained("mlp")["scan"]
    merged = pipe.merge()
    assert isinstance(merged, Repeat) and len(merged.blocks) == N and not merged.unroll
    for i, (block, old) in enumerate(zip(merged.blocks, rep.blocks)):
        for j in (0, 2):
            params = pipe.state.blocks.branch.parts[j].params
            part = block.branch.parts[j]
            assert_tree_allclose(part.weight, params["weight"][i])
            assert_tree_allclose(part.bias, params["bias"][i])
            assert not np.allclose(part.weight, old.branch.parts[j].weight, atol=1e-5)
    # The merged tree's initial state restacks to the pipeline's parameters.
    restacked = merged.init_state(jr.key(1)).blocks.branch.parts
    for j in (0, 2):
        assert_tree_allclose(restacked[j].params, pipe.state.blocks.branch.parts[j].params)


# --------------------------------------------------------------------------- errors
def test_structure_mismatch_names_the_block_and_the_first_difference():
    blocks = [mlp_block(jr.key(i)) for i in range(3)]
    narrow = mlp_block(jr.key(3), hidden=5)
    with pytest.raises(
        ValueError,
        match=r"block 2 is not structurally identical to block 0; first difference at "
        r"\.branch\.parts\[0\]\.weight: float32\[6, 4\] vs float32\[5, 4\]",
    ):
        Repeat([*blocks[:2], narrow])
    with pytest.raises(ValueError, match=r"block 1 .* at <block>: Frozen vs Residual"):
        Repeat([frozen.tanh(), fusedpc.Residual(frozen.tanh())])
    with pytest.raises(ValueError, match=r"block 1 .* at \.forward_fn: static configuration"):
        Repeat([frozen.tanh(), frozen.relu()])
    other_optimiser = learner(jr.key(1), D, D, optimiser=optax.adam(1e-3))  # ADAM: 1e-2
    with pytest.raises(ValueError, match=r"at \.optimiser: static configuration.*once"):
        Repeat([learner(jr.key(0), D, D), other_optimiser])


def test_construction_errors():
    with pytest.raises(ValueError, match="at least one block"):
        Repeat([])
    with pytest.raises(TypeError, match=r"Repeat\.blocks\[1\]: expected a part"):
        Repeat([frozen.tanh(), jnp.tanh])
    with pytest.raises(ValueError, match="n must be an int >= 1, got 0"):
        Repeat.from_factory(mlp_block, 0, jr.key(0))


def test_a_block_that_changes_the_shape_is_a_trace_error_naming_the_path():
    rep = fusedpc.Sequential([Repeat.from_factory(lambda k: learner(k, D, F), 2, jr.key(0))])
    pipe = fusedpc.FusedPipeline(rep)
    with pytest.raises(
        ValueError,
        match=r"parts\[0\]\[\*\]: a repeated block must keep its input's shape and dtype; "
        r"input float32\[3, 4, 4\], output float32\[3, 4, 6\]",
    ):
        pipe.check(batch(1), batch(2))
    # Unrolled, each block is checked on its own trace and named by its index.
    unrolled = fusedpc.FusedPipeline(fusedpc.Sequential(
        [Repeat.from_factory(lambda k: learner(k, D, F), 2, jr.key(0), unroll=True)]))
    with pytest.raises(
        ValueError,
        match=r"parts\[0\]\[0\]: a repeated block must keep its input's shape and dtype; "
        r"input float32\[3, 4, 4\], output float32\[3, 4, 6\]",
    ):
        unrolled.check(batch(1), batch(2))
    # Errors inside a block name the block template's path.
    with pytest.raises(
        ValueError, match=r"parts\[0\]\[\*\]: expected input of shape \(\.\.\., 4\)"
    ):
        pipe.check(batch(1, (B, T, 5)), batch(2))


# ------------------------------------------------------------- optimiser steps over the stack
GPT_TINY = dict(vocab_size=11, width=8, n_heads=2, n_blocks=3, ff_width=16, max_len=6)


def _unrolled_gpt_run(monkeypatch, stacked: bool, optimiser):
    """Three steps of a tiny GPT whose blocks are an unrolled Repeat, with the blocks'
    optimiser steps run over the stack (the default for fusedpc's own parts) or per block;
    returns the outputs, the final state, the report and how often the stack was updated."""
    import fusedpc.parts._repeat as repeat_module

    calls = []
    apply_stacked = repeat_module._apply_stacked

    def counted(*args, **kwargs):
        calls.append(1)
        return apply_stacked(*args, **kwargs)

    monkeypatch.setattr(repeat_module, "_apply_stacked", counted)
    if not stacked:
        monkeypatch.setattr(repeat_module, "stacks_updates", lambda block: False)
    config = fusedpc.GPTConfig(**GPT_TINY, learn="all")  # scan="auto": an unrolled Repeat
    tree, _ = fusedpc.build_gpt(config, optimiser, jr.key(0))
    pipe = fusedpc.FusedPipeline(tree, config.error_fn)
    ids = jr.randint(jr.key(1), (4, 6), 0, GPT_TINY["vocab_size"])
    targets = jr.randint(jr.key(2), (4, 6), 0, GPT_TINY["vocab_size"])
    outputs = [pipe.step(ids, targets)[0] for _ in range(3)]
    monkeypatch.undo()
    return outputs, pipe.state, pipe.report(), len(calls)


@pytest.mark.slow
def test_an_unrolled_repeat_steps_its_blocks_optimisers_over_the_stack(monkeypatch):
    # SGD, as test_scanned_gpt_equals_unrolled: the two forms are two compiled programs, which
    # XLA fuses differently (float32 rounding apart, as a scanned and an unrolled Repeat)
    sgd = optax.sgd(0.5)
    out_s, state_s, report_s, calls_s = _unrolled_gpt_run(monkeypatch, True, sgd)
    out_b, state_b, report_b, calls_b = _unrolled_gpt_run(monkeypatch, False, sgd)
    assert calls_s >= 1 and calls_b == 0  # traced with the program; never per block
    assert_tree_allclose(out_s, out_b, rtol=1e-6, atol=1e-7)
    assert_tree_allclose(state_s, state_b, rtol=1e-6, atol=1e-7)
    # every part's report (the update norms read rows of the stacked result) is the same
    assert [r["part"] for r in report_s] == [r["part"] for r in report_b]
    for field in ("update_norm", "weight_norm", "error_norm"):
        np.testing.assert_allclose([r[field] for r in report_s], [r[field] for r in report_b],
                                   rtol=1e-5)  # norms of float32 values, as scanned/unrolled


@pytest.mark.slow
def test_stacked_adam_steps_put_every_blocks_state_in_its_row(monkeypatch):
    adam = optax.adam(1e-2)
    _, state_s, _, calls_s = _unrolled_gpt_run(monkeypatch, True, adam)
    _, state_b, _, _ = _unrolled_gpt_run(monkeypatch, False, adam)
    assert calls_s >= 1
    leaves_s, tree_s = jax.tree_util.tree_flatten(state_s)
    leaves_b, tree_b = jax.tree_util.tree_flatten(state_b)
    assert tree_s == tree_b
    for a, b in zip(leaves_s, leaves_b, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "iu":  # Adam's step counts: 3 in every block's row
            np.testing.assert_array_equal(a, b)
        else:
            # Adam turns float32 rounding differences of near-zero gradients (see above)
            # into steps of up to its learning rate; a block's row put in another's place
            # would differ by the weights' own size (~0.1 to 1)
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=2e-3)


def test_a_part_of_your_own_in_a_block_keeps_each_blocks_optimiser_step(monkeypatch):
    from fusedpc.parts._repeat import stacks_updates

    config = fusedpc.GPTConfig(**GPT_TINY)
    gpt, _ = fusedpc.build_gpt(config, optax.adam(1e-2), jr.key(0))
    gpt_blocks = next(c for _, c in gpt.children() if isinstance(c, Repeat))
    assert stacks_updates(gpt_blocks.blocks[0])
    assert not stacks_updates(mlp_block(jr.key(0)))  # DeltaLinear is the tests' own part
    # and such a Repeat trains as before, each block's optimiser step its own
    import fusedpc.parts._repeat as repeat_module

    monkeypatch.setattr(repeat_module, "_apply_stacked", lambda *a, **k: pytest.fail("stacked"))
    _, unroll_steps, unroll_pipe = trained("mlp")["unroll"]
    fresh = Repeat(Repeat.from_factory(mlp_block, N, jr.key(0)).blocks, unroll=True)
    results, pipe = train(fresh)
    for a, b in zip(jax.tree_util.tree_leaves(results), jax.tree_util.tree_leaves(unroll_steps)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
