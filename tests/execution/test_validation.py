"""Input validation at the executor boundary, before anything is compiled or donated.

Every bad input raises a `ValueError` or `TypeError` whose message names the argument or the
part path, the expected and the actual value; afterwards the state is untouched (same leaves,
none deleted, same values), no step was counted and nothing was traced.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal

import fusedpc
from fusedpc import frozen

VOCAB, SEQ = 11, 8
CONFIG = fusedpc.GPTConfig(
    vocab_size=VOCAB, width=16, n_heads=2, n_blocks=1, ff_width=32, max_len=SEQ
)


@pytest.fixture(scope="module")
def gpt() -> fusedpc.FusedPipeline:
    """A tiny GPT whose every slot learns; built once (nothing here ever runs a step)."""
    part, _ = fusedpc.build_gpt(CONFIG, optax.sgd(0.1), jax.random.key(0))
    return fusedpc.FusedPipeline(part, error_fn=CONFIG.error_fn)


@pytest.fixture(scope="module")
def mlp() -> fusedpc.FusedPipeline:
    """tanh, then a learning network 4 -> 5 -> 3, squared error."""
    network = fusedpc.PCNetwork([4, 5, 3], "tanh", key=jax.random.key(1))
    tree = fusedpc.Sequential(
        [frozen.tanh(), fusedpc.LearningNetwork(network, optimiser=optax.sgd(0.1))]
    )
    return fusedpc.FusedPipeline(tree)


def _ids(seed: int, shape: tuple[int, ...] = (2, SEQ)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


def _with(ids: np.ndarray, value: int) -> np.ndarray:
    """`ids` with one entry set to `value`."""
    bad = ids.copy()
    bad[1, 3] = value
    return bad


@contextlib.contextmanager
def refused(pipeline: fusedpc.FusedPipeline, error: type[Exception], *fragments: str):
    """Expect `error` with every fragment in its message; then check that nothing happened."""
    leaves = jax.tree_util.tree_leaves(pipeline.state)
    kept = [np.array(leaf, copy=True) for leaf in leaves]
    steps, traces = pipeline.steps, dict(pipeline.trace_counts)
    with pytest.raises(error) as info:
        yield
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    now = jax.tree_util.tree_leaves(pipeline.state)
    assert len(now) == len(leaves)
    assert all(a is b for a, b in zip(now, leaves, strict=True)), "the state was replaced"
    assert not any(leaf.is_deleted() for leaf in leaves), "the state was donated"
    for old, new in zip(kept, now, strict=True):
        assert np.array_equal(old, np.asarray(new))
    assert pipeline.steps == steps
    # Refusing values (class ids) comes after the one trace the shape check needs; the next
    # call with these shapes reuses it (test_program.py). Nothing else is traced or compiled.
    grown = {name: pipeline.trace_counts[name] - traces[name] for name in traces}
    assert set(grown.values()) <= {0, 1} and sum(grown.values()) <= 1, grown


# --------------------------------------------------------------------------- token ids
def test_float_ids_where_ids_are_expected(gpt):
    ids = _ids(0)
    with refused(gpt, TypeError, "<root>", "expected integer token ids", "float32"):
        gpt.step(ids.astype(np.float32), ids)
    with refused(gpt, TypeError, "<root>", "expected integer token ids", "bool"):
        gpt.step(ids > 3, ids)
    with refused(gpt, TypeError, "<root>", "expected integer token ids", "float32"):
        gpt.predict(jnp.asarray(ids, jnp.float32))


def test_ids_of_the_wrong_rank_or_length(gpt):
    ids = _ids(0)
    with refused(gpt, ValueError, "<root>", "expected token ids of shape (batch, seq)", "(8,)"):
        gpt.step(ids[0], ids[0])
    with refused(gpt, ValueError, "xs: expected a batch of shape (steps, rows, ...)", "(2, 8)"):
        gpt.run(ids, ids)
    with refused(gpt, ValueError, "<root>", "rank 2 (batch, seq)", "(1, 2, 8)", "rank 3"):
        gpt.step(ids[None], ids[None])
    long = _ids(1, (2, SEQ + 1))
    with refused(gpt, ValueError, "<root>", "sequence length 9", f"{SEQ} positions"):
        gpt.step(long, long)


def test_ids_out_of_range_on_host_are_refused(gpt):
    ids = _ids(0)
    with refused(gpt, ValueError, "<root>", f"token ids must lie in [0, {VOCAB})", "got 11"):
        gpt.step(_with(ids, VOCAB), ids)
    with refused(gpt, ValueError, "<root>", f"[0, {VOCAB})", "got -1"):
        gpt.step(_with(ids, -1), ids)
    with refused(gpt, ValueError, "<root>", f"[0, {VOCAB})", "got 15"):
        gpt.run(np.stack([ids, ids + 5]), np.stack([ids, ids]))
    with refused(gpt, ValueError, "<root>", f"[0, {VOCAB})", "got 20"):
        gpt.predict(ids + 10)


def test_ids_out_of_range_on_device_need_the_flag():
    part, _ = fusedpc.build_gpt(CONFIG, optax.sgd(0.1), jax.random.key(0))
    checked = fusedpc.FusedPipeline(part, CONFIG.error_fn, check_device_ids=True)
    ids = _ids(0)
    bad = jnp.asarray(ids + 5)
    with refused(checked, ValueError, "<root>", f"token ids must lie in [0, {VOCAB})", "got 15"):
        checked.step(bad, ids)
    with refused(checked, ValueError, "target: class ids must lie in [0, 11)", "got 15"):
        checked.step(ids, bad)
    # Host arrays are checked whatever the flag.
    with refused(checked, ValueError, "<root>", "got 15"):
        checked.step(ids + 5, ids)


def test_ids_on_device_are_not_read_back_without_the_flag():
    # Without check_device_ids a device array only has its dtype checked (reading its values
    # would cost a device-to-host transfer per call), so out-of-range ids pass the boundary
    # and the step runs. The in-program id check then refuses to commit the step, for its
    # own reason (not as non-finite). A learning embedding keeps this test cheap.
    table = normal(0, (VOCAB, 3))
    pipeline = fusedpc.FusedPipeline(fusedpc.LearningEmbedding(table, optax.sgd(0.1)))
    ids = _ids(0)
    with refused(pipeline, ValueError, "<root>", "got 15"):
        pipeline.step(ids + 5, normal(1, (2, SEQ, 3)))
    with refused(pipeline, TypeError, "<root>", "expected integer token ids", "float32"):
        pipeline.step(jnp.asarray(ids, jnp.float32), normal(1, (2, SEQ, 3)))
    kept = [np.array(leaf, copy=True) for leaf in jax.tree_util.tree_leaves(pipeline.state)]
    pipeline.step(jnp.asarray(ids + 5), normal(1, (2, SEQ, 3)))
    assert pipeline.steps == 1 and pipeline.skipped_steps == 1
    assert pipeline.skip_counts["id out of range"] == 1
    assert pipeline.skip_reason().reason == "token id out of range"
    assert pipeline.nonfinite_part() is None
    for old, new in zip(kept, jax.tree_util.tree_leaves(pipeline.state), strict=True):
        assert np.array_equal(old, np.asarray(new))


# --------------------------------------------------------------------------- targets
def test_targets_of_the_wrong_shape_or_kind(gpt):
    ids = _ids(0)
    with refused(gpt, ValueError, "target: expected integer class ids of shape (2, 8)", "(2, 4)"):
        gpt.step(ids, ids[:, :4])
    with refused(gpt, ValueError, "target:", "rows of shape (2, 8, 11)", "(2, 8, 3)"):
        gpt.step(ids, np.zeros((2, SEQ, 3), np.float32))
    # Float class ids: refused (a float target must be rows of probabilities).
    with refused(gpt, ValueError, "target:", "integer ids of shape (2, 8)"):
        gpt.step(ids, ids.astype(np.float32))
    with refused(gpt, ValueError, "run: xs and targets must have the same number of steps", "2"):
        gpt.run(np.stack([ids, ids]), np.stack([ids, ids, ids]))


def test_target_class_ids_out_of_range(gpt):
    # Out-of-range class ids would silently become all-zero one-hot rows.
    ids = _ids(0)
    with refused(gpt, ValueError, "target: class ids must lie in [0, 11)", "got 15"):
        gpt.step(ids, ids + 5)
    with refused(gpt, ValueError, "target: class ids must lie in [0, 11)", "got -1"):
        gpt.step(ids, _with(ids, -1))
    with refused(gpt, ValueError, "targets: class ids must lie in [0, 11)", "softmax"):
        gpt.run(np.stack([ids, ids]), np.stack([ids, ids + 5]))


def test_squared_error_target_shape(mlp):
    x = normal(0, (6, 4))
    with refused(mlp, ValueError, "target: expected shape (6, 3) (the output's shape)", "(6, 2)"):
        mlp.step(x, normal(1, (6, 2)))
    with refused(mlp, ValueError, "target: expected shape (6, 3)", "(5, 3)"):
        mlp.step(x, normal(1, (5, 3)))


# --------------------------------------------------------------------------- float inputs
def test_ints_where_floats_are_expected():
    network = fusedpc.PCNetwork([4, 5, 3], "tanh", key=jax.random.key(1))
    pipeline = fusedpc.FusedPipeline(fusedpc.LearningNetwork(network, optax.sgd(0.1)))
    x = np.arange(24, dtype=np.int32).reshape(6, 4)
    with refused(pipeline, TypeError, "<root>", "expected a floating-point input", "int32"):
        pipeline.step(x, normal(1, (6, 3)))
    with refused(pipeline, TypeError, "<root>", "floating-point", "complex64"):
        pipeline.step(x.astype(np.complex64), normal(1, (6, 3)))


def test_a_single_row_needs_a_row_axis(mlp):
    with refused(mlp, ValueError, "x: expected a batch of shape (rows, ...)", "got shape (4,)"):
        mlp.step(normal(0, (4,)), normal(1, (3,)))


def test_wrong_width_names_the_part(mlp):
    with refused(
        mlp, ValueError, "parts[1]: expected input of shape (..., 4)", "got shape (6, 3)"
    ):
        mlp.step(normal(0, (6, 3)), normal(1, (6, 3)))
    # run checks one step's batch: the shape named is that of xs[0].
    with refused(mlp, ValueError, "parts[1]: expected input of shape (..., 4)", "(6, 5)"):
        mlp.run(normal(0, (2, 6, 5)), normal(1, (2, 6, 3)))


# --------------------------------------------------------------------------- empty, non-arrays
def test_empty_batches(gpt, mlp):
    ids = _ids(0)
    with refused(gpt, ValueError, "x: expected a non-empty batch, got shape (0, 8)"):
        gpt.step(ids[:0], ids[:0])
    # An empty sequence: every row axis counts (this used to fail deep inside a part).
    with refused(gpt, ValueError, "x: expected a non-empty batch, got shape (2, 0)"):
        gpt.step(ids[:, :0], ids[:, :0])
    with refused(gpt, ValueError, "xs: expected a non-empty batch, got shape (0, 2, 8)"):
        gpt.run(ids[None][:0], ids[None][:0])
    with refused(gpt, ValueError, "xs: expected a non-empty batch, got shape (1, 0, 8)"):
        gpt.run(ids[None, :0], ids[None, :0])
    with refused(mlp, ValueError, "x: expected a non-empty batch, got shape ()"):
        mlp.step(jnp.float32(1.0), normal(1, (6, 3)))
    with refused(mlp, ValueError, "x: expected a non-empty batch, got shape (0, 4)"):
        mlp.predict(jnp.zeros((0, 4), jnp.float32))


def test_non_arrays_are_named(gpt, mlp):
    ids = _ids(0)
    with refused(gpt, TypeError, "x: expected an array (numpy or jax), got list"):
        gpt.step(ids.tolist(), ids)
    with refused(gpt, TypeError, "target: expected an array (numpy or jax), got tuple"):
        gpt.step(ids, tuple(ids.tolist()))
    with refused(gpt, TypeError, "xs: expected an array", "got list"):
        gpt.run([ids], ids[None])
    with refused(mlp, TypeError, "x: expected an array", "np.asarray(x)"):
        mlp.predict([[0.0, 1.0, 2.0, 3.0]])


def test_refusals_do_not_disturb_a_later_step(mlp):
    # After all the refusals above the pipeline is as built: a good step runs and commits.
    before = [np.array(a, copy=True) for a in jax.tree_util.tree_leaves(mlp.state)]
    mlp.step(normal(0, (6, 4)), normal(1, (6, 3)))
    assert mlp.steps == 1 and bool(mlp.last_metrics.committed)
    after = jax.tree_util.tree_leaves(mlp.state)
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, after, strict=True))
    assert re.fullmatch(r"parts\[1\]", mlp.report()[0]["part"])
