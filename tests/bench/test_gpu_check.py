"""The GPU check's script on the CPU: `--smoke` runs every stage and prints well-formed lines;
without `--smoke` a machine with no GPU is refused in one line.

Nothing here is timed: the figures are only checked to exist, be finite and be positive.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NUMBERS = ("tokens_per_s", "step_ms", "compile_s", "model_tflops", "mfu_measured",
           "measured_peak_tflops", "flops_per_step")


def _check(*flags: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(
        ["bash", str(SCRIPT), *flags], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_smoke_runs_every_stage_and_prints_one_json_line_each(tmp_path):
    done = _check("--smoke", out=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]  # nothing but JSON lines
    assert [line["stage"] for line in lines] == [
        "device", "parity", "peak", "bench", "bench", "summary",
    ]
    assert (tmp_path / "gpu_check.jsonl").read_text().splitlines() == done.stdout.splitlines()
    assert (tmp_path / "gpu_check_raw.jsonl").exists()
    device, parity, peak, *bench, summary = lines

    assert device["ok"] and device["platform"] == "cpu" and not device["gpu"]
    assert device["jax"] and device["device_kind"] and device["wall_s"] > 0

    assert parity["ok"] and parity["passed"] >= 1 and parity["failed"] == parity["errors"] == 0
    assert parity["matmul_precision"] == "highest"  # as the tests themselves saw it
    assert parity["platform"] == "cpu"

    assert peak["ok"] and _positive(peak["peak_tflops"])
    assert peak["dtype"] in ("float32", "bfloat16")

    assert [line["variant"] for line in bench] == ["fused", "backprop"]
    for line in bench:
        assert line["ok"] and line["config"] == "tiny"
        assert line["dtype"] in ("float32", "bfloat16")
        assert line["device_kind"] == device["device_kind"]
        for field in NUMBERS:
            assert _positive(line[field]), f"{line['variant']}: {field} = {line[field]!r}"
        # a CPU has no datasheet peak: no MFU against one, and the line says why
        assert line["mfu"] is None and line["peak_tflops"] is None
        assert "no datasheet figure" in line["peak_source"]
        assert (line["width"], line["n_heads"], line["n_blocks"], line["max_len"]) == (16, 2, 1, 8)

    assert summary["ok"] and summary["failed"] == []
    assert set(summary["stages_s"]) == {"device", "parity", "bench:tiny"}
    assert all(_positive(t) for t in summary["stages_s"].values())
    assert summary["within_limit"]


def test_without_a_gpu_the_full_check_refuses_in_one_line():
    done = _check()
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu_check: no GPU") and "--smoke" in line


@pytest.mark.parametrize(("smoke", "at_least"), [(False, 32), (True, 1)])
@pytest.mark.slow
def test_the_parity_marker_selects_the_parity_tests(smoke, at_least):
    # the parity stage selects by the gpu_parity marker, so that a renamed test keeps its
    # place; what remains to go wrong is a marker dropped or misspelt, selecting too few
    gpu_check = load_script("gpu_check")
    selection = gpu_check.SMOKE_PARITY_SELECTION if smoke else gpu_check.PARITY_SELECTION
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--strict-markers",
         "-p", "no:cacheprovider", *selection],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(selected) >= at_least, selected
