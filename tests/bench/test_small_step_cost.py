"""scripts/small_step_cost.py at one round: every variant of the MLP is timed and counted."""

import json

import pytest
from helpers import load_script


@pytest.mark.slow
def test_every_variant_is_timed_and_its_kernels_counted(capsys):
    script = load_script("small_step_cost")
    script.main(["--models", "mlp", "--rounds", "1", "--calls", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert [r["variant"] for r in rows] == ["fused", "fused_no_reports", "fused_no_guard",
                                            "fused_bare", "twin"]
    by = {r["variant"]: r for r in rows}
    assert by["twin"]["vs_twin"] == 1.0
    for row in rows:
        assert row["step_ms"] > 0 and 0 < row["distinct_fusions"] <= row["fusions"]
    # switching a piece off removes its kernels from the program
    assert by["fused_bare"]["fusions"] < by["fused_no_reports"]["fusions"] < by["fused"]["fusions"]
    assert by["fused_no_guard"]["fusions"] < by["fused"]["fusions"]
