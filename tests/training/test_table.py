"""The one table printer (`fusedpc.training.format_rows`) and the tables built on it."""

from __future__ import annotations

import dataclasses

import pytest

from fusedpc.training import Column, TrainResult, format_rows
from fusedpc.training._loop import format_summary


def test_columns_are_as_wide_as_their_widest_cell_and_rules_as_the_table():
    rows = [{"name": "fused", "ms": 1.5, "ratio": 0.25}, {"name": "backprop", "ms": 12.25}]
    columns = [("name", "variant"), Column("ms", "step ms", ".2f", ">"), ("ratio", "ratio", ".2f")]
    assert format_rows(rows, columns, title="bench").splitlines() == [
        "bench",
        "------------------------",
        "variant   step ms  ratio",
        "------------------------",
        "fused        1.50  0.25",
        "backprop    12.25  -",
        "------------------------",
    ]


def test_without_header_or_frame():
    rows = [{"a": "x", "b": 1}, {"a": "yyy", "b": None}]
    assert format_rows(rows, [("a",), ("b",)], header=False, missing="") == (
        "------\nx    1\nyyy\n------"
    )
    assert format_rows(rows, [("a", "A"), ("b", "B")], frame=False, gap=1) == (
        "A   B\n-----\nx   1\nyyy -"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"columns": []}, "columns must name at least one column"),
        ({"columns": [("a",)], "gap": -1}, "gap must be >= 0, got -1"),
        ({"columns": [("a", "A", "", "right")]}, "column 'a' has align='right'"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        format_rows([{"a": 1}], **kwargs)


def _old_format_summary(result: TrainResult) -> str:
    """`format_summary` before it used `format_rows` (its output is kept)."""
    rows = result.summary_rows()
    width = max(len(label) for label, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    body = [f"{label:<{width}}  {value}" for label, value in rows]
    return "\n".join([rule, *body, rule])


@pytest.mark.parametrize("interrupted", [False, True])
def test_the_end_of_run_summary_is_unchanged(tmp_path, interrupted):
    result = TrainResult(
        out=tmp_path, config=None, step=1000, train_loss=1.80612, val_loss=1.8494,
        val_perplexity=6.3561, tokens_per_s=16037.2 if not interrupted else float("nan"),
        elapsed_s=88.0, compile_s=18.3, skipped_steps=0, interrupted=interrupted, sample="",
        pipeline=None, tokenizer=None, files=[],
    )
    assert format_summary(result) == _old_format_summary(result)
    assert "validation perplexity       6.36" in format_summary(result)
    assert "calibration" not in format_summary(result)  # a row only when trials ran
    calibrated = dataclasses.replace(result, calibration_s=45.2)
    assert ("calibration trials", "0:45") in calibrated.summary_rows()
