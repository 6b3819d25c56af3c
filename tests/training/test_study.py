"""`fusedpc study`: settings parsed and checked, the grid, the bootstrap verdict, and a tiny
study end to end (its files, its table, never overwriting)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fusedpc.training import study


def test_vary_is_parsed_by_each_settings_type_and_bad_input_names_it():
    assert study.parse_vary(["lr=0.001,0.01", "n-blocks=1,2", "tensorboard=true"]) == {
        "lr": [0.001, 0.01], "n_blocks": [1, 2], "tensorboard": [True]}
    for text, message in [("lr", "expected name=v1,v2"), ("speed=1", "unknown setting 'speed'"),
                          ("n_blocks=two", "n_blocks='two' is not a int"),
                          ("seed=1,2", "the seeds are --seeds")]:
        with pytest.raises(ValueError, match=message):
            study.parse_vary([text])
    with pytest.raises(ValueError, match="'lr' given twice"):
        study.parse_vary(["lr=0.1", "lr=0.2"])


def test_the_grid_is_every_combination_in_order():
    grid = study.settings_grid({"lr": [1, 2], "n_blocks": [3, 4]})
    assert grid == [{"lr": 1, "n_blocks": 3}, {"lr": 1, "n_blocks": 4},
                    {"lr": 2, "n_blocks": 3}, {"lr": 2, "n_blocks": 4}]
    assert study.settings_grid({}) == [{}]


def test_the_bootstrap_interval_separates_distinct_samples_and_not_equal_ones():
    rng = np.random.default_rng(0)
    a = 2.0 + 0.01 * rng.standard_normal(5)
    difference, low, high = study.bootstrap_difference(a, a - 0.1)
    assert difference == pytest.approx(-0.1) and low < difference < high < 0
    _, low, high = study.bootstrap_difference(a, a[::-1].copy())
    assert low <= 0 <= high


@pytest.mark.slow
def test_a_tiny_study_writes_its_runs_table_and_curves(tmp_path, capsys):
    from fusedpc.cli import main

    out = tmp_path / "study"
    argv = ["study", "--seeds", "2", "--vary", "lr=0.001,0.01", "--steps", "6",
            "--eval-every", "3", "--eval-batches", "1", "--width", "16", "--n-heads", "2",
            "--n-blocks", "1", "--max-len", "16", "--batch", "4", "--out", str(out)]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "curves.png", "runs.jsonl", "summary.json", "table.md"]
    lines = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2  # settings x seeds x evaluation points
    assert {(r["lr"], r["seed"], r["step"]) for r in lines} == {
        (lr, seed, step) for lr in (0.001, 0.01) for seed in (0, 1) for step in (3, 6)}
    rows = json.loads((out / "summary.json").read_text())
    assert [r["setting"] for r in rows] == ["lr=0.001", "lr=0.01"]
    assert [r["program"] for r in rows] == [0, 0]  # the rates live in the state: one program
    assert all(r["run_tokens_per_s"] > 0 for r in rows)
    finals = [r["val_loss"] for r in lines if r["lr"] == 0.01 and r["step"] == 6]
    assert rows[1]["val_loss_mean"] == pytest.approx(np.mean(finals), abs=1e-4)
    assert rows[1]["verdict"] in ("lower", "higher", "no difference shown")
    assert "| lr=0.01 |" in (out / "table.md").read_text()
    assert main(argv) == 1  # the folder holds a study: refused, nothing overwritten
    assert "is not empty" in capsys.readouterr().err


def test_a_study_table_in_the_config_file_gives_seeds_and_values(tmp_path):
    from fusedpc.training import _config_file

    path = tmp_path / "study.toml"
    path.write_text('[optimiser]\nlr = 0.002\n\n[study]\nseeds = 4\n'
                    'vary = {n_blocks = [1, 2], tensorboard = [false]}\n')
    assert study.study_table(path) == (4, {"n_blocks": [1, 2], "tensorboard": [False]}, [])
    config = _config_file.resolve_config(path, other_sections=("study",))
    assert config.lr == 0.002
    with pytest.raises(ValueError, match=r"unknown section 'study'"):
        _config_file.resolve_config(path)  # fusedpc train does not read a study
    path.write_text('[study]\nseeds = 2\nrepeat = 3\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['repeat'\] in \[study\]"):
        study.study_table(path)
    path.write_text('[study]\nvary = {lr = []}\n')
    with pytest.raises(ValueError, match=r"vary must be a table of non-empty lists"):
        study.study_table(path)
    path.write_text('[study]\nvary = {width = ["wide"]}\n')
    with pytest.raises(ValueError, match=r"\[study\] vary: width must be int, got 'wide'"):
        study.study_table(path)


def test_cases_are_parsed_checked_and_crossed_with_the_varied_values(tmp_path):
    cases = study.parse_cases(["learning_kind=iterative,inference-steps=4", "lr=0.01"])
    assert cases == [{"learning_kind": "iterative", "inference_steps": 4}, {"lr": 0.01}]
    for text, message in [("lr", "expected name=value"), ("lr=0.1,lr=0.2", "'lr' given twice"),
                          ("width=wide", "width='wide' is not a int"),
                          ("speed=1", "unknown setting 'speed'")]:
        with pytest.raises(ValueError, match=message):
            study.parse_cases([text])
    assert study.settings_grid({"n_blocks": [1, 2]}, cases) == [
        {"learning_kind": "iterative", "inference_steps": 4, "n_blocks": 1},
        {"learning_kind": "iterative", "inference_steps": 4, "n_blocks": 2},
        {"lr": 0.01, "n_blocks": 1}, {"lr": 0.01, "n_blocks": 2}]
    with pytest.raises(ValueError, match=r"both set \['lr'\]"):
        study.settings_grid({"lr": [0.1]}, cases)
    path = tmp_path / "study.toml"
    path.write_text('[study]\ncases = [{learning_kind = "standard"}, {inference_steps = 2}]\n')
    assert study.study_table(path) == (None, {}, [{"learning_kind": "standard"},
                                                  {"inference_steps": 2}])
    path.write_text('[study]\ncases = [{inference_steps = "many"}]\n')
    with pytest.raises(ValueError, match="inference_steps"):
        study.study_table(path)
    path.write_text('[study]\ncases = [3]\n')
    with pytest.raises(ValueError, match="cases must be a list of non-empty tables"):
        study.study_table(path)


def test_settings_share_a_program_when_only_their_rates_differ():
    import dataclasses

    import fusedpc

    base = fusedpc.TrainConfig()
    configs = [base, dataclasses.replace(base, lr=0.01),
               dataclasses.replace(base, model=dataclasses.replace(base.model, n_blocks=3)),
               dataclasses.replace(base, slot_lr_scales="head=2"),
               dataclasses.replace(base, optimiser="sgd")]
    assert study.program_groups(configs) == [[0, 1, 3], [2], [4]]


@pytest.mark.slow
def test_a_study_of_cases_runs_each_case_and_its_rates_in_one_program(tmp_path):
    from fusedpc.cli import main

    out = tmp_path / "cases"
    argv = ["study", "--seeds", "1", "--case", "learning_kind=standard",
            "--case", "learning_kind=precision_weighted", "--vary", "lr=0.001,0.01",
            "--steps", "3", "--eval-every", "3", "--eval-batches", "1", "--width", "16",
            "--n-heads", "2", "--n-blocks", "1", "--max-len", "16", "--batch", "4",
            "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["setting"], r["program"]) for r in rows] == [
        ("learning_kind=standard, lr=0.001", 0), ("learning_kind=standard, lr=0.01", 0),
        ("learning_kind=precision_weighted, lr=0.001", 1),
        ("learning_kind=precision_weighted, lr=0.01", 1)]
    assert json.loads((out / "config.json").read_text())["cases"] == [
        {"learning_kind": "standard"}, {"learning_kind": "precision_weighted"}]


def test_the_bundled_iterative_study_config_is_valid():
    # docs/iterative.md's table is made with it: every case must build a valid run
    from pathlib import Path

    from fusedpc.training import _config_file
    from fusedpc.training._settings import config_from_settings

    path = Path(__file__).parents[2] / "configs" / "iterative_study.toml"
    seeds, vary, cases = study.study_table(path)
    assert seeds == 3 and vary == {} and len(cases) == 8
    config = _config_file.resolve_config(path, other_sections=("study",))
    assert config.steps == 1000
    for setting in study.settings_grid(vary, cases):
        config_from_settings(setting, config).validate()
