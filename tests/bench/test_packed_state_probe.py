"""scripts/packed_state_probe.py: fusedpc's step over a packed carry. The per-leaf variant is
the default step bit for bit, the flat one equal to float32 rounding; both keep the old state
and name the failing leaf on a non-finite batch; the script prints one JSON row a variant."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import load_script

from fusedpc.core._packed import Packed


@pytest.fixture(scope="module")
def probe():
    return load_script("packed_state_probe")


def _trained(probe, flat: bool | None, x, y, steps: int = 3):
    _, _, tree = probe._problem()
    import fusedpc

    program = fusedpc.make_step(tree)
    carry = program.init(jax.random.key(0))
    if flat is None:
        step = jax.jit(program.step)
        for _ in range(steps):
            carry, out = step(carry, x, y)
        return carry.state, out
    step = jax.jit(probe.packed_step(program, flat))
    packed = (Packed.of(carry.state), carry.counters)
    for _ in range(steps):
        packed, out = step(packed, x, y)
    return packed[0].unpack(), out


@pytest.mark.slow
def test_packed_steps_train_as_the_default_step(probe):
    x, y, _ = probe._problem()
    reference, ref_out = _trained(probe, None, x, y)
    for flat in (False, True):
        state, out = _trained(probe, flat, x, y)
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(reference)):
            if flat:  # the same elementwise Adam, fused otherwise by XLA
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
            else:  # the layout alone changes nothing
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert float(out.metrics.loss) == pytest.approx(float(ref_out.metrics.loss), rel=1e-6)
        for name in ("update_norm", "weight_norm", "error_norm"):
            assert float(getattr(out.metrics.parts, name)) == pytest.approx(
                float(getattr(ref_out.metrics.parts, name)), rel=1e-5), name


def test_a_non_finite_step_keeps_the_packed_state_and_names_the_leaf(probe):
    x, y, tree = probe._problem()
    import fusedpc

    program = fusedpc.make_step(tree)
    carry = program.init(jax.random.key(0))
    packed = (Packed.of(carry.state), carry.counters)
    before = [np.asarray(v) for v in packed[0].vectors]
    for flat in (False, True):
        kept, out = jax.jit(probe.packed_step(program, flat))(packed, x, y * np.inf)
        assert not bool(out.metrics.committed)
        assert int(kept[1].skipped) == 1
        for a, b in zip(kept[0].vectors, before):
            np.testing.assert_array_equal(np.asarray(a), b)
        # the per-leaf flags, taken on the refused step only, name what went non-finite
        flags = jax.tree_util.tree_leaves(out.metrics.state_finite)
        assert not all(bool(f) for f in flags)


@pytest.mark.slow
def test_every_variant_is_timed_counted_and_compared(probe, capsys):
    rows = probe.main(["--rounds", "1", "--calls", "2", "--check-steps", "2"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert printed == rows
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["fused", "packed_per_leaf", "packed_flat", "packed_flat_no_reports",
                        "twin"]
    assert by["twin"]["vs_twin"] == 1.0
    assert by["packed_per_leaf"]["max_abs_diff"] == 0.0
    assert by["packed_flat"]["max_abs_diff"] < 1e-5
    for row in rows:
        assert row["step_ms"] > 0 and 0 < row["distinct_fusions"] <= row["fusions"]
