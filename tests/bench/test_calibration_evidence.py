"""The bundled calibration evidence (`src/fusedpc/training/calibration_evidence.json`, what
`fusedpc report` suggests from): its schema, checked key by key, and that it is exactly what
scripts/calibration_study.py writes from the study's files (`--evidence-from`;
docs/calibration.md gives the command that regenerates it)."""

import json
import math
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import fusedpc
from fusedpc.training import TrainConfig
from fusedpc.training._evidence import EVIDENCE_NAME, SUGGESTED_METHOD, cell_evidence, suggest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "calibration_study.py"

STUDY_KEYS = {"steps", "warmup", "probe_steps", "seeds", "texts", "lr", "width", "n_heads",
              "n_blocks", "seq_len", "batch", "jax"}
CELL_KEYS = {"text", "learning_kind", "learn", "optimiser", "method", "seeds", "val_loss_mean",
             "val_loss_std", "val_loss_min", "val_loss_max", "gap_to_none", "gap_to_twin"}
TARGET_KEYS = {"kind", "method", "worse_cells", "behind_twin", "helped", "gap_closed"}
KINDS = ("precision_weighted", "standard", "synaptic_uncertainty")
PRESETS = ("all", "ff_head")
OPTIMISERS = ("adam", "sgd")


def _shipped_text() -> str:
    return resources.files("fusedpc.training").joinpath(EVIDENCE_NAME).read_text("utf-8")


@pytest.fixture(scope="module")
def evidence() -> dict:
    return json.loads(_shipped_text())


def _keys(where: str, record: dict, want: set) -> None:
    got = set(record)
    assert got == want, (f"{where}: keys drifted from the schema: missing {sorted(want - got)}, "
                         f"unexpected {sorted(got - want)}")


def _positive_int(value) -> bool:
    return type(value) is int and value > 0


def _finite(value) -> bool:
    return type(value) is float and math.isfinite(value)


def _cell_name(c: dict) -> str:
    return f"{c['text']}/{c['learning_kind']}/{c['learn']}/{c['optimiser']}"


def test_the_study_settings_keep_their_schema(evidence):
    _keys("the evidence", evidence, {"study", "cells", "targets"})
    study = evidence["study"]
    _keys("study", study, STUDY_KEYS)
    for name in ("steps", "warmup", "probe_steps", "width", "n_heads", "n_blocks", "seq_len",
                 "batch"):
        assert _positive_int(study[name]), f"study.{name} = {study[name]!r}: a positive int"
    assert study["warmup"] < study["steps"], study
    assert study["width"] % study["n_heads"] == 0, study
    seeds, texts = study["seeds"], study["texts"]
    assert seeds and all(type(s) is int and s >= 0 for s in seeds), seeds
    assert len(set(seeds)) == len(seeds), seeds
    assert texts and all(type(t) is str and t for t in texts) and len(set(texts)) == len(texts)
    assert texts[0] == "hamlet", texts  # the bundled text: the cells fusedpc report reads first
    assert set(study["lr"]) == set(OPTIMISERS), study["lr"]
    assert all(_finite(r) and r > 0 for r in study["lr"].values()), study["lr"]
    assert type(study["jax"]) is str and re.fullmatch(r"\d+\.\d+\.\d+\S*", study["jax"])


def test_every_cell_keeps_its_schema_and_its_numbers_agree(evidence):
    study, cells = evidence["study"], evidence["cells"]
    assert cells, "no cells"
    keys = [(c["text"], c["learning_kind"], c["learn"], c["optimiser"], c["method"])
            for c in cells]
    assert len(set(keys)) == len(keys), "a cell and method appear twice"
    means = dict(zip(keys, (c["val_loss_mean"] for c in cells), strict=True))
    for c in cells:
        where = f"cell {_cell_name(c)} / {c.get('method')}"
        _keys(where, c, CELL_KEYS)
        assert c["text"] in study["texts"], where
        assert c["learning_kind"] in (*KINDS, "backprop"), where
        assert c["learn"] in PRESETS, where
        assert c["optimiser"] in (*OPTIMISERS, "own_rule"), where
        twin = c["learning_kind"] == "backprop"
        assert (c["method"] == "backprop_twin") == twin, where
        assert type(c["method"]) is str and c["method"], where
        assert _positive_int(c["seeds"]) and c["seeds"] <= len(study["seeds"]), where
        losses = [c[k] for k in ("val_loss_min", "val_loss_mean", "val_loss_max")]
        assert all(_finite(v) and v > 0 for v in losses), where
        assert losses == sorted(losses), f"{where}: min <= mean <= max, got {losses}"
        assert _finite(c["val_loss_std"]) and c["val_loss_std"] >= 0, where
        # the gaps are means minus means, as calibration_study.summarise computes them
        base = means.get((c["text"], c["learning_kind"], c["learn"], c["optimiser"], "none"))
        if twin:
            assert c["gap_to_none"] is None, where
        else:
            assert base is not None, f"{where}: no 'none' cell to compare with"
            assert c["gap_to_none"] == pytest.approx(c["val_loss_mean"] - base, abs=1e-12)
        twin_mean = means.get((c["text"], "backprop", "all", c["optimiser"], "backprop_twin"))
        if c["gap_to_twin"] is None:
            assert twin or c["learn"] != "all" or twin_mean is None, where
        else:
            assert c["gap_to_twin"] == pytest.approx(c["val_loss_mean"] - twin_mean, abs=1e-12)


def test_the_targets_keep_their_schema_and_name_cells_of_the_study(evidence):
    names = {_cell_name(c) for c in evidence["cells"]}
    methods = {c["method"] for c in evidence["cells"]}
    assert evidence["targets"], "no targets line"
    for line in evidence["targets"]:
        _keys(f"targets of {line.get('method')!r}", line, TARGET_KEYS)
        assert line["kind"] == "targets" and line["method"] in methods, line["method"]
        for field in ("worse_cells", "behind_twin", "helped"):
            assert isinstance(line[field], list) and set(line[field]) <= names, (
                f"targets.{field} names cells the study lacks: {set(line[field]) - names}")
        assert set(line["helped"]) <= set(line["behind_twin"]), line
        assert isinstance(line["gap_closed"], dict) and set(line["gap_closed"]) <= names
        assert all(_finite(v) for v in line["gap_closed"].values()), line["gap_closed"]


def test_fusedpc_report_finds_a_cell_for_every_kind_preset_and_optimiser(evidence):
    for text in evidence["study"]["texts"]:
        for kind in KINDS:
            for preset in PRESETS:
                for optimiser in OPTIMISERS:
                    model = fusedpc.GPTConfig(learning_kind=kind, learn=preset)
                    config = TrainConfig(model=model, optimiser=optimiser)
                    found, note = cell_evidence(config, evidence=evidence, text=text)
                    assert found is not None, note
                    assert found.method == SUGGESTED_METHOD and found.seeds > 1
                    if preset == "all" and kind != "synaptic_uncertainty":
                        assert found.twin_mean is not None, found
    assert suggest(TrainConfig(), [], evidence=evidence)  # the bundled file, as read


STUDY_DATA = ROOT / "docs" / "study_data" / "calibration"


@pytest.mark.slow
def test_the_shipped_file_is_what_the_study_writes(tmp_path):
    # the study's own files (its config.json and runs.jsonl, kept beside the docs), through
    # the documented conversion: the same bytes
    out = tmp_path / EVIDENCE_NAME
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--evidence-from", str(STUDY_DATA), str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_text("utf-8") == _shipped_text()
