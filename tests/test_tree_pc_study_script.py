"""scripts/tree_pc_study.py at a tiny budget: every variant trains, scores a finite held-out
loss, and every tree-PC run probes a finite distance from the backprop step."""

import json
import math

import pytest
from helpers import load_script


@pytest.mark.slow
def test_every_variant_reports_a_finite_validation_loss(capsys):
    study = load_script("tree_pc_study")
    study.main(["--steps", "3", "--seeds", "1", "--inference-steps", "2",
                "--blocks-inference-steps", "2", "--eval-batches", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    runs = {row["variant"]: row for row in lines if "variant" in row}
    summaries = {row["summary"]: row for row in lines if "summary" in row}
    expected = {"backprop_twin", "exact", "tree_pc_all_T2", "tree_pc_blocks_T2"}
    assert set(runs) == expected and set(summaries) == expected
    assert all(math.isfinite(row["val_loss"]) for row in runs.values())
    for name in ("tree_pc_all_T2", "tree_pc_blocks_T2"):
        (probe,) = runs[name]["probes"]  # one probe: the first of the 3 steps
        assert math.isfinite(probe["backprop_distance"]), name
        assert len(probe["energy_trajectory"]) == 3, name  # before each of T = 2 sweeps, after
    # the exact step is backprop's: the same held-out loss as the twin, to float32 rounding
    assert runs["exact"]["val_loss"] == pytest.approx(runs["backprop_twin"]["val_loss"],
                                                      rel=1e-5)
