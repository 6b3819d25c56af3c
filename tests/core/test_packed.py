"""Report values measured and packed together (`fusedpc.core._norms.row_squares`,
`segment_squares`, `gather_sums`; `fusedpc.core._packed.Packed`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.core import Packed
from fusedpc.core._norms import (
    SMALL_ROWS,
    gather_sums,
    row_squares,
    segment_squares,
    sums_finite_vector,
)


def _expected(a: np.ndarray, kept: int) -> np.ndarray:
    return np.sum(np.square(a.astype(np.float64)).reshape(*a.shape[:kept], -1), -1)


def test_row_squares_measure_small_arrays_together_and_large_ones_in_place():
    rng = np.random.default_rng(0)
    shapes = [(64,), (2, 64), (65, 64), (3, 5, 7), (), (2, 96, 96), (129,), (0,)]
    keep = [0, 1, 0, 2, 0, 1, 0, 0]
    leaves = [rng.normal(size=s).astype(np.float32) for s in shapes]
    leaves.append(np.ones((2, 3), np.float16))  # another dtype, widened to float32
    keep.append(1)
    assert int(np.prod(shapes[5][1:])) > SMALL_ROWS  # one array takes the dot product path

    def measure(xs):
        return row_squares([jnp.asarray(x).astype(jnp.float32) for x in xs], keep)

    vector, first = jax.jit(measure)(leaves)
    first = measure(leaves)[1]
    assert vector.dtype == jnp.float32
    for a, kept, start in zip(leaves, keep, first, strict=True):
        want = _expected(a, kept).reshape(-1)
        got = np.asarray(vector[start:start + want.size])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert vector.shape == (sum(int(np.prod(a.shape[:k])) for a, k in zip(leaves, keep)),)
    # the small arrays are reduced together: one reduction for seven of them, not seven; the
    # large one is a dot product of its own
    text = str(jax.make_jaxpr(measure)(leaves))
    assert text.count("reduce_sum") <= 3
    assert text.count("dot_general") == 1


def test_a_non_finite_entry_stays_in_its_own_row():
    a = np.ones((3, 4), np.float32)
    a[1, 2] = np.nan
    b = np.full((5,), 2.0, np.float32)
    c = np.full((4, 4), 3e19, np.float32)  # finite entries whose sum of squares overflows
    vector, _ = jax.jit(lambda xs: row_squares(xs, [1, 0, 0]))([a, b, c])
    got = np.asarray(vector)
    assert got[0] == 4.0 and np.isnan(got[1]) and got[2] == 4.0
    assert got[3] == 20.0 and np.isinf(got[4])
    flags = sums_finite_vector([0, 1, None, 3, 4], vector)
    assert np.asarray(flags).tolist() == [True, False, True, True, False]


def test_segment_squares_use_larger_blocks_for_long_rows():
    rng = np.random.default_rng(1)
    long = rng.normal(size=(128 * 256 + 5,)).astype(np.float32)  # beyond 256 blocks of 128
    short = rng.normal(size=(3, 7)).astype(np.float32)
    got = np.asarray(jax.jit(lambda xs: segment_squares(xs, [0, 1]))([long, short]))
    np.testing.assert_allclose(got[0], _expected(long, 0), rtol=1e-5)
    np.testing.assert_allclose(got[1:], _expected(short, 1), rtol=1e-6)
    assert segment_squares([], []).shape == (0,)


def test_gather_sums_adds_each_group():
    values = jnp.asarray([1.0, 2.0, 4.0, 8.0])
    got = gather_sums(values, [[0, 3], [], [1, 1, 2], [2]])
    assert np.asarray(got).tolist() == [9.0, 0.0, 8.0, 4.0]
    assert gather_sums(values, []).shape == (0,)


def test_packed_tree_round_trips_with_leading_axes_and_on_the_host():
    key = jax.random.key(0)
    tree = {
        "norm": jnp.float32(1.5),
        "rows": jnp.asarray([2.0, 3.0]),
        "flag": jnp.array(True),
        "flags": jnp.asarray([[True, False]]),
        "count": jnp.int32(7),
        "key": key,
        "none": None,
    }
    packed = Packed.of(tree)
    assert len(packed.vectors) == 3  # float32, bool, int32: one vector each
    assert packed.others == (key,)
    back = packed.unpack()
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for name in ("norm", "rows", "flag", "flags", "count"):
        assert back[name].shape == tree[name].shape and back[name].dtype == tree[name].dtype
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(tree[name]))
    # stacked over steps (as `run` stacks them): the leading axis comes first in every leaf
    other = Packed.of(jax.tree_util.tree_map(lambda a: a, {**tree, "norm": jnp.float32(-1)}))
    stacked = jax.tree_util.tree_map(lambda *v: jnp.stack(v), packed, other)
    both = stacked.unpack()
    assert both["flags"].shape == (2, 1, 2)
    assert np.asarray(both["norm"]).tolist() == [1.5, -1.0]
    # on the host (`jax.device_get`): NumPy in, NumPy out
    host = jax.device_get(Packed.of({k: v for k, v in tree.items() if k != "key"}))
    assert isinstance(host.unpack()["rows"], np.ndarray)


@pytest.mark.slow
def test_a_step_writes_its_reports_as_a_few_arrays_however_deep_the_tree():
    """The parts' norms and flags and the state's flags leave the compiled step as one vector
    per dtype: a hundred small outputs were a hundred kernels to compile."""

    def metric_leaves(blocks: int) -> tuple[int, int]:
        config = fusedpc.GPTConfig(vocab_size=11, width=8, n_heads=2, n_blocks=blocks,
                                   ff_width=16, max_len=4)
        tree, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
        program = fusedpc.make_step(tree, "softmax_cross_entropy")
        ids = jnp.zeros((2, 4), jnp.int32)
        _, out = jax.jit(program.step)(program.init(jax.random.key(1)), ids, ids)
        rows = fusedpc.core.report_rows(out.metrics.parts)
        assert all(np.isfinite(r["weight_norm"]) for r in rows)
        return len(jax.tree_util.tree_leaves(out.metrics)), len(rows)

    (one, rows_one), (three, rows_three) = metric_leaves(1), metric_leaves(3)
    assert rows_three > rows_one  # more parts report...
    assert one == three  # ...through the same few arrays
    assert one <= 16
