"""The modern transformer options: RMSNorm, rotary positions and a SwiGLU feed-forward, as
parts and as `GPTConfig(norm=, positions=, feed_forward=)`: each against the reference GPT and
its backprop twin, their backwards against `jax.vjp`, the export round trip and the errors.

Run as a script (`python test_options.py`, with `tests/` on `PYTHONPATH`) it prints the
parity figures of the three options at once as JSON: the subprocess test below runs it at
XLA's default optimisation level, which the suite's level 0 (tests/conftest.py) does not.
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
from fusedpc.parts import GatedFeedForward, MultiHeadAttention, frozen, transplant
from fusedpc.parts._rotary import rotate_rows
from fusedpc.parts.frozen import RMSNormParams
from fusedpc.parts.learning import LearningRMSNorm
from fusedpc.transformer.reference import GPT, count_flops, make_backprop_step

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

TINY = {"vocab_size": 11, "width": 16, "n_heads": 2, "n_blocks": 1, "ff_width": 32, "max_len": 8}
OPTIONS = {
    "rms": {"norm": "rms"},
    "rotary": {"positions": "rotary"},
    "swiglu": {"feed_forward": "swiglu"},
    "all_three": {"norm": "rms", "positions": "rotary", "feed_forward": "swiglu"},
}
_KEY_BIAS = (jax.tree_util.GetAttrKey("wk"), jax.tree_util.GetAttrKey("bias"))


def _batches(n_steps: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """`n_steps` batches of ids and targets, `(n_steps, 4, 8)` each."""
    ids, targets = jax.random.randint(
        jax.random.key(seed), (2, n_steps, 4, 8), 0, TINY["vocab_size"], dtype=jnp.int32
    )
    return ids, targets


def _array_leaves(model) -> list:
    return jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))


def _twin(reference: GPT, optimiser, ids, targets) -> GPT:
    """The backprop twin after one step per batch (`make_backprop_step`)."""
    step = make_backprop_step(optimiser)
    model = jax.tree_util.tree_map(jnp.copy, reference)  # the step donates its model
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    for x, y in zip(ids, targets, strict=True):
        model, opt_state, _ = step(model, opt_state, x, y)
    return model


def _fused(part: fusedpc.GPTPart, reference: GPT, ids, targets):
    """`(pipeline, learned)`: the pipeline after one `step` per batch (one compiled program
    whatever the count) and its GPT exported into a reference GPT."""
    pipeline = fusedpc.FusedPipeline(part, "softmax_cross_entropy")
    for x, y in zip(ids, targets, strict=True):
        pipeline.step(x, y)
    return pipeline, fusedpc.to_reference(pipeline.merge(), reference)


def _changes(learned: GPT, twin: GPT, reference: GPT) -> dict[str, tuple[np.ndarray, ...]]:
    """Per weight (key path): its change in `learned` and in `twin`, from `reference`."""
    before = dict(_array_leaves(reference))
    return {
        jax.tree_util.keystr(path): (
            np.asarray(got, np.float64) - np.asarray(before[path], np.float64),
            np.asarray(want, np.float64) - np.asarray(before[path], np.float64),
        )
        for (path, got), (_, want) in zip(
            _array_leaves(learned), _array_leaves(twin), strict=True
        )
    }


def _float64(model: GPT) -> GPT:
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, jnp.float64) if eqx.is_inexact_array(a) else a, model
    )


def sgd_parity(options: dict) -> tuple[dict[str, float], fusedpc.FusedPipeline]:
    """One SGD step of a GPT built by `build_gpt(GPTConfig(..., learn="all"))`, every weight
    learning, against the backprop twin: the worst norm-relative error of a weight's change
    and the key bias's largest change per unit rate; and the pipeline.

    The rate is large on purpose: one step's change is linear in it, and at this size the
    rounding of $w + \\Delta$ to float32 (which dominates a small change and puts even float32
    backprop up to 2e-4 from float64 at rate 0.5) drops out, leaving the gradients' own."""
    rate = 100.0
    config = fusedpc.GPTConfig(**TINY, **options, learn="all")
    sgd = optax.sgd(rate)
    part, reference = fusedpc.build_gpt(config, sgd, jax.random.key(0))
    ids, targets = _batches(1)
    pipeline, learned = _fused(part, reference, ids, targets)
    changes = _changes(learned, _twin(reference, sgd, ids, targets), reference)
    key_bias = changes.pop(".blocks[0].attn.wk.bias")
    if options.get("positions") == "rotary":  # the key bias has a real gradient here
        changes["key_bias"] = key_bias
    for path, (_, want) in changes.items():
        assert np.linalg.norm(want) > 0, path
    figures = {
        "sgd": max(norm_rel_error(got, want) for got, want in changes.values()),
        "key_bias_change": float(np.max(np.abs(key_bias[0]))) / rate,
    }
    return figures, pipeline


