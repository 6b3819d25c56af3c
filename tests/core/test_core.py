"""The part contract (`fusedpc.core._part`): paths, field replacement, shape checks, norms and the
metrics walk."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedpc
from fusedpc.core import (
    Measured,
    PendingFinite,
    PendingNorm,
    StepContext,
    all_finite,
    display_path,
    expect_last_axis,
    expect_rank,
    iter_metrics,
    join_path,
    replace_fields,
    resolve_pending,
    stack_metrics,
    tree_norm,
)
from fusedpc.core._measured import state_norms_finite
from fusedpc.core._norms import dot_squares, leaf_norm_finite, sums_of_squares, tree_norms


def test_join_and_display_path():
    assert join_path("", "parts[0]") == "parts[0]"
    assert join_path("parts[0]", "branch") == "parts[0].branch"
    assert join_path("blocks", "[3]") == "blocks[3]"
    assert join_path("blocks[3]", "attention") == "blocks[3].attention"
    assert display_path("") == "<root>"
    assert display_path("parts[1]") == "parts[1]"


def test_the_part_base_is_abstract():
    with pytest.raises(TypeError):
        fusedpc.AbstractPart()

    class OnlyState(fusedpc.AbstractPart):
        def init_state(self, key):
            return None

    with pytest.raises(TypeError):
        OnlyState()


def test_validate_input_accepts_everything_by_default():
    assert fusedpc.frozen.relu().validate_input(jnp.zeros((2, 3)), "") is None


def test_core_is_a_named_triple():
    assert fusedpc.Core._fields == ("forward", "backward", "write_back")


class _Checked(eqx.Module):
    a: int
    b: jax.Array

    def __init__(self, a, b):
        if a < 0:
            raise ValueError("a must be non-negative")
        self.a, self.b = a, b


def test_replace_fields_copies_without_running_init():
    original = _Checked(1, jnp.ones(2))
    new = replace_fields(original, a=-5)  # __init__ would refuse -5
    assert (new.a, original.a) == (-5, 1)
    assert new.b is original.b and type(new) is _Checked
    with pytest.raises(TypeError, match=re.escape("_Checked has no fields ['c']")):
        replace_fields(original, c=3)


def test_expect_last_axis_and_rank_messages():
    expect_last_axis("parts[1]", jnp.zeros((2, 5)), 5)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "parts[1]: expected input of shape (..., 5), got shape (2, 3). "
            "The part before it (or the batch) must provide 5 features."
        ),
    ):
        expect_last_axis("parts[1]", jnp.zeros((2, 3)), 5)
    with pytest.raises(ValueError, match=re.escape("<root>: expected query of shape (..., 4)")):
        expect_last_axis("", jnp.zeros(()), 4, what="query")

    expect_rank("attn", jnp.zeros((2, 3, 4)), 3, "(batch, seq, features)")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "attn: expected input of rank 3 (batch, seq, features), got shape (6, 4) (rank 2)."
        ),
    ):
        expect_rank("attn", jnp.zeros((6, 4)), 3, "(batch, seq, features)")


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(3), "n": jnp.arange(3)}))
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.nan])}))
    assert not bool(all_finite([jnp.array([jnp.inf])]))
    assert bool(all_finite({}))
    assert bool(all_finite({"ids": jnp.arange(4)}))  # integer leaves are always finite


def test_tree_norm():
    tree = {"a": jnp.array([3.0]), "b": jnp.array([[4.0]], jnp.bfloat16), "n": jnp.arange(5)}
    norm = tree_norm(tree)
    assert norm.dtype == jnp.float32 and float(norm) == 5.0  # integers are not parameters
    assert float(tree_norm({})) == 0.0


def test_sums_of_squares_group_leaves_by_shape_and_match_one_reduction_each():
    rng = np.random.default_rng(0)
    leaves = [rng.normal(size=s).astype(np.float32) for s in
              [(64, 64), (64,), (64, 64), (3, 5, 7), (64,), (), (64, 64)]]
    leaves.append(np.ones((2, 3), np.float16))  # another dtype, widened to float32
    sums = jax.jit(sums_of_squares)([jnp.asarray(a) for a in leaves])
    for a, total in zip(leaves, sums, strict=True):
        assert total.dtype == jnp.float32
        expected = np.sum(np.square(a.astype(np.float64)))
        assert float(total) == pytest.approx(expected, rel=1e-5)
    # one reduction per distinct shape, not one per leaf: (64, 64), (64,), (3, 5, 7) and
    # (2, 3) for eight leaves (the scalar needs none)
    text = jax.jit(sums_of_squares).lower([jnp.asarray(a) for a in leaves]).as_text()
    assert text.count("stablehlo.reduce") == 4
    assert sums_of_squares([]) == []
    first, second = tree_norms({"a": jnp.array([3.0]), "n": jnp.arange(2)},
                               [jnp.array([[1.0, 2.0], [2.0, 4.0]])])
    assert float(first) == 3.0 and float(second) == 5.0
    assert [float(n) for n in tree_norms({}, None)] == [0.0, 0.0]


def test_state_norms_finite_flags_every_leaf_as_its_own_norm_would():
    # Reliability III: a float32 sum of squares overflows from entries of ~1.8e19, and the
    # commit rule refused such representable leaves for good; the norms are now taken
    # without overflow, so only a norm beyond float32 itself (~3.4e38) reads as non-finite.
    big = np.full((4, 4), 3e19, np.float32)  # a float32 sum of squares overflows; not the norm
    huge = np.full((4, 4), 3e38, np.float32)  # finite entries whose norm (1.2e39) overflows
    tree = {"w": jnp.ones((4, 4)), "nan": jnp.array([1.0, jnp.nan]), "big": jnp.asarray(big),
            "huge": jnp.asarray(huge), "inf": jnp.full((4, 4), jnp.inf), "ids": jnp.arange(3),
            "s": jnp.float32(2.0), "also": jnp.zeros((2,))}
    flags = jax.jit(state_norms_finite)(tree)
    assert jax.tree_util.tree_structure(flags) == jax.tree_util.tree_structure(tree)
    expected = {k: bool(leaf_norm_finite(v)) for k, v in tree.items()}
    assert {k: bool(v) for k, v in flags.items()} == expected
    assert expected == {"w": True, "nan": False, "big": True, "huge": False, "inf": False,
                        "ids": True, "s": True, "also": True}
    # the norm of the large entries is exact (4 * 3e19), eagerly and compiled
    for norm in (tree_norm(tree["big"]), jax.jit(tree_norm)(tree["big"])):
        assert float(norm) == pytest.approx(1.2e20, rel=1e-6)
    assert float(tree_norm(tree["w"])) == 4.0  # no rescaling where nothing overflowed


def test_learning_metrics():
    old = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.0])}
    new = {"w": jnp.array([1.0, 5.0]), "b": jnp.array([4.0])}
    error = jnp.array([[3.0, 4.0]])
    m = fusedpc.core.learning_metrics(old, new, error, jnp.ones((1, 2)), (2, 1))
    assert isinstance(m, fusedpc.core.PartMetrics)
    assert float(m.update_norm) == 5.0
    assert float(m.error_norm) == 5.0
    assert float(m.weight_norm) == pytest.approx(np.sqrt(1 + 25 + 16))
    assert bool(m.finite) and m.layer_sizes == (2, 1)
    bad = fusedpc.core.learning_metrics(old, new, error, jnp.array([[jnp.nan, 0.0]]), (2, 1))
    assert not bool(bad.finite)


def test_dot_squares_are_sums_of_squares_whole_or_per_row():
    rng = np.random.default_rng(1)
    leaves = [rng.normal(size=s).astype(np.float32) for s in [(5, 3), (2, 4, 6), (7,), ()]]
    leaves.append(np.ones((2, 3), np.float16))  # another dtype, widened to float32
    keep = [0, 1, 0, 0, 2]
    sums = jax.jit(lambda xs: dot_squares(xs, keep))([jnp.asarray(a) for a in leaves])
    for a, kept, total in zip(leaves, keep, sums, strict=True):
        assert total.dtype == jnp.float32 and total.shape == a.shape[:kept]
        expected = np.sum(np.square(a.astype(np.float64)).reshape(*a.shape[:kept], -1), -1)
        np.testing.assert_allclose(np.asarray(total), expected, rtol=1e-6)
    assert dot_squares([]) == []


def test_learning_metrics_measured_later_equal_measured_at_once():
    rng = np.random.default_rng(2)
    old = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)}
    new = jax.tree_util.tree_map(lambda a: a + 0.1 * jnp.cos(a + 1.0), old)
    error = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
    input_error = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    now = fusedpc.core.learning_metrics(old, new, error, input_error, (4, 3))

    def later(old, new, error, input_error):
        ctx = StepContext(measured=Measured())
        measured = ctx.measured
        pending = ctx.learning_metrics(old, new, error, input_error, (4, 3))
        # the error registered again (as another part's input error): measured once
        again = ctx.learning_metrics(new, new, error, None, (3,))
        assert isinstance(pending.update_norm, PendingNorm)
        assert isinstance(pending.finite, PendingFinite)
        return resolve_pending((pending, again), measured)

    got, again = jax.jit(later)(old, new, error, input_error)
    for field in ("update_norm", "error_norm", "weight_norm"):
        np.testing.assert_allclose(float(getattr(got, field)), float(getattr(now, field)),
                                   rtol=1e-6)
    assert bool(got.finite) and got.layer_sizes == (4, 3)
    assert float(again.update_norm) == 0.0 and float(again.error_norm) == float(got.error_norm)
    # without a norm collection in the context, the norms are measured at once
    assert StepContext().measured is None
    direct = StepContext().learning_metrics(old, new, error, None, (4, 3))
    assert float(direct.error_norm) == pytest.approx(float(now.error_norm))
    # in another trace than the collection's (a scan body of a part of your own), the part
    # hands its children `ctx.for_inner_trace()`: their norms are measured at once and
    # nothing pending leaks out of the body

    def scanned(error):
        ctx = StepContext(measured=Measured())

        def body(carry, e):
            inner = ctx.for_inner_trace()
            assert inner.measured is None and ctx.measured is not None
            m = inner.learning_metrics(old, new, e, None, (4, 3))
            assert not isinstance(m.error_norm, PendingNorm)
            return carry, m.error_norm
        return jax.lax.scan(body, 0.0, jnp.stack([error, 2 * error]))[1]

    norms = jax.jit(scanned)(error)
    expected = [float(now.error_norm), 2 * float(now.error_norm)]
    np.testing.assert_allclose(np.asarray(norms), expected, rtol=1e-6)
    # a non-finite input error still names the part
    ctx = StepContext(measured=Measured())
    bad = ctx.learning_metrics(old, new, error, input_error.at[0, 0].set(jnp.inf), (4, 3))
    assert not bool(resolve_pending(bad, ctx.measured).finite)
    # the release-0.3 keyword still runs, with a deprecation warning, and measures at once
    with pytest.warns(DeprecationWarning, match="measure_later"):
        legacy = fusedpc.core.learning_metrics(old, new, error, None, (4, 3),
                                               measure_later=True)
    assert float(legacy.error_norm) == pytest.approx(float(now.error_norm))


def test_measured_rows_of_a_stack_are_the_rows_own_sums():
    rng = np.random.default_rng(3)
    rows_old = [jnp.asarray(rng.normal(size=(3, 2)), jnp.float32) for _ in range(3)]
    rows_new = [r * 1.5 + 0.25 for r in rows_old]

    def measure(rows_old, rows_new):
        ctx = StepContext(measured=Measured())
        measured = ctx.measured
        stacked_old, stacked_new = jnp.stack(rows_old), jnp.stack(rows_new)
        metrics = [ctx.learning_metrics(o, n, n, None, (2,))
                   for o, n in zip(rows_old, rows_new)]
        measured.rows_of(rows_old, stacked_old)
        measured.rows_of(rows_new, stacked_new)
        whole = measured.add(stacked_new)  # the commit rule's check of the stacked leaf
        stacked = stack_metrics(metrics)
        assert isinstance(stacked.update_norm, PendingNorm)
        assert isinstance(stacked.update_norm.slot, np.ndarray)  # known while tracing
        totals = measured.totals()
        return resolve_pending(stacked, measured, totals), totals[whole]

    stacked, whole = jax.jit(measure)(rows_old, rows_new)
    for i, (o, n) in enumerate(zip(rows_old, rows_new)):
        o64, n64 = np.asarray(o, np.float64), np.asarray(n, np.float64)
        np.testing.assert_allclose(float(stacked.update_norm[i]), np.linalg.norm(n64 - o64),
                                   rtol=1e-6)
        np.testing.assert_allclose(float(stacked.weight_norm[i]), np.linalg.norm(n64),
                                   rtol=1e-6)
    expected = sum(np.sum(np.square(np.asarray(n, np.float64))) for n in rows_new)
    np.testing.assert_allclose(float(whole), expected, rtol=1e-6)
    assert np.asarray(stacked.finite).all()


def _metric(value: float) -> fusedpc.core.PartMetrics:
    v = jnp.float32(value)
    return fusedpc.core.PartMetrics(v, v, v, jnp.array(True), (1,))


def test_iter_metrics_walks_in_forward_order_with_paths():
    flag = fusedpc.core.FiniteFlag(jnp.array(True))
    stacked = fusedpc.core.Stacked(
        {
            "ff": fusedpc.core.PartMetrics(
                jnp.arange(3.0), jnp.zeros(3), jnp.zeros(3), jnp.ones(3, bool)
            )
        }
    )
    tree = fusedpc.core.named(
        parts=(_metric(0.0), flag, fusedpc.core.named(branch=_metric(2.0)), stacked)
    )
    walked = list(iter_metrics(tree))
    assert [path for path, _ in walked] == [
        "parts[0]",
        "parts[1]",
        "parts[2].branch",
        "parts[3][0].ff",
        "parts[3][1].ff",
        "parts[3][2].ff",
    ]
    assert isinstance(walked[1][1], fusedpc.core.FiniteFlag)
    assert [float(m.update_norm) for _, m in walked[3:]] == [0.0, 1.0, 2.0]
    assert list(iter_metrics(_metric(1.0)))[0][0] == ""
    assert list(iter_metrics(fusedpc.core.Stacked({}))) == []


def test_named_metrics_keep_the_order_they_were_given():
    # Dicts flatten in sorted key order; `named` keeps the composite's own (forward) order.
    metrics = fusedpc.core.named(wq=_metric(0.0), wk=_metric(1.0), attention=_metric(2.0))
    assert [path for path, _ in iter_metrics(metrics, "block")] == [
        "block.wq",
        "block.wk",
        "block.attention",
    ]
    leaves = jax.tree_util.tree_leaves(metrics)
    assert [float(x) for x in leaves[::4]] == [0.0, 1.0, 2.0]
    rebuilt = jax.tree_util.tree_map(jnp.copy, metrics)
    assert isinstance(rebuilt, fusedpc.core.Named) and rebuilt.names == metrics.names
    assert [path for path, _ in iter_metrics({"b": _metric(0.0), "a": _metric(1.0)})] == [
        "b",
        "a",
    ]
