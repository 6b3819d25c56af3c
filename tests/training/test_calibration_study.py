"""The calibration study's conversion (scripts/calibration_study.py): a `fusedpc study`
folder's runs into the evidence `fusedpc report` reads, on a synthetic study folder. The
study itself is `fusedpc study` (tested in test_study.py and test_seeds.py)."""

from __future__ import annotations

import json
import pathlib

import pytest
from helpers import load_script

GPL = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(scope="module")
def study():
    return load_script("calibration_study")


def _folder(tmp_path, finals: dict[tuple, list[float]]) -> pathlib.Path:
    """A study folder whose runs end at `finals[(text, kind, learn, optimiser, calibrate)]`
    (one value per seed), with an earlier evaluation point that must be ignored."""
    folder = tmp_path / "study"
    folder.mkdir()
    cases = []
    lines = []
    for (text, kind, learn, optimiser, calibrate), values in finals.items():
        case = {"text": text, "learning_kind": kind, "learn": learn, "optimiser": optimiser,
                "lr": 0.003 if optimiser == "adam" else 0.1}
        if case not in cases:
            cases.append(case)
        setting = {**case, "calibrate": calibrate}
        name = ", ".join(f"{k}={v}" for k, v in setting.items())
        for seed, value in enumerate(values):
            for step, loss in ((600, 9.0), (1200, value)):
                lines.append({"setting": name, **setting, "seed": seed, "step": step,
                              "val_loss": loss, "train_loss": loss})
    settings = {"steps": 1200, "calibrate_at": 180, "probe_steps": 100, "seed": 0,
                "text": "hamlet", "optimiser": "adam", "lr": 0.003, "width": 32,
                "n_heads": 4, "n_blocks": 1, "max_len": 32, "batch": 16}
    (folder / "config.json").write_text(json.dumps(
        {"settings": settings, "seeds": 2, "vary": {"calibrate": ["none", "auto"]},
         "cases": cases, "jax": "0.10.2"}))
    (folder / "runs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_a_study_folder_becomes_the_evidence(study, tmp_path):
    folder = _folder(tmp_path, {
        ("hamlet", "precision_weighted", "all", "adam", "none"): [2.0, 2.2],
        ("hamlet", "precision_weighted", "all", "adam", "auto"): [1.8, 1.8],
        ("hamlet", "standard", "all", "adam", "none"): [2.5, 2.5],
        ("hamlet", "standard", "all", "adam", "auto"): [2.2, 2.2],
        (GPL, "synaptic_uncertainty", "ff_head", "adam", "none"): [3.0, 3.0],
        (GPL, "synaptic_uncertainty", "ff_head", "adam", "auto"): [3.2, 3.2],
    })
    evidence = study.evidence_from(folder)
    assert evidence["study"] == {
        "steps": 1200, "warmup": 180, "probe_steps": 100, "seeds": [0, 1],
        "texts": ["hamlet", "GPL-3"], "lr": {"adam": 0.003}, "width": 32, "n_heads": 4,
        "n_blocks": 1, "seq_len": 32, "batch": 16, "jax": "0.10.2"}
    cells = {(c["text"], c["learning_kind"], c["learn"], c["optimiser"], c["method"]): c
             for c in evidence["cells"]}
    # the twin is the exact step's uncalibrated run; the synaptic ff_head cell has no optax
    assert set(cells) == {
        ("hamlet", "precision_weighted", "all", "adam", "none"),
        ("hamlet", "precision_weighted", "all", "adam", "probe"),
        ("hamlet", "backprop", "all", "adam", "backprop_twin"),
        ("hamlet", "standard", "all", "adam", "none"),
        ("hamlet", "standard", "all", "adam", "probe"),
        ("GPL-3", "synaptic_uncertainty", "ff_head", "own_rule", "none"),
        ("GPL-3", "synaptic_uncertainty", "ff_head", "own_rule", "probe")}
    exact = cells[("hamlet", "precision_weighted", "all", "adam", "none")]
    assert exact["val_loss_mean"] == pytest.approx(2.1)  # the last point, not step 600's
    assert exact["val_loss_std"] == pytest.approx(0.1414213, rel=1e-5)
    assert (exact["val_loss_min"], exact["val_loss_max"]) == (2.0, 2.2)
    standard = cells[("hamlet", "standard", "all", "adam", "probe")]
    assert standard["gap_to_none"] == pytest.approx(-0.3)
    assert standard["gap_to_twin"] == pytest.approx(0.1)
    twin = cells[("hamlet", "backprop", "all", "adam", "backprop_twin")]
    assert twin["gap_to_none"] is None and twin["gap_to_twin"] is None
    (line,) = evidence["targets"]
    assert line["method"] == "probe"
    assert line["worse_cells"] == ["GPL-3/synaptic_uncertainty/ff_head/own_rule"]
    # standard's none is 0.4 above the twin (spread 0.14): behind, and helped by 0.3
    assert line["behind_twin"] == ["hamlet/standard/all/adam"] == line["helped"]
    assert line["gap_closed"] == {"hamlet/standard/all/adam": pytest.approx(0.75)}


def test_evidence_from_writes_the_file_and_refuses_a_bad_call(study, tmp_path):
    folder = _folder(tmp_path, {
        ("hamlet", "precision_weighted", "all", "sgd", "none"): [2.6, 2.7],
        ("hamlet", "precision_weighted", "all", "sgd", "auto"): [2.3, 2.2]})
    out = tmp_path / "evidence.json"
    assert study.main(["--evidence-from", str(folder), str(out)]) == 0
    assert json.loads(out.read_text()) == study.evidence_from(folder)
    with pytest.raises(SystemExit, match="usage"):
        study.main(["--evidence-from", str(folder)])