def adam_parity(options: dict, n_steps: int) -> dict[str, tuple[float, float, float]]:
    """`n_steps` Adam steps of a GPT from `hybrid_from_gpt(reference, learn=every slot)`:
    per weight, the norm-relative error of its change against the float32 twin, against a
    float64 twin, and the float32 twin's own against the float64 one."""
    reference = GPT(**TINY, **options, key=jax.random.key(0))
    adam = optax.adam(1e-2)
    slots = [s for s in fusedpc.transformer.SLOTS
             if s != "position" or reference.pos_emb is not None]
    part = fusedpc.hybrid_from_gpt(reference, learn=dict.fromkeys(slots, adam))
    ids, targets = _batches(n_steps)
    _, learned = _fused(part, reference, ids, targets)
    changes = _changes(learned, _twin(reference, adam, ids, targets), reference)
    with jax.enable_x64(True):
        twin64 = _twin(_float64(reference), adam, ids, targets)
        changes64 = _changes(twin64, twin64, reference)
    return {
        path: (norm_rel_error(got, want), norm_rel_error(got, changes64[path][0]),
               norm_rel_error(want, changes64[path][0]))
        for path, (got, want) in changes.items()
    }


# --------------------------------------------------------------------------- the GPT
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_all_frozen_gpt_reproduces_the_reference_logits(option):
    reference = GPT(**TINY, **OPTIONS[option], key=jax.random.key(0))
    part = fusedpc.hybrid_from_gpt(reference)
    ids, _ = _batches(1)
    logits = jax.jit(lambda state, x: part.compile("").forward(state, x, CTX)[0])(
        part.init_state(jax.random.key(0)), ids[0]
    )
    np.testing.assert_allclose(logits, reference(ids[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.slow
def test_every_weight_learning_one_sgd_step_equals_backprop(option):
    figures, pipeline = sgd_parity(OPTIONS[option])
    assert figures["sgd"] <= 1e-5, figures  # float32 rounding (DESIGN.md's parity bound)
    if OPTIONS[option].get("positions") != "rotary":
        # the key bias adds one number to a whole softmax row: its gradient is exactly zero,
        # float32 rounding in either (compared apart)
        assert figures["key_bias_change"] <= 1e-8, figures
    # the report names every learning slot, the new ones included, in forward order
    ff = (["feed_forward.gate", "feed_forward.up", "feed_forward.down"]
          if OPTIONS[option].get("feed_forward") == "swiglu" else ["feed_forward"])
    block = ["n1", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "n2", *ff]
    embeddings = ["token"] if OPTIONS[option].get("positions") == "rotary" else [
        "token", "position"
    ]
    rows = pipeline.report()
    assert [row["part"] for row in rows] == [
        *embeddings, *(f"blocks[0].{n}" for n in block), "norm_f", "head"
    ]
    assert all(row["finite"] and row["update_norm"] > 0 for row in rows)


@pytest.mark.slow
def test_every_weight_learning_adam_steps_equal_backprop():
    # The three options at once (each alone: the SGD step above). Adam's steps are about its
    # rate whatever the gradient, so float32 storage puts even float32 backprop ~7e-6 from
    # float64, and a small gradient (the key bias) further: there the fused step must be no
    # further from float64 than float32 backprop is, up to a factor 2 (two roundings of the
    # same size in different orders: 0.95 to 1.45 times the twin's in the runs measured).
    figures = adam_parity(OPTIONS["all_three"], n_steps=3)
    assert len(figures) == 17  # token, 8 attention, 3 SwiGLU, 3 RMSNorm, head weight + bias
    for path, (to_float32, to_float64, float32_to_float64) in figures.items():
        assert to_float32 <= 1e-5 or to_float64 <= 2.0 * float32_to_float64, (path, figures)


@pytest.mark.slow
def test_parity_at_xla_default_optimisation_level():
    # A fresh process without the suite's level-0 flag: XLA's fusions reorder the float32
    # sums; the three options at once, one SGD step.
    figures = run_at_default_level(__file__)
    assert figures["sgd"] <= 1e-5, figures


def test_a_rotary_gpt_has_no_position_slot():
    config = fusedpc.GPTConfig(**TINY, **OPTIONS["all_three"], learn="all")
    assert "position" not in config.learning_slots()
    part, reference = fusedpc.build_gpt(config, optax.sgd(0.1), jax.random.key(0))
    assert reference.pos_emb is None and part.position is None
    assert [name for name, _ in part.children()] == ["token", "blocks", "norm_f", "head"]
    assert bool(eqx.tree_equal(part.replace_children([c for _, c in part.children()]), part))
    state = part.init_state(jax.random.key(0))
    assert state.position is None
    block = part.blocks.children()[0][1]
    assert isinstance(block.attention, MultiHeadAttention)
    assert block.attention.positions == "rotary"
    assert isinstance(block.feed_forward, GatedFeedForward)
    assert isinstance(block.n1, LearningRMSNorm) and isinstance(part.norm_f, LearningRMSNorm)
    # the default GPT keeps its position table, its slots and its state layout
    default, _ = fusedpc.build_gpt(fusedpc.GPTConfig(**TINY, learn="none"), None,
                                 jax.random.key(0))
    assert [name for name, _ in default.children()] == [
        "token", "position", "blocks", "norm_f", "head"
    ]
    assert isinstance(default.init_state(jax.random.key(0)).position, fusedpc.FrozenState)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_to_reference_round_trip(option):
    reference = GPT(**TINY, **OPTIONS[option], key=jax.random.key(0))
    template = GPT(**TINY, **OPTIONS[option], key=jax.random.key(5))
    for part in (
        fusedpc.hybrid_from_gpt(reference),
        fusedpc.hybrid_from_gpt(reference, learn={
            slot: optax.sgd(0.1) for slot in fusedpc.transformer.SLOTS
            if slot != "position" or reference.pos_emb is not None
        }),
    ):
        exported = fusedpc.to_reference(part, template)
        assert jax.tree_util.tree_structure(exported) == jax.tree_util.tree_structure(reference)
        assert bool(eqx.tree_equal(exported, reference))


def test_count_flops_counts_the_third_swiglu_matrix():
    sizes = {"vocab": 11, "width": 16, "n_heads": 2, "n_blocks": 3, "ff_width": 32, "seq": 8,
             "batch": 4}
    extra = count_flops(**sizes, feed_forward="swiglu") - count_flops(**sizes)
    assert extra == 3 * 3 * 2 * (4 * 8) * 16 * 32  # 3 x (L blocks x one 2 N W F matrix)


# --------------------------------------------------------------------------- the parts
def _rms_module(width: int = 8) -> eqx.nn.RMSNorm:
    norm = eqx.nn.RMSNorm(width)  # equinox's default has a weight and a bias
    return eqx.tree_at(
        lambda m: (m.weight, m.bias), norm,
        (1.0 + 0.3 * normal(1, (width,)), 0.2 * normal(2, (width,))),
    )


def _linears(widths: list[tuple[int, int]], seed: int, use_bias: bool = True) -> list:
    keys = jax.random.split(jax.random.key(seed), len(widths))
    return [eqx.nn.Linear(i, o, use_bias=use_bias, key=k) for (i, o), k in zip(widths, keys)]


def _frozen_cases() -> dict[str, fusedpc.AbstractPart]:
    attention = [frozen.linear(lin) for lin in _linears([(8, 8)] * 4, 3)]
    gate, up, down = _linears([(8, 12), (8, 12), (12, 8)], 4, use_bias=False)
    return {
        "rms_norm_from_eqx": frozen.rms_norm(_rms_module()),
        "rms_norm_width": frozen.rms_norm(width=8),
        **{
            f"rotary_attention_{mixing}": MultiHeadAttention(
                *attention, n_heads=2, mixing=mixing, positions="rotary"
            )
            for mixing in ("tiles", "dot_product_attention")
        },
        "swiglu": frozen.swiglu(gate, up, down),
    }


@pytest.mark.slow
def test_frozen_backwards_equal_the_vjp_of_their_forwards():
    x = normal(10, (2, 4, 8))
    for name, part in _frozen_cases().items():
        worst = fusedpc.check_backward(part, x)
        assert worst <= 1e-5, f"{name}: {worst}"


def test_rms_norm_forward_is_equinox_and_its_gradient_is_backprop():
    module, x = _rms_module(), normal(11, (3, 4, 8))
    part = LearningRMSNorm(module.weight, module.bias, capture_gradients(), eps=module.eps)
    core, state = part.compile(""), part.init_state(jax.random.key(0))
    y, cache = core.forward(state, x, CTX)
    np.testing.assert_allclose(y, jax.vmap(jax.vmap(module))(x), rtol=1e-6, atol=1e-6)
    error = normal(12, y.shape)
    input_error, new_state, _ = core.backward(state, cache, error, CTX)

    rows = x.size // x.shape[-1]

    def loss(params: RMSNormParams, inp):  # averaged over rows, with dL/dy = error / rows
        out = core.forward(eqx.tree_at(lambda s: s.params, state, params), inp, CTX)[0]
        return jnp.sum(out * error) / rows

    grads = jax.grad(loss)(state.params, x)
    assert_tree_allclose(new_state.opt_state, grads, rtol=1e-5, atol=1e-7)
    # input errors are per row, of the summed loss
    assert_tree_allclose(input_error, jax.grad(loss, 1)(state.params, x) * rows,
                         rtol=1e-5, atol=1e-6)
    # without a shift, the state holds none and the optimiser sees none
    no_shift = transplant.from_rms_norm(eqx.nn.RMSNorm(8, use_bias=False),
                                        optimiser=optax.sgd(0.1))
    assert no_shift.init_state(jax.random.key(0)).params.bias is None
    assert no_shift.export_arrays() == (RMSNormParams(no_shift.weight, None),)


def test_rotary_scores_depend_on_the_offset_only():
    # The defining property of rotary embeddings, independent of how they are written:
    # <R_t q, R_s k> depends on t - s only. One query and one key, repeated at every position.
    q, k = normal(13, (1, 1, 8)), normal(14, (1, 1, 8))
    rq = rotate_rows(jnp.tile(q, (1, 6, 1)), n_heads=2, base=10000.0)
    rk = rotate_rows(jnp.tile(k, (1, 6, 1)), n_heads=2, base=10000.0)
    heads = lambda a: a.reshape(6, 2, 4)  # noqa: E731 - (T, H, d)
    scores = jnp.einsum("thd,shd->hts", heads(rq[0]), heads(rk[0]))  # (H, T, T)
    for offset in range(6):
        diagonal = jnp.diagonal(scores, -offset, axis1=1, axis2=2)
        np.testing.assert_allclose(
            diagonal, jnp.broadcast_to(diagonal[:, :1], diagonal.shape), rtol=1e-5, atol=1e-6
        )
    assert float(jnp.max(jnp.abs(scores[:, 1, 0] - scores[:, 0, 0]))) > 1e-3  # it rotates
    back = rotate_rows(rq, n_heads=2, base=10000.0, inverse=True)
    np.testing.assert_allclose(back, jnp.tile(q, (1, 6, 1)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_gated_feed_forward_learns_in_each_slot_and_exports_in_order():
    gate, up, down = _linears([(8, 12), (8, 12), (12, 8)], 4)
    part = transplant.from_swiglu(gate, up, down, optimiser=optax.sgd(0.1))
    assert [name for name, _ in part.children()] == ["gate", "up", "down"]
    records = part.export_arrays("ff")
    for record, lin in zip(records, (gate, up, down), strict=True):
        assert bool(eqx.tree_equal(record, fusedpc.LinearParams(lin.weight, lin.bias)))
    pipeline = fusedpc.FusedPipeline(part)
    pipeline.step(normal(15, (6, 8)), normal(16, (6, 8)))
    assert [row["part"] for row in pipeline.report()] == ["gate", "up", "down"]
    assert all(row["update_norm"] > 0 for row in pipeline.report())


# --------------------------------------------------------------------------- errors
def test_bad_options_are_refused_by_name():
    for name, value in (("norm", "batch"), ("positions", "alibi"), ("feed_forward", "relu")):
        with pytest.raises(ValueError, match=rf"GPTConfig.{name} must be one of .*{value!r}"):
            fusedpc.GPTConfig(**TINY, **{name: value}).validate()
        with pytest.raises(ValueError, match=rf"GPT: {name} must be one of .*{value!r}"):
            GPT(**TINY, **{name: value}, key=jax.random.key(0))
    with pytest.raises(ValueError, match="head width width / n_heads must be even, got 18 / 2"):
        fusedpc.GPTConfig(**{**TINY, "width": 18}, positions="rotary").validate()
    rotary = {**TINY, "positions": "rotary"}
    with pytest.raises(ValueError, match="GPTConfig.learn='token,position' names the slot "
                                         "'position', but this GPT has rotary positions"):
        fusedpc.GPTConfig(**rotary, learn="token,position").validate()
    gpt = GPT(**rotary, key=jax.random.key(0))
    with pytest.raises(ValueError, match="learn names the slot 'position'"):
        fusedpc.hybrid_from_gpt(gpt, learn={"position": optax.sgd(0.1)})
    with pytest.raises(ValueError, match="position_part names the slot 'position'"):
        fusedpc.hybrid_from_gpt(gpt, position_part=frozen.embedding(normal(0, (8, 16))))
    with pytest.raises(ValueError, match="has no position table but the reference GPT has "
                                         "positions='table'"):
        fusedpc.to_reference(fusedpc.hybrid_from_gpt(gpt), GPT(**TINY, key=jax.random.key(0)))
    tableless = fusedpc.core.replace_fields(
        fusedpc.hybrid_from_gpt(GPT(**TINY, key=jax.random.key(0))), position=None
    )
    with pytest.raises(ValueError, match=r"blocks\[0\].attention has positions=None but the "
                                         r"reference's attention positions='rotary'"):
        fusedpc.to_reference(tableless, gpt)
    with pytest.raises(TypeError, match=r"blocks\[0\].n1 must export 1 RMSNormParams"):
        fusedpc.to_reference(fusedpc.hybrid_from_gpt(GPT(**TINY, key=jax.random.key(0))),
                             GPT(**TINY, norm="rms", key=jax.random.key(0)))
    lins = [frozen.linear(lin) for lin in _linears([(8, 8)] * 4, 3)]
    with pytest.raises(ValueError, match="positions must be one of .*got 'alibi'"):
        MultiHeadAttention(*lins, n_heads=2, positions="alibi")
    with pytest.raises(ValueError, match="rotary_base must be a number > 1"):
        MultiHeadAttention(*lins, n_heads=2, positions="rotary", rotary_base=0.5)
    odd = MultiHeadAttention(*lins, n_heads=8, positions="rotary")  # head width 1
    with pytest.raises(ValueError, match="the head width must be even, got 1"):
        odd.compile("attn").forward(odd.init_state(jax.random.key(0)), normal(0, (1, 2, 8)), CTX)


def test_bad_parts_are_refused_by_name():
    gate, up, down = _linears([(8, 12), (8, 10), (12, 8)], 4)
    with pytest.raises(ValueError, match=r"gate and up must have the same weight shape"):
        transplant.from_swiglu(gate, up, down)
    mismatched = GatedFeedForward(frozen.linear(gate), frozen.linear(up), frozen.linear(down))
    with pytest.raises(ValueError, match=r"ff: the slots gate and up must output the same "
                                         r"shape, got \(6, 12\) \(gate\) and \(6, 10\) \(up\)"):
        mismatched.compile("ff").forward(mismatched.init_state(jax.random.key(0)),
                                         normal(0, (6, 8)), CTX)
    with pytest.raises(TypeError, match="GatedFeedForward.down: expected a part"):
        GatedFeedForward(frozen.linear(gate), frozen.linear(gate), down)
    with pytest.raises(ValueError, match="GatedFeedForward: activation: unknown activation"):
        GatedFeedForward(frozen.linear(gate), frozen.linear(gate), frozen.linear(down), "swish")
    with pytest.raises(TypeError, match="rms_norm: expected an eqx.nn.RMSNorm, got LayerNorm"):
        frozen.rms_norm(eqx.nn.LayerNorm(8))
    with pytest.raises(TypeError, match="from_rms_norm: expected an eqx.nn.RMSNorm"):
        transplant.from_rms_norm(eqx.nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"bias must have the weight's shape \(8,\)"):
        LearningRMSNorm(jnp.ones(8), jnp.zeros(7))
    norm = frozen.rms_norm(width=8)
    with pytest.raises(ValueError, match=r"norm: expected input of shape \(\.\.\., 8\)"):
        norm.compile("norm").forward(norm.init_state(jax.random.key(0)), normal(0, (2, 5)), CTX)


if __name__ == "__main__":
    print(json.dumps(sgd_parity(OPTIONS["all_three"])[0]))
