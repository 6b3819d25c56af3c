"""scripts/pc_depth_study.py at a tiny budget: every run, summary, timing and target line is
written with its fields and sane values, and the compiled step is reused across seeds."""

import json
import math

import pytest
from helpers import load_script


@pytest.mark.slow
def test_every_run_and_summary_line_is_sane(capsys, tmp_path):
    study = load_script("pc_depth_study")
    out = tmp_path / "study.jsonl"
    study.main(["--depths", "2,3", "--seeds", "2", "--steps", "5", "--timing-rounds", "1",
                "--compile-rounds", "1", "--compile-in-process", "--inference-steps", "2",
                "--inference-steps-per-depth", "2", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert out.read_text().splitlines() == printed  # --out holds every printed line
    lines = [json.loads(line) for line in printed]
    runs = [line for line in lines if "variant" in line]
    summaries = {(s["summary"], s["depth"]): s for s in lines if "summary" in s}
    timings = {t["depth"]: t for t in lines if "timing" in t}
    targets = [t for t in lines if "target" in t]
    expected = {("mupc", 2), ("standard", 2), ("mupc_T=L+1", 2), ("mupc", 3), ("standard", 3)}
    assert {(r["variant"], r["depth"]) for r in runs} == expected
    assert len(runs) == 2 * len(expected) and set(summaries) == expected
    for run in runs:
        assert 0.0 <= run["accuracy"] <= 1.0
        assert 0 <= run["skipped"] <= run["steps"] == 5
        assert 0 <= run["energy_rose_steps"] <= run["steps"]
        assert run["train_loss"] is None or math.isfinite(run["train_loss"])
        assert run["first_call_s"] > 0 and run["step_ms"] > 0
        assert 0 <= run["blocks_learning"] <= run["depth"]
        assert run["compiled"] == (run["seed"] == 0)  # later seeds reuse the compiled step
        assert run["inference_steps"] == (3 if run["variant"] == "mupc_T=L+1" else 2)
    for summary in summaries.values():
        assert summary["seeds"] == 2
        assert 0.0 <= summary["accuracy_min"] <= summary["accuracy_mean"] <= 1.0
        assert summary["accuracy_std"] >= 0 and summary["skipped_total"] >= 0
    assert set(timings) == {2, 3} and timings[2]["step_ratio"] == timings[2]["compile_ratio"] == 1
    assert all(t["step_ms"] > 0 and t["compile_s"] > 0 for t in timings.values())
    assert len(targets) == 5 and all(t["status"] in ("met", "missed") for t in targets)
