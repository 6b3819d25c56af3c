"""scripts/matmul_ceiling.py: its products are the step's FLOP count, each as XLA counts it,
and `--smoke` runs in a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import load_script

from fusedpc.transformer.reference import count_flops

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "matmul_ceiling.py"


def _module():
    return load_script("matmul_ceiling")


@pytest.mark.parametrize("config", ["smoke", "S", "M"])
def test_the_products_make_the_steps_flop_count(config):
    module = _module()
    fields, (batch, seq) = module.CONFIGS[config]
    expected = count_flops(module.VOCAB, fields["width"], fields["n_heads"],
                           fields["n_blocks"], fields["ff_width"], seq, batch)
    products = module.products(config)
    assert sum(p["flops"] * p["count"] for p in products) == expected
    assert {p["kind"] for p in products} == {
        "forward", "input_error", "weight_gradient", "scores", "mix", "transposed_mix"}


def test_each_products_flops_are_what_xla_counts_for_it():
    module = _module()
    for product in module.products("smoke"):
        operands = [jax.ShapeDtypeStruct(s, "float32") for s in product["shapes"]]
        cost = module._function(product["kind"]).lower(*operands).cost_analysis()
        assert cost["flops"] == product["flops"], product["product"]


@pytest.mark.slow
def test_smoke_prints_a_row_per_product_and_the_ceiling():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--rounds", "1",
                           "--reps", "1"], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.strip().splitlines()]
    summary = rows[-1]
    assert summary["summary"] and summary["config"] == "smoke"
    assert summary["flops_of_products"] == summary["flops_per_step"]
    assert summary["products_s"] > 0 and summary["peak_gflops"] > 0
    assert summary["dispatch_ms"] > 0
    ceiling = summary["flops_per_step"] / summary["products_s"] / 1e9
    assert summary["ceiling_gflops"] == pytest.approx(ceiling, rel=0.01, abs=0.1)
    assert len(rows) - 1 == len(_module().products("smoke")) + 1  # and one probe size


@pytest.mark.slow
def test_bad_rounds_are_refused_by_name():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--rounds", "0"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode != 0
    assert "--rounds" in done.stderr and "got 0" in done.stderr
