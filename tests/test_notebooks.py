"""Every notebook in notebooks/ (jupytext percent-format scripts) runs, and does what it says.

They run in this process with `runpy`, so they share its imports and compiled primitives; each
one also asserts its own claims as it goes.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _run(name: str) -> dict:
    return runpy.run_path(str(NOTEBOOKS / name), run_name="__main__")


def test_every_notebook_is_tested():
    tested = {"01_build_a_hybrid_tree.py", "02_swap_gpt_slots.py", "03_calibrate_rates.py"}
    assert {p.name for p in NOTEBOOKS.glob("*.py")} == tested


def test_01_build_a_hybrid_tree(capsys):
    g = _run("01_build_a_hybrid_tree.py")
    assert g["final_loss"] < 0.1 * g["initial_loss"]
    assert [row["part"] for row in g["report"]] == ["parts[2].branch", "parts[3]"]
    assert g["same_projection"] and g["moved"] > 0
    assert "final loss" in capsys.readouterr().out


def test_02_swap_gpt_slots():
    g = _run("02_swap_gpt_slots.py")
    assert g["gap"] < 1e-4  # all frozen = the reference
    losses = g["hybrid_losses"]
    assert losses[-5:].mean() < losses[0] - 0.5  # feed-forward + head learn
    assert [row["part"] for row in g["pipeline"].report()] == ["blocks[0].feed_forward", "head"]
    assert g["curve_gap"] < 1e-3  # every slot learning follows backprop
    assert g["twin_losses"][-5:].mean() < g["twin_losses"][0] - 0.5
    assert len(g["full"].report()) == 11  # every slot of a one-block GPT learns


def test_03_calibrate_rates():
    g = _run("03_calibrate_rates.py")
    before = {c.part: c for c in g["table"]}
    assert before["parts[0]"].multiplier < 0.5 < 2.0 < before["parts[3]"].multiplier
    after = [c.median_ratio for c in g["table_after"]]
    assert np.all(np.abs(np.log10(np.asarray(after) / g["TARGET"])) < 0.5)
