"""Blocks built every documented way stack into one `Repeat` and scan: the traced step does
not grow with depth. (Blocks that really differ are said, naming the field, the blocks and
the fix: tests/transformer/test_gpt.py.)"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count_equations

import fusedpc
from fusedpc import transplant
from fusedpc.parts import equivalent
from fusedpc.transformer.reference import GPT

SIZES = {"vocab": 11, "width": 16, "heads": 4, "ff": 32, "seq": 8}


def _gpt(n_blocks: int) -> GPT:
    s = SIZES
    return GPT(s["vocab"], s["width"], s["heads"], n_blocks, s["ff"], s["seq"],
               key=jax.random.key(0))


def _by_build_gpt(n_blocks: int) -> fusedpc.GPTPart:
    config = fusedpc.GPTConfig(vocab_size=11, width=16, n_heads=4, n_blocks=n_blocks,
                               ff_width=32, max_len=8, learn="all")
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
    return part


def _by_learn(n_blocks: int) -> fusedpc.GPTPart:
    adam = optax.adam(1e-3)
    return fusedpc.hybrid_from_gpt(
        _gpt(n_blocks), learn={slot: adam for slot in fusedpc.transformer.SLOTS}
    )


def _by_loop(n_blocks: int) -> fusedpc.GPTPart:
    """The natural loop: a new `optax.adam(1e-3)` for every part of every block."""
    gpt = _gpt(n_blocks)
    return fusedpc.hybrid_from_gpt(
        gpt,
        ff_parts=[transplant.from_feedforward(b.ff.fc1, b.ff.fc2, "gelu",
                                              optimiser=optax.adam(1e-3))
                  for b in gpt.blocks],
        attention_parts=[
            {name: transplant.from_linear(getattr(b.attn, name), optimiser=optax.adam(1e-3))
             for name in ("wq", "wk", "wv", "wo")}
            for b in gpt.blocks
        ],
        norm_parts=lambda ln: transplant.from_layer_norm(ln, optimiser=optax.adam(1e-3)),
        head_part=transplant.from_linear(gpt.head, optimiser=optax.adam(1e-3)),
    )


def _by_callable(n_blocks: int) -> fusedpc.GPTPart:
    """Parts per block from callables of the block index, with a schedule made per call."""
    gpt = _gpt(n_blocks)

    def adam():
        return optax.adamw(optax.cosine_decay_schedule(1e-3, 1000), weight_decay=0.01)

    def attention(i):
        a = gpt.blocks[i].attn
        return {"wqkv": transplant.from_linears([a.wq, a.wk, a.wv], optimiser=adam())}

    return fusedpc.hybrid_from_gpt(
        gpt,
        ff_parts=lambda i: transplant.from_feedforward(
            gpt.blocks[i].ff.fc1, gpt.blocks[i].ff.fc2, "gelu", optimiser=adam()),
        attention_parts=attention,
    )


BUILDERS = {"build_gpt": _by_build_gpt, "learn": _by_learn, "loop": _by_loop,
            "callable": _by_callable}


def _equations(part: fusedpc.GPTPart) -> int:
    pipeline = fusedpc.FusedPipeline(part, "softmax_cross_entropy")
    ids = jnp.zeros((2, SIZES["seq"]), jnp.int32)
    jaxpr = jax.make_jaxpr(pipeline.program.step)(pipeline.carry, ids, ids)
    return count_equations(jaxpr.jaxpr)


@pytest.mark.parametrize("way", sorted(BUILDERS))
@pytest.mark.slow
def test_sixteen_blocks_built_each_documented_way_are_scanned(way):
    build = BUILDERS[way]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot be stacked" warning either
        deep, shallow = build(16), build(5)
    for part in (deep, shallow):
        assert isinstance(part.blocks, fusedpc.Repeat) and not part.blocks.unroll
    # the trace of the step (scan bodies included) is the same at 5 and 16 blocks
    assert _equations(deep) == _equations(shallow)


@pytest.mark.slow
def test_the_equation_count_sees_depth():
    # the same blocks as a chain do grow with depth: the count above can fail
    gpt5, gpt6 = _gpt(5), _gpt(6)
    adam = optax.adam(1e-3)
    chain5 = fusedpc.hybrid_from_gpt(gpt5, learn={"feed_forward": adam}, scan=False)
    chain6 = fusedpc.hybrid_from_gpt(gpt6, learn={"feed_forward": adam}, scan=False)
    assert _equations(chain6) > _equations(chain5)


@pytest.mark.slow
def test_optimisers_made_per_block_train_as_one_shared_optimiser():
    ids = np.asarray(jax.random.randint(jax.random.key(3), (3, 2, SIZES["seq"]), 0, 11))
    adam = optax.adam(1e-3)
    shared = fusedpc.hybrid_from_gpt(  # the slots _by_loop makes learn, one optimiser object
        _gpt(5), learn={slot: adam for slot in ("attention", "feed_forward", "norm", "head")}
    )
    runs = []
    for part in (_by_loop(5), shared):
        pipeline = fusedpc.FusedPipeline(part, "softmax_cross_entropy")
        _, _, metrics = pipeline.run(ids, ids, keep_outputs=False)
        runs.append((np.asarray(metrics.loss), jax.tree_util.tree_leaves(pipeline.state)))
    (loop_losses, loop_state), (shared_losses, shared_state) = runs
    assert loop_losses[-1] < loop_losses[0]
    np.testing.assert_array_equal(loop_losses, shared_losses)
    assert len(loop_state) == len(shared_state)
    for a, b in zip(loop_state, shared_state):
        np.testing.assert_array_equal(a, b)


def test_learn_is_checked():
    gpt = _gpt(1)
    with pytest.raises(ValueError, match=r"unknown slots \['ffn'\]"):
        fusedpc.hybrid_from_gpt(gpt, learn={"ffn": optax.adam(1e-3)})
    with pytest.raises(TypeError, match="learn must map slot names to optimisers"):
        fusedpc.hybrid_from_gpt(gpt, learn=[optax.adam(1e-3)])
    head = transplant.from_linear(gpt.head, optimiser=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"slots \['head'\] are both in learn and given"):
        fusedpc.hybrid_from_gpt(gpt, learn={"head": optax.sgd(0.1)}, head_part=head)


def test_equivalence_of_static_values():
    assert equivalent(optax.adam(1e-3), optax.adam(1e-3))
    assert not equivalent(optax.adam(1e-3), optax.adam(2e-3))
    assert not equivalent(optax.adam(1e-3), optax.sgd(1e-3))
    schedule = optax.cosine_decay_schedule
    assert equivalent(optax.adam(schedule(1e-3, 100)), optax.adam(schedule(1e-3, 100)))
    assert not equivalent(optax.adam(schedule(1e-3, 100)), optax.adam(schedule(1e-3, 200)))
    # lambdas written apart are different code, even when they read the same
    assert not equivalent(lambda x: x, lambda x: x)
    # captured arrays are compared by value
    def scaled(factor):
        return lambda x: x * factor
    assert equivalent(scaled(np.ones(3)), scaled(np.ones(3)))
    assert not equivalent(scaled(np.ones(3)), scaled(np.zeros(3)))
    # an object without value equality is equivalent only to itself
    a, b = object(), object()
    assert equivalent(a, a) and not equivalent(a, b)
