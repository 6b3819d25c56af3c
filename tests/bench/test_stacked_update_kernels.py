"""scripts/stacked_update_kernels.py: its two forms compute the same update, and it prints
the kernel counts of both."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stacked_update_kernels.py"


def _module():
    spec = importlib.util.spec_from_file_location("stacked_update_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_forms_give_every_block_the_same_new_parameters_and_state():
    forms, args = _module().programs()
    # optax's bias correction mixes a Python float with its int32 count, which the suite's
    # strict promotion refuses (the library calls optax under standard promotion as well)
    with jax.numpy_dtype_promotion("standard"):
        per_block = jax.jit(forms["per_block"])(*args)
        stacked = jax.jit(forms["stacked"])(*args)
    leaves_a, tree_a = jax.tree_util.tree_flatten(per_block)
    leaves_b, tree_b = jax.tree_util.tree_flatten(stacked)
    assert tree_a == tree_b
    first = np.asarray(leaves_a[0])
    assert not np.array_equal(first, np.asarray(jax.tree_util.tree_leaves(args[1])[0]))
    for a, b in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_it_prints_both_forms_counts():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [row["form"] for row in rows] == ["per_block", "stacked"]
    for row in rows:
        assert 0 < row["distinct_fusions"] <= row["fusions"]
