"""Smoke test of scripts/memory_report.py: `--smoke` in a subprocess, its JSON lines' fields.

The workers share the test suite's compilation cache (see `tests/conftest.py`), so after a
first run most of their time is starting Python and jax.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "memory_report.py"
VARIANTS = ("backprop", "fused_scan")  # the twin and the scanned step: two processes
MB_FIELDS = (
    "host_peak_rss_mb", "host_rss_before_build_mb", "argument_mb", "output_mb", "alias_mb",
    "temp_mb", "generated_code_mb", "total_mb", "donated_mb", "hlo_aliased_mb",
)


def _cache_env() -> dict[str, str]:
    """This environment with the suite's compilation cache (XLA_FLAGS: from conftest)."""
    import jax

    env = dict(os.environ)
    cache = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if cache:
        env.update(
            JAX_COMPILATION_CACHE_DIR=cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        )
    return env


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_smoke_rows_have_sane_fields():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--variants", ",".join(VARIANTS)],
        capture_output=True, text=True, env=_cache_env(), timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == list(VARIANTS)  # the twin first
    for row in rows:
        name = row["variant"]
        assert row["config"] == "smoke"
        for field in MB_FIELDS:
            assert isinstance(row[field], float) and row[field] >= 0, f"{name}: {field}"
        assert row["host_peak_rss_mb"] >= row["host_rss_before_build_mb"] > 0
        assert row["host_rss_growth_mb"] > 0
        assert row["donated_mb"] > 0 and row["argument_mb"] >= row["donated_mb"]
        # the output reuses at most what was donated; XLA's figure and the HLO's agree
        assert 0 < row["alias_mb"] <= row["donated_mb"] + 1e-9
        assert abs(row["alias_mb"] - row["hlo_aliased_mb"]) < 1e-6
        assert row["alias_gap_mb"] >= -1e-9
        assert row["aliased_params"] <= row["donated_leaves"]
        assert row["aliased_other_params"] == 0  # the batch is never donated
        assert row["param_size_mismatches"] == []
        unaliased_mb = sum(leaf["mb"] for leaf in row["not_aliased"])
        assert abs(row["donated_mb"] - row["hlo_aliased_mb"] - unaliased_mb) < 1e-6
        assert all(leaf["path"].startswith(("['carry']", "['model']", "['opt']"))
                   for leaf in row["not_aliased"])
        assert row["temp_ratio_to_twin"] > 0
    assert rows[0]["temp_ratio_to_twin"] == 1.0
    assert {r["blocks_form"] for r in rows} == {"twin", "scanned"}
