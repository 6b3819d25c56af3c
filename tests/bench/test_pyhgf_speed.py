"""scripts/pyhgf_speed.py: its fusedpc side trains the benchmark GPT (the loss falls on the
repeated batch) and says what it ran; a missing pyhgf environment is refused by name. (pyhgf's
side needs its own Python >= 3.12 environment, which the suite does not build.)"""

from __future__ import annotations

import sys

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def speed():
    return load_script("pyhgf_speed")


@pytest.mark.slow
def test_the_fusedpc_side_trains_and_reports(speed):
    side = [sys.executable, str(speed.PEERS / "fusedpc_gpt_side.py")]
    row = speed._run(side, {**speed.CONFIG, "steps": 20, "warmup": 0})
    assert row["side"] == "fusedpc" and row["finite"]
    assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(
        16 * 32 / (row["step_ms"] / 1e3))
    assert row["loss_last"] < row["loss_first"] - 0.1  # the one batch, learnt


def test_a_missing_pyhgf_environment_is_refused(speed, tmp_path, capsys):
    missing = tmp_path / "no-venv" / "python"
    with pytest.raises(SystemExit):
        speed.main(["--pyhgf-python", str(missing), "--rounds", "1"])
    assert f"--pyhgf-python: {str(missing)!r} does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        speed.main(["--rounds", "0"])
