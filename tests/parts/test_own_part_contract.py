"""A part of your own gets everything fusedpc's own parts get.

`OwnLinear` below is written from docs/architecture.md's "Writing your own part" alone and
imports only `fusedpc` and `fusedpc.core` (with jax, equinox and optax): it reaches global
clipping parity with the `optax.chain(clip_by_global_norm, ...)` twin, takes the stacked
optimiser step inside an unrolled `Repeat`, runs under `compute_dtype="bfloat16"`, honours a
row mask, and its own metrics class reaches `report()`.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
import fusedpc.core


class OwnLinearState(eqx.Module):
    params: fusedpc.core.LinearParams
    opt_state: optax.OptState


class GradientReport(fusedpc.core.AbstractMetrics):
    """The part's own report: the norm of its gradient (a row of its own in `report()`)."""

    gradient_norm: jax.Array
    finite: jax.Array


class OwnLinear(fusedpc.AbstractPart):
    """$y = x W^\\top + b$; $g_W = E^\\top x / R$, $g_b = \\sum_r E_r / R$; input error $E W$."""

    defers_updates: ClassVar[bool] = True  # the optimiser's result only goes to the state

    weight: jax.Array
    bias: jax.Array
    optimiser: optax.GradientTransformation = eqx.field(static=True)

    def init_state(self, key):
        del key
        params = fusedpc.core.LinearParams(self.weight, self.bias)
        return OwnLinearState(params, self.optimiser.init(params))

    def compile(self, path):
        out_width, in_width = self.weight.shape

        def forward(state, x, ctx):
            fusedpc.core.expect_last_axis(path, x, in_width)
            x = ctx.to_compute(x)
            y = ctx.matmul(x, state.params.weight.T) + ctx.to_compute(state.params.bias)
            return y, x

        def backward(state, x, error, ctx):
            rows_x, rows_e = x.reshape(-1, in_width), error.reshape(-1, out_width)
            n = rows_x.shape[0]
            gradients = fusedpc.core.LinearParams(
                ctx.weight_gradient(rows_e, rows_x) / n,
                jnp.sum(fusedpc.core.widened(rows_e), axis=0) / n,
            )
            input_error = ctx.matmul(error, state.params.weight)
            params, opt_state = ctx.optimiser_step(self.optimiser, state.params, gradients,
                                                   state.opt_state)
            norm = fusedpc.core.tree_norm(gradients)
            metrics = GradientReport(norm, jnp.isfinite(norm))
            return input_error, OwnLinearState(params, opt_state), metrics

        def write_back(state):
            return eqx.tree_at(lambda p: (p.weight, p.bias), self,
                               (state.params.weight, state.params.bias))

        return fusedpc.Core(forward, backward, write_back)


class OwnLinearKeepingItsStep(OwnLinear):
    """The same part, declaring that it does not defer its optimiser step."""

    defers_updates: ClassVar[bool] = False


def _own(seed: int, in_width: int, out_width: int, optimiser, cls=OwnLinear) -> OwnLinear:
    k1, k2 = jax.random.split(jax.random.key(seed))
    weight = jax.random.normal(k1, (out_width, in_width)) / np.sqrt(in_width)
    return cls(weight, 0.1 * jax.random.normal(k2, (out_width,)), optimiser)


def _tree(optimiser) -> fusedpc.Sequential:
    return fusedpc.Sequential([_own(1, 4, 6, optimiser), fusedpc.frozen.tanh(),
                               _own(2, 6, 3, optimiser)])


def _batch(rows: int = 8):
    x = jax.random.normal(jax.random.key(10), (rows, 4))
    return x, jnp.sin(x[:, :3] * 3.0)


def _params(tree) -> list:
    return [(tree.parts[i].weight, tree.parts[i].bias) for i in (0, 2)]


def _twin_loss(params, x, target):
    (w1, b1), (w2, b2) = params
    y = jnp.tanh(x @ w1.T + b1) @ w2.T + b2
    return 0.5 * jnp.mean(jnp.sum((y - target) ** 2, axis=-1))


