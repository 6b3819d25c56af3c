"""Every notebook in notebooks/ (jupytext percent-format scripts) runs, and does what it says.

They run in this process with `runpy`, so they share its imports and compiled primitives; each
one also asserts its own claims as it goes.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _run(name: str) -> dict:
    return runpy.run_path(str(NOTEBOOKS / name), run_name="__main__")


def test_every_notebook_is_tested():
    tested = {"01_build_a_hybrid_tree.py", "02_swap_gpt_slots.py", "03_calibrate_rates.py",
              "04_convolution.py", "05_iterative_inference.py", "06_generative_digits.py"}
    assert {p.name for p in NOTEBOOKS.glob("*.py")} == tested


@pytest.mark.slow
def test_01_build_a_hybrid_tree(capsys):
    g = _run("01_build_a_hybrid_tree.py")
    assert g["final_loss"] < 0.1 * g["initial_loss"]
    assert [row["part"] for row in g["report"]] == ["parts[2].branch", "parts[3]"]
    assert g["same_projection"] and g["moved"] > 0
    assert "final loss" in capsys.readouterr().out


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_02_swap_gpt_slots():
    g = _run("02_swap_gpt_slots.py")
    assert g["gap"] < 1e-4  # all frozen = the reference
    losses = g["hybrid_losses"]
    assert losses[-5:].mean() < losses[0] - 0.5  # feed-forward + head learn
    assert [row["part"] for row in g["pipeline"].report()] == ["blocks[0].feed_forward", "head"]
    assert g["curve_gap"] < 1e-3  # every slot learning follows backprop
    assert g["twin_losses"][-5:].mean() < g["twin_losses"][0] - 0.5
    assert len(g["full"].report()) == 11  # every slot of a one-block GPT learns


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_03_calibrate_rates():
    g = _run("03_calibrate_rates.py")
    bad = g["BAD"]
    # the diagnostic table points at the mis-scaled part, and lowers every rate
    before = {c.part: c.multiplier for c in g["table"]}
    others = [m for part, m in before.items() if part != bad]
    assert before[bad] < 0.1 < min(others) and max(before.values()) < 1.0
    # after the rule every part's update ratio is within half a decade of the target
    after = [c.median_ratio for c in g["table_after"]]
    assert np.all(np.abs(np.log10(np.asarray(after) / g["TARGET"])) < 0.5)
    # probe calibration: not worse than leaving the rates alone, at the same budget
    heldout = g["heldout"]
    assert set(heldout) == {"none", "report_rule", "probe"}
    assert all(np.isfinite(v) for v in heldout.values())
    assert heldout["probe"] <= heldout["none"]
    assert heldout["probe"] < heldout["report_rule"]
    # the mis-scaled (too fast) part was slowed down, against every other part
    chosen = g["chosen"]
    assert set(chosen) == set(before)
    assert chosen[bad] < 1.0
    assert all(chosen[bad] < m for part, m in chosen.items() if part != bad)
    # the probes cost extra steps: every trial of every round ran K steps
    results = g["results"]
    assert len(results) == g["ROUNDS"]
    for r in results:
        assert r.steps == len(r.trials) * g["K"]
        assert len(r.trials) >= 1 + 2 * len(chosen)  # a baseline, then each part x0.5 and x2
    assert g["probe_steps"] == sum(r.steps for r in results)


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_04_convolution(capsys):
    g = _run("04_convolution.py")
    assert g["gap"] < 1e-5  # the transplanted tree computes the equinox model
    fused, twin = g["fused_losses"], g["twin_losses"]
    assert fused.shape == twin.shape == (g["STEPS"],)
    assert np.max(np.abs(fused - twin)) <= 1e-3  # the backprop loss curve, step by step
    assert fused[-10:].mean() < 0.6 * fused[0]  # the shapes are learned
    assert g["accuracy"] > g["chance"] + 0.2  # on held-out images
    assert g["kernel_gap"] < 1e-4
    assert "held-out accuracy" in capsys.readouterr().out


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_05_iterative_inference(capsys):
    g = _run("05_iterative_inference.py")
    assert g["zil_gap"] < 1e-5  # Z-IL: the backprop gradient
    gaps = g["fixed_gaps"]
    assert all(b < a for a, b in zip(gaps, gaps[1:])) and gaps[-1] < 1e-5  # converges in T
    assert gaps[0] > 0.1  # and is far from it at T = 1: the comparison can fail
    assert np.all(np.diff(g["trajectory"]) < 0)  # the relaxation lowers the energy
    assert g["final_loss"] < 0.5 * g["initial_loss"]  # it learns inside a tree
    assert g["row"]["energy_after"] < g["row"]["energy_before"]
    assert "distance to backprop" in capsys.readouterr().out


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
def test_06_generative_digits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    g = _run("06_generative_digits.py")
    assert len(g["fill_mse"]) == 3  # three seeds, each trained from scratch
    assert all(f < g["mean_mse"] for f in g["fill_mse"])  # fill-in beats the mean image
    assert g["code_moved"] < 1e-5  # nothing observed: the code stays at its prior
    assert g["recognised"] >= 8  # generated digits sit nearest their own class's mean
    paths = g["figure_paths"]
    assert len(paths) == 2 and all(p.parent == tmp_path and p.stat().st_size > 0 for p in paths)
    assert "mean-image MSE" in capsys.readouterr().out
