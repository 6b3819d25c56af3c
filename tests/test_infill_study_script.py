"""scripts/infill_study.py at a tiny budget: every setting of every seed is scored, 0 sweeps
is the causal readout, and the summary averages the seeds' rows."""

import json

import pytest
from helpers import load_script


@pytest.mark.slow
def test_each_setting_scores_the_fill_in_beside_the_causal_readout(capsys):
    script = load_script("infill_study")
    script.main(["--seeds", "2", "--steps", "3", "--settings", "0:1,4:1.0"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    runs = [row for row in lines if "seed" in row]
    summaries = [row for row in lines if row.get("summary")]
    assert [(r["seed"], r["steps"]) for r in runs] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    for row in runs:
        assert row["hidden_tokens"] == 8 * 16 * 7  # 8 batches of 16 rows, positions 8..56
        assert 0 <= row["infill_accuracy"] <= 1 and row["example"].count("[") == 7
    assert all(r["infill_accuracy"] == r["causal_accuracy"] for r in runs if r["steps"] == 0)
    assert all(r["energy_after"] < r["energy_before"] for r in runs if r["steps"] == 4)
    mean = sum(r["infill_accuracy"] for r in runs if r["steps"] == 4) / 2
    assert [s["steps"] for s in summaries] == [0, 4]
    assert summaries[1]["infill_accuracy"][0] == pytest.approx(mean)