@pytest.mark.slow
def test_global_clipping_matches_the_optax_chain_twin():
    bound, rate = 0.05, 1e-2
    tree = _tree(optax.adam(rate))
    x, target = _batch()
    program = fusedpc.make_step(tree, clip_global_norm=bound)
    carry = program.init(jax.random.key(0))
    twin = optax.chain(optax.clip_by_global_norm(bound), optax.adam(rate))
    params = _params(tree)
    opt_state = twin.init(params)
    for _ in range(3):
        carry, out = jax.jit(program.step)(carry, x, target)
        assert bool(out.metrics.committed)
        grads = jax.grad(_twin_loss)(params, x, target)
        assert float(optax.global_norm(grads)) > 4 * bound  # the clipping acts
        with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes float and int32
            updates, opt_state = twin.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    got = _params(program.write_back(carry.state))
    for (w, b), (w_ref, b_ref) in zip(got, params, strict=True):
        np.testing.assert_allclose(w, w_ref, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(b, b_ref, rtol=2e-5, atol=2e-6)
    # without the bound the same three steps land elsewhere: the clipping was not a no-op
    free = fusedpc.make_step(tree)
    free_carry = free.init(jax.random.key(0))
    for _ in range(3):
        free_carry, _ = jax.jit(free.step)(free_carry, x, target)
    unclipped = _params(free.write_back(free_carry.state))
    assert not np.allclose(unclipped[0][0], got[0][0], atol=1e-4)


def test_an_unrolled_repeat_takes_its_blocks_stacked_optimiser_step(monkeypatch):
    import fusedpc.parts._repeat as repeat_module

    calls = []
    apply_stacked = repeat_module._apply_stacked
    monkeypatch.setattr(repeat_module, "_apply_stacked",
                        lambda *a, **k: calls.append(1) or apply_stacked(*a, **k))
    x, target = jax.random.normal(jax.random.key(3), (8, 5)), jnp.zeros((8, 5))

    def trained(cls):
        blocks = [_own(20 + i, 5, 5, optax.adam(1e-2), cls) for i in range(3)]
        pipeline = fusedpc.FusedPipeline(fusedpc.Repeat(blocks, unroll=True))
        for _ in range(3):
            pipeline.step(x, target)
        return pipeline

    stacked = trained(OwnLinear)
    assert calls, "the blocks' optimiser steps did not run over the stack"
    calls.clear()
    own_steps = trained(OwnLinearKeepingItsStep)
    assert not calls
    for a, b in zip(jax.tree_util.tree_leaves(stacked.state),
                    jax.tree_util.tree_leaves(own_steps.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    rows = stacked.report()
    assert [row["part"] for row in rows] == ["[0]", "[1]", "[2]"]


def test_it_runs_in_bfloat16_under_the_step_compute_dtype():
    tree = _tree(optax.sgd(0.1))
    x, target = _batch()
    wide = fusedpc.make_step(tree)
    narrow = fusedpc.make_step(tree, compute_dtype="bfloat16")
    carry = narrow.init(jax.random.key(0))
    text = str(jax.make_jaxpr(narrow.step)(carry, x, target))
    assert "bf16" in text and "dot_general" in text
    _, out_narrow = jax.jit(narrow.step)(carry, x, target)
    _, out_wide = jax.jit(wide.step)(wide.init(jax.random.key(0)), x, target)
    assert out_narrow.output.dtype == jnp.float32  # handed back in float32
    # bfloat16 rounding (8 bits of mantissa), not float32's
    error = float(jnp.max(jnp.abs(out_narrow.output - out_wide.output)))
    assert 0 < error < 5e-2, error


def test_a_row_mask_gives_the_step_on_the_real_rows_alone():
    tree = _tree(optax.sgd(0.5))
    x, target = _batch(rows=8)
    mask = jnp.arange(8) < 5
    program = fusedpc.make_step(tree)
    padded = x.at[5:].set(7.0)  # what padding holds does not matter
    masked, _ = jax.jit(program.step)(program.init(jax.random.key(0)), padded, target, mask)
    alone, _ = jax.jit(program.step)(program.init(jax.random.key(0)), x[:5], target[:5])
    for a, b in zip(jax.tree_util.tree_leaves(masked.state),
                    jax.tree_util.tree_leaves(alone.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = _params(program.write_back(masked.state))[0][0]
    assert not np.allclose(moved, tree.parts[0].weight, atol=1e-3)


def test_its_own_metrics_reach_the_report():
    pipeline = fusedpc.FusedPipeline(_tree(optax.sgd(0.1)))
    x, target = _batch()
    pipeline.step(x, target)
    rows = pipeline.report()
    assert [row["part"] for row in rows] == ["parts[0]", "parts[2]"]
    assert all(set(row) == {"part", "gradient_norm", "finite"} for row in rows)
    assert all(row["gradient_norm"] > 0 and row["finite"] for row in rows)


class LegacyScale(fusedpc.AbstractPart):
    """A part written for release 0.3: two- and three-argument core functions."""

    scale: jax.Array

    def init_state(self, key):
        del key
        return self.scale

    def compile(self, path):
        def forward(state, x):
            return x * state, None

        def backward(state, cache, error):
            return error * state, state, fusedpc.core.FiniteFlag(jnp.array(True))

        return fusedpc.Core(forward, backward, lambda state: LegacyScale(state))


def test_a_part_written_for_0_3_still_runs_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="without the step context"):
        core = LegacyScale(jnp.full((3,), 2.0)).compile("")
    ctx = fusedpc.core.StepContext()
    y, cache = core.forward(jnp.full((3,), 2.0), jnp.ones((2, 3)), ctx)
    np.testing.assert_array_equal(y, jnp.full((2, 3), 2.0))
    with pytest.warns(DeprecationWarning):
        pipeline = fusedpc.FusedPipeline(fusedpc.Sequential([LegacyScale(jnp.full((3,), 2.0)),
                                                             fusedpc.frozen.tanh()]))
    out, input_error = pipeline.step(jnp.ones((2, 3)), jnp.zeros((2, 3)))
    np.testing.assert_allclose(out, jnp.tanh(2.0) * jnp.ones((2, 3)), rtol=1e-6)
    # a core called without the context (a 0.3 composite calling its child) gets the plain one
    tanh = fusedpc.frozen.tanh()
    new_core = tanh.compile("")
    with pytest.warns(DeprecationWarning, match="without the step context"):
        y, _ = new_core.forward(tanh.init_state(jax.random.key(0)), jnp.zeros((2, 3)))
    np.testing.assert_array_equal(y, jnp.zeros((2, 3)))
