"""The pieces of the training loop that need no model: call sizes, cross-entropy, progress
line, calibration, plots and the log. (Configs: test_config.py; Ctrl-C and processes:
test_runtime.py; runs of the loop itself: tests/cli/test_cli.py.)"""

from __future__ import annotations

import io
import math
import time

import numpy as np
import pytest

from fusedpc.training import (
    _calibrate,
    _evaluate,
    _log,
    _plots,
    _progress,
    _setup,
)


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
    # rel 1e-6: validation uses the library's one cross-entropy, in float32 (it was float64).
    assert _evaluate.cross_entropy(logits, targets, False) == pytest.approx(want, rel=1e-6)
    assert _evaluate.cross_entropy(probs, targets, True) == pytest.approx(want, rel=1e-6)
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
    bar = _progress.Progress(50, 10, stream=stream, interactive=True, tick_s=0)
    bar.update(20, 1.0, tokens=10)
    bar.update(30, 0.9, tokens=10)
    bar.message("validation loss 1.0")
    text = stream.getvalue()
    # two updates, then the bar drawn again below the message (not lost above it)
    assert text.count("\r") == 3
    before, after = text.rsplit("\nvalidation loss 1.0\n", 1)
    assert after.startswith("\r[############------------]")  # 20 of the 40 steps done
    assert "[############------------]" in before.split("\r")[-1]
    bar.close()
    assert stream.getvalue().endswith("\n")  # later output starts on a line of its own


def test_progress_ticks_on_a_terminal_while_a_call_runs():
    stream = io.StringIO()
    bar = _progress.Progress(50, stream=stream, interactive=True, tick_s=0.05)
    bar.update(5, 1.0, tokens=10)
    time.sleep(0.5)  # a long compiled call: no update, the line is redrawn anyway
    bar.close()
    assert stream.getvalue().count("\r") >= 4


def test_progress_under_a_pipe_prints_at_most_every_n_steps():
    stream = io.StringIO()
    bar = _progress.Progress(100, stream=stream, every_s=0, every_steps=25)
    for step in range(5, 101, 5):
        bar.update(step, 1.0, tokens=10)
    steps = [int(line.split("step ")[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == [5, 30, 55, 80, 100]  # the first, then every 25 steps or more, the last


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


def test_the_slot_rule_pools_a_slots_parts_to_the_target_ratio():
    # kept from the calibration study's own tests (its `report_rule` was `calibrate_slots`):
    # a slot's parts are pooled, each slot brought to the target ratio
    ratios = {"token": 1e-4, "blocks[0].attention.wq": 4e-3, "blocks[0].attention.wo": 4e-3,
              "head": 1e-3}
    rows = [{"kind": "report", "step": step, "part": part, "update_ratio": ratio,
             "layer_sizes": [4, 4]} for step in (5, 10, 15) for part, ratio in ratios.items()]
    table = {c.part: c.multiplier for c in _calibrate.calibrate_slots(rows, 1e-3)}
    assert table == pytest.approx({"token": 10.0, "attention": 0.25, "head": 1.0})


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




def test_a_full_disk_while_logging_names_the_log_file(tmp_path, monkeypatch):
    # Reliability III: "No space left on device" named no file when the log was written.
    import errno

    from fusedpc.training._log import RunLog

    path = tmp_path / "log.jsonl"
    log = RunLog(path, [], write=True)

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    real = log._file
    log._file = FullDisk()
    try:
        with pytest.raises(OSError, match=r"No space left on device") as info:
            log.emit({"step": 1})
        assert info.value.filename == str(path) and info.value.errno == errno.ENOSPC
    finally:
        real.close()
