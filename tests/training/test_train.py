"""The pieces of the training loop that need no model: configs, progress line, cross-entropy,
calibration, plots, Ctrl-C handling. (Runs of the loop itself are in test_cli.py.)"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from fusedpc.training import (
    _calibrate,
    _config,
    _config_file,
    _evaluate,
    _log,
    _plots,
    _progress,
    _runtime,
    _setup,
)

# --------------------------------------------------------------------------- configs


def test_defaults_validate_and_round_trip_through_toml(tmp_path):
    config = _config.TrainConfig()
    config.validate()
    odd = dataclasses.replace(config, text="my \"quoted\" text.txt", lr=2.5e-4, distributed=True,
                              model=dataclasses.replace(config.model, learn="attention,head"),
                              temperature=0.0)
    path = tmp_path / "config.toml"
    path.write_text(_config_file.config_to_toml(odd))
    assert _config_file.read_config_file(path) == _config.config_settings(odd)
    assert _config_file.resolve_config(path) == odd


def test_the_example_configs_are_valid_and_default_toml_is_the_defaults():
    configs = Path(__file__).resolve().parents[2] / "configs"
    assert _config_file.resolve_config(configs / "default.toml") == _config.TrainConfig()
    tiny = _config_file.resolve_config(configs / "tiny.toml")
    model = tiny.model
    assert (model.width, model.n_heads, model.n_blocks, model.max_len, tiny.batch) == (
        16, 2, 1, 16, 4
    )


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nwidth = 32\nn_heads = 8\nlearn = ['feed_forward', 'head']\n"
                    "[optimiser]\nlr = 1\n")
    config = _config_file.resolve_config(path, {"n_heads": 4, "steps": 7})
    assert (config.model.width, config.model.n_heads, config.steps) == (32, 4, 7)
    assert config.model.learn == "feed_forward,head"
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.batch == _config.TrainConfig().batch


@pytest.mark.parametrize(
    "text, message",
    [
        ("width = 3\n", "must be inside the [model] section"),
        ("[modle]\nwidth = 3\n", "unknown section 'modle'"),
        ("[model]\nwidth = 'wide'\n", "width must be int"),
        ("[training]\nsteps = true\n", "steps must be int"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_malformed_config_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="c.toml") as info:
        _config_file.resolve_config(path)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch": 6, "devices": 4}, "batch=6 must divide over devices=4"),
        ({"learning_kind": "synaptic_uncertainty"}, "needs window >= 1"),
        ({"learning_kind": "telepathic"}, "learning_kind must be one of"),
        ({"validation_fraction": 1.0}, "validation_fraction"),
        ({"lr": -1.0}, "lr must be a positive number"),
        ({"tokenizer": "word"}, "tokenizer must be one of"),
    ],
)
def test_invalid_settings_are_refused(overrides, message):
    with pytest.raises(ValueError) as info:
        _config_file.resolve_config(None, overrides)
    assert message in str(info.value)


def test_resume_config_allows_only_settings_that_keep_the_run_identical(tmp_path):
    (tmp_path / "config.toml").write_text(_config_file.config_to_toml(_config.TrainConfig()))
    (tmp_path / "checkpoint.fpc").write_bytes(b"")
    config = _config_file.resume_config(tmp_path, {"steps": 5000, "eval_every": 50, "width": 64})
    assert config.steps == 5000 and config.eval_every == 50
    with pytest.raises(ValueError, match="cannot change lr, seed"):
        _config_file.resume_config(tmp_path, {"seed": 3, "lr": 0.1, "steps": 9})


def test_calls_end_at_multiples_of_steps_per_call():
    def calls(start, total, k):
        sizes, step = [], start
        while step < total:
            sizes.append(_setup.call_size(step, total, k))
            step += sizes[-1]
        return sizes

    assert calls(0, 23, 5) == [5, 5, 5, 5, 3]
    assert calls(12, 23, 5) == [3, 5, 3]  # a resumed run rejoins the calls at 15 and 20
    assert calls(0, 4, 1) == [1, 1, 1, 1]


# --------------------------------------------------------------------------- evaluation


def test_cross_entropy_of_logits_and_probabilities_agree():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5)) * 4
    targets = rng.integers(0, 5, size=(2, 3))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = -np.mean(np.log(np.take_along_axis(probs, targets[..., None], -1)))
    assert _evaluate.cross_entropy(logits, targets, False) == pytest.approx(want, rel=1e-12)
    assert _evaluate.cross_entropy(probs, targets, True) == pytest.approx(want, rel=1e-9)
    uniform = np.zeros((4, 7))
    assert _evaluate.cross_entropy(uniform, np.arange(4), False) == pytest.approx(math.log(7))


# --------------------------------------------------------------------------- progress


def test_progress_prints_plain_lines_without_a_terminal():
    stream = io.StringIO()
    bar = _progress.Progress(100, stream=stream, every_s=3600)
    bar.update(10, 3.5, tokens=1000)  # first update: printed
    bar.update(20, 3.0, tokens=1000)  # within every_s: not printed
    bar.update(100, 2.0, tokens=8000)  # last: printed
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 2
    assert "step 10/100" in lines[0] and "loss 3.5000" in lines[0] and "eta ?" in lines[0]
    assert "step 100/100" in lines[1] and "tok/s" in lines[1] and "eta 0:00" in lines[1]


def test_progress_rewrites_one_line_on_a_terminal():
    stream = io.StringIO()
    bar = _progress.Progress(50, 10, stream=stream, interactive=True)
    bar.update(20, 1.0, tokens=10)
    bar.update(30, 0.9, tokens=10)
    bar.message("validation loss 1.0")
    text = stream.getvalue()
    assert text.count("\r") == 2
    assert text.endswith("\nvalidation loss 1.0\n")
    assert "[############------------]" in text.split("\r")[-1]  # 20 of the 40 steps done


def test_format_duration():
    assert _progress.format_duration(75.2) == "1:15"
    assert _progress.format_duration(3725) == "1:02:05"
    assert _progress.format_duration(float("nan")) == "?"


# --------------------------------------------------------------------------- calibration


def _rows(part, ratios, sizes=(4, 2)):
    return [
        {"kind": "report", "step": i + 1, "part": part, "layer_sizes": list(sizes),
         "update_ratio": r}
        for i, r in enumerate(ratios)
    ]


def test_calibration_medians_multipliers_and_reasons():
    records = [
        {"kind": "train", "step": 1, "loss": 3.0},
        *_rows("big", [0.03, 0.02, 0.04, float("nan")]),
        *_rows("small", [1e-5, 2e-5, 3e-5]),
        *_rows("fine", [1e-3, 1.5e-3, 8e-4]),
        *_rows("still", [0.0, 0.0]),
        *_rows("broken", [float("nan"), None]),
    ]
    table = {c.part: c for c in _calibrate.calibrate(records, target=1e-3)}
    assert list(table) == ["big", "small", "fine", "still", "broken"]
    assert table["big"].median_ratio == pytest.approx(0.03)
    assert table["big"].multiplier == pytest.approx(1 / 30)
    assert table["big"].reason == "updates 30x larger than target: lower this part's rate"
    assert table["small"].multiplier == pytest.approx(50.0)
    assert "50x smaller than target: raise" in table["small"].reason
    assert "keep this part's rate" in table["fine"].reason
    assert table["still"].multiplier is None and "does not learn" in table["still"].reason
    assert table["broken"].multiplier is None and "no finite" in table["broken"].reason
    text = _calibrate.format_table(list(table.values()))
    assert "big" in text and "0.0333" in text and "4x2" in text


def test_calibration_over_the_last_fraction_and_errors():
    rows = _rows("p", [1.0, 1.0, 1e-3, 1e-3])
    (whole,) = _calibrate.calibrate(rows, fraction=1.0)
    (late,) = _calibrate.calibrate(rows, fraction=0.5)
    assert whole.median_ratio == pytest.approx((1.0 + 1e-3) / 2)
    assert late.median_ratio == pytest.approx(1e-3) and late.steps == 2
    with pytest.raises(ValueError, match="no report rows"):
        _calibrate.calibrate([{"kind": "train", "step": 1}])
    with pytest.raises(ValueError, match="target"):
        _calibrate.calibrate(rows, target=0.0)


# --------------------------------------------------------------------------- plots and logs


def test_plots_render_from_log_records(tmp_path):
    records = [{"kind": "eval", "step": 0, "val_loss": 4.0}]
    for step in range(1, 121):
        records.append({"kind": "train", "step": step, "loss": 4.0 - step / 60})
        for j, part in enumerate(("token", "blocks[0].feed_forward", "head")):
            records.append({"kind": "report", "step": step, "part": part,
                            "update_norm": 0.1 * (j + 1), "update_ratio": 1e-3 * (j + 1)})
    records.append({"kind": "eval", "step": 120, "val_loss": 2.2})
    paths = _plots.render_all(records, tmp_path, target=1e-3)
    assert [p.name for p in paths] == ["loss.png", "update_norm.png", "update_ratio.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000
    series = _plots.per_part_series(records, "update_ratio")
    assert list(series) == ["token", "blocks[0].feed_forward", "head"]
    assert series["head"][1][0] == pytest.approx(3e-3)


def test_read_log_names_a_malformed_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"log.jsonl:3: not a JSON line"):
        _log.read_log(path)
    with pytest.raises(FileNotFoundError):
        _log.read_log(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- Ctrl-C


def test_first_ctrl_c_asks_to_stop_and_the_second_aborts():
    asked, before = [], signal.getsignal(signal.SIGINT)
    with _runtime.StopRequest(lambda: asked.append(True)) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and asked == [True] and not stop.aborted
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.aborted
    assert signal.getsignal(signal.SIGINT) is before


def test_distributed_launch_variables_must_come_together(monkeypatch):
    for name in _runtime.PROCESS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUSEDPC_COORDINATOR", "127.0.0.1:23456")
    # one reader of the variables: fusedpc.initialize_distributed
    with pytest.raises(ValueError, match="--distributed: .* together .*num_processes=None, "
                       "process_id=None"):
        _runtime.join_processes()
    monkeypatch.setenv("FUSEDPC_NUM_PROCESSES", "two")
    monkeypatch.setenv("FUSEDPC_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="FUSEDPC_NUM_PROCESSES: expected an integer"):
        _runtime.join_processes()


def test_slot_lr_scales_parse_and_reject_bad_entries():
    from fusedpc.training._config import TrainConfig

    config = TrainConfig(slot_lr_scales="head=0.5, attention=2")
    assert config.lr_scales() == {"head": 0.5, "attention": 2.0}
    for bad in ("wings=2", "head=0", "head", "head=x"):
        with pytest.raises(ValueError, match="slot_lr_scales: expected entries slot=multiplier"):
            TrainConfig(slot_lr_scales=bad).validate()
