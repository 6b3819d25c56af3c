"""scripts/stacked_update_kernels.py: its forms compute the same update, and it prints the
kernel counts of all four."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import host_leaves, load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stacked_update_kernels.py"


def _module():
    return load_script("stacked_update_kernels")


def test_every_form_gives_every_block_the_same_new_parameters_and_state():
    forms = _module().programs()
    results = {name: jax.jit(f)(*args) for name, (f, args) in forms.items()}
    # the stacked forms' results, read block by block, as the apart forms hand them back
    for name in ("stacked_per_block", "stacked_once"):
        params, states = results[name]
        results[name] = [
            (jax.tree.map(lambda a, i=i: a[i], params), jax.tree.map(lambda a, i=i: a[i], states))
            for i in range(len(jax.tree_util.tree_leaves(params)[0]))
        ]
    reference = host_leaves(results["apart_per_block"])
    started = host_leaves(forms["apart_per_block"][1][1])
    assert not np.array_equal(reference[0], started[0])  # the update did move the weights
    for name, result in results.items():
        got = host_leaves(result)
        assert len(got) == len(reference), name
        for a, b in zip(got, reference):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=name)


@pytest.mark.slow
def test_it_prints_every_forms_counts():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [row["form"] for row in rows] == [
        "apart_per_block", "apart_stacked", "stacked_per_block", "stacked_once"]
    for row in rows:
        assert 0 < row["distinct_fusions"] <= row["fusions"]
