"""The unfused baseline computes the fused step's update, one jit per leaf part."""

import jax
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose

import fusedpc
from fusedpc.execution import UnfusedPipeline
from fusedpc.execution._unfused import JitLeaf, is_composite, unfused


def _leaves(tree):
    """Every part of `tree` that `unfused` treats as a leaf (in field order); a `JitLeaf`
    counts as one leaf."""
    if isinstance(tree, JitLeaf) or not is_composite(tree):
        return [tree]
    found = []
    for name in tree.__dataclass_fields__:
        value = getattr(tree, name)
        values = value if isinstance(value, tuple | list) else [value]
        for v in values:
            if isinstance(v, fusedpc.AbstractPart):
                found.extend(_leaves(v))
    return found


def _tiny_gpt(scan: bool, optimiser, n_blocks: int = 2):
    config = fusedpc.GPTConfig(
        vocab_size=7, width=4, n_heads=2, n_blocks=n_blocks, ff_width=8, max_len=5, learn="all",
        scan=scan,
    )
    part, _ = fusedpc.build_gpt(config, optimiser, jax.random.key(0))
    return config, part


def _batch():
    ids = jax.random.randint(jax.random.key(1), (3, 5), 0, 7)
    targets = jax.random.randint(jax.random.key(2), (3, 5), 0, 7)
    return ids, targets


@pytest.fixture(scope="module")
def stepped():
    """A 2-block unrolled tiny GPT after one step of each executor (built once per module)."""
    config, part = _tiny_gpt(scan=False, optimiser=optax.sgd(0.1), n_blocks=2)
    return part, _one_step_each(config, part)


def _one_step_each(config, part):
    ids, targets = _batch()
    fused = fusedpc.FusedPipeline(part, config.error_fn)
    plain = UnfusedPipeline(part, config.error_fn)
    return fused, fused.step(ids, targets), plain, plain.step(ids, targets)


def _assert_same_step(part, fused, fused_out, plain, plain_out):
    assert jax.tree_util.tree_structure(fused.state) == jax.tree_util.tree_structure(plain.state)
    (y_f, e_f), (y_u, e_u) = fused_out, plain_out
    # rtol 1e-5: the same arithmetic, scheduled in differently fused XLA programs
    assert_tree_allclose(y_u, y_f, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(e_u, e_f, rtol=1e-5, atol=1e-7)
    assert_tree_allclose(plain.state, fused.state, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(plain.last_loss, fused.last_loss, rtol=1e-6)
    # and the step did change the weights
    initial = unfused(part).init_state(jax.random.key(0))
    moved = jax.tree_util.tree_map(lambda a, b: bool(np.any(a != b)), plain.state, initial)
    assert any(jax.tree_util.tree_leaves(moved))


@pytest.mark.slow
def test_every_leaf_is_wrapped_and_composites_are_kept(stepped):
    part, _ = stepped
    wrapped = unfused(part)
    assert type(wrapped) is type(part)
    leaves = _leaves(wrapped)
    assert leaves and all(isinstance(leaf, JitLeaf) for leaf in leaves)
    # every original leaf is inside exactly one wrapper, in the same order
    originals = _leaves(part)
    assert [type(leaf.inner) for leaf in leaves] == [type(leaf) for leaf in originals]
    assert not is_composite(originals[0]) and is_composite(part)


def test_scanned_blocks_are_unrolled():
    _, part = _tiny_gpt(scan=True, optimiser=optax.sgd(0.1), n_blocks=2)
    assert part.blocks.unroll is False
    wrapped = unfused(part)
    assert wrapped.blocks.unroll is True
    assert all(isinstance(leaf, JitLeaf) for leaf in _leaves(wrapped))


# SGD: the update is linear in the gradient. (Adam's first step is g/|g|, which turns the key
# biases' exactly-zero gradient, pure rounding noise, into +-lr in either executor.)
def test_one_unfused_step_equals_the_fused_step(stepped):
    part, (fused, fused_out, plain, plain_out) = stepped
    _assert_same_step(part, fused, fused_out, plain, plain_out)


@pytest.mark.slow
def test_one_unfused_step_equals_the_fused_step_with_scanned_blocks():
    config, part = _tiny_gpt(scan=True, optimiser=optax.sgd(0.1), n_blocks=1)
    _assert_same_step(part, *_one_step_each(config, part))


def test_merge_returns_a_tree_holding_the_current_state(stepped):
    _, (_, _, plain, _) = stepped
    merged = plain.merge()
    assert all(isinstance(leaf, JitLeaf) for leaf in _leaves(merged))
    assert_tree_allclose(merged.init_state(jax.random.key(0)), plain.state)


def test_unfused_rejects_a_non_part():
    with pytest.raises(TypeError, match="unfused"):
        unfused(object())


def test_out_of_range_host_ids_are_refused_before_anything_runs(stepped):
    part, _ = stepped
    plain = UnfusedPipeline(part, "softmax_cross_entropy")
    ids = np.full((2, 5), 99, np.int32)  # vocabulary is 7
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        plain.step(ids, ids)
    assert plain.last_loss is None
