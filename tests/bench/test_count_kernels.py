"""scripts/count_kernels.py: its counting (`fusedpc.bench._kernels`) on hand-written HLO, and
`--smoke` in a subprocess, in this process and in a worker per tree."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusedpc.bench._kernels import count_fusions

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "count_kernels.py"


# Three fusions: the first two compute the same thing under other names and metadata, the
# third differs only in a constant, which makes it another kernel.
_HLO = """HloModule jit_f, is_scheduled=true

%fc (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %constant.1 = f32[] constant(2)
  %broadcast.1 = f32[4]{0} broadcast(%constant.1), dimensions={}
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %broadcast.1), metadata={op_name="a"}
}

%fc.1 (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  %constant.7 = f32[] constant(2)
  %broadcast.9 = f32[4]{0} broadcast(%constant.7), dimensions={}
  ROOT %multiply.3 = f32[4]{0} multiply(%param_0.1, %broadcast.9), metadata={op_name="b"}
}

%wc (param_0.2: f32[4]) -> f32[4] {
  %param_0.2 = f32[4]{0} parameter(0)
  %constant.8 = f32[] constant(3)
  %broadcast.2 = f32[4]{0} broadcast(%constant.8), dimensions={}
  ROOT %multiply.4 = f32[4]{0} multiply(%param_0.2, %broadcast.2)
}

ENTRY %main.5 (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %mf = f32[4]{0} fusion(%x.1), kind=kLoop, calls=%fc
  %mf.1 = f32[4]{0} fusion(%mf), kind=kLoop, calls=%fc.1, backend_config={"p":[]}
  ROOT %wm = f32[4]{0} fusion(%mf.1), kind=kLoop, calls=%wc
}
"""


def test_fusions_equal_but_for_names_count_once_and_constants_tell_apart():
    counts = count_fusions(_HLO)
    assert counts == {"fusions": 3, "distinct_fusions": 2}


def test_a_compiled_program_counts_its_repeated_kernels_once():
    import jax
    import jax.numpy as jnp

    count = count_fusions

    def same(x, y):  # the same elementwise work on two inputs: two kernels, one program
        return jnp.tanh(x * 3.0 + 1.0), jnp.tanh(y * 3.0 + 1.0)

    def other(x, y):  # a different constant in the second: two programs
        return jnp.tanh(x * 3.0 + 1.0), jnp.tanh(y * 5.0 + 1.0)

    args = (jnp.ones(64), jnp.ones(64))
    assert count(jax.jit(same).lower(*args).compile().as_text()) == {
        "fusions": 2, "distinct_fusions": 1}
    assert count(jax.jit(other).lower(*args).compile().as_text()) == {
        "fusions": 2, "distinct_fusions": 2}


@pytest.mark.slow
def test_smoke_prints_the_counts():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["config"] == "smoke"
    assert 0 < row["distinct_fusions"] <= row["fusions"]
    assert row["compile_s"] > 0


@pytest.mark.slow
def test_a_tree_is_compiled_in_its_own_process_and_counted_in_this_one():
    # the worker imports the tree's src alone (which may predate fusedpc.bench._kernels)
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--tree", f"now={ROOT / 'src'}"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["tree"] == "now" and row["config"] == "smoke"
    assert 0 < row["distinct_fusions"] <= row["fusions"]
    assert row["fusedpc"].startswith(str(ROOT / "src"))
