"""scripts/pc_schedules_digits.py at a tiny budget: each schedule trains, scores an accuracy,
and the adaptive one runs no more sweeps than the standard one."""

import json

import pytest
from helpers import load_script


@pytest.mark.slow
def test_each_schedule_reports_accuracy_sweeps_and_step_time(capsys):
    pytest.importorskip("sklearn")
    script = load_script("pc_schedules_digits")
    script.main(["--seeds", "1", "--steps", "20", "--depth", "2", "--width", "16",
                 "--inference-steps", "3"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    runs = {row["schedule"]: row for row in lines if "schedule" in row}
    summaries = {row["summary"]: row for row in lines if "summary" in row}
    assert set(runs) == set(summaries) == {"standard", "incremental", "adaptive"}
    for row in runs.values():
        assert 0.0 <= row["accuracy"] <= 1.0 and row["step_ms"] > 0 and row["skipped_steps"] == 0
    assert runs["standard"]["sweeps_mean"] == runs["incremental"]["sweeps_mean"] == 3
    assert 1 <= runs["adaptive"]["sweeps_mean"] <= 3
