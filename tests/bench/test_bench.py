"""Smoke tests of the benchmark script on a micro config: the JSON rows and their fields.

Nothing here is timed: the figures are only checked to exist and be positive.
"""

import json
import os
import warnings

import numpy as np
import pytest

from fusedpc import _deprecation, bench
from fusedpc.bench import _workers

MICRO = [
    "--vocab", "7", "--width", "4", "--n-heads", "2", "--n-blocks", "1", "--max-len", "4",
    "--batch", "2", "--steps", "2", "--warmup", "0", "--k", "2", "--learning", "none",
    "--optimiser", "sgd", "--lr", "0.1",
]
ROW_FIELDS = (
    "variant", "step_ms", "tokens_per_s", "compile_s", "peak_mb", "gflops", "device",
    "step_cpu_ms", "vocab", "width", "n_heads", "n_blocks", "max_len", "batch", "learning",
)


def _rows(capsys) -> tuple[list[dict], str]:
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.strip()]
    assert lines, "the bench printed nothing"
    return [json.loads(line) for line in lines], captured.err  # one JSON object per line


@pytest.mark.slow
def test_all_variants_in_process_with_compare_and_peak(capsys):
    argv = [*MICRO, "--in-process", "--compare", "--peak", "--peak-sizes", "16"]
    assert bench.main(argv) == 0
    rows, err = _rows(capsys)
    by_variant = {r["variant"]: r for r in rows}
    assert list(by_variant) == ["peak", *bench.VARIANTS, "donation", "compare"]
    assert by_variant["peak"]["peak_gflops"] > 0
    for variant in bench.VARIANTS:
        row = by_variant[variant]
        for field in ROW_FIELDS:
            assert field in row, f"{variant}: missing {field}"
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["gflops"] > 0
        assert row["compile_s"] > 0 and row["step_cpu_ms"] >= 0
        assert row["peak_method"] == "rss_growth_in_process"
        assert row["peak_fraction"] > 0
        assert (row["width"], row["n_blocks"], row["learning"]) == (4, 1, "none")
        assert not {"heads", "blocks", "seq"} & set(row)  # the train spelling only
    assert by_variant["fused_run"]["steps_per_call"] == 2
    donation = by_variant["donation"]
    assert donation["donated_peak_mb"] < donation["not_donated_peak_mb"]
    assert donation["donated"]["alias_mb"] > 0 and donation["not_donated"]["alias_mb"] == 0
    ratios = by_variant["compare"]["ratio_to_backprop"]
    assert ratios["backprop"] == pytest.approx(1.0)
    assert set(ratios) == set(bench.VARIANTS)
    assert by_variant["compare"]["unfused_over_fused"] > 0
    assert "ratio" in err and "backprop" in err  # the human table


@pytest.mark.slow
def test_interleaved_depth_sweep_rows_and_summary(capsys):
    argv = [*MICRO, "--interleave", "--n-blocks", "1,2", "--steps", "1", "--variants",
            "fused_scan"]
    assert bench.main(argv) == 0
    rows, err = _rows(capsys)
    measured = [(r["variant"], r["n_blocks"]) for r in rows if "step_ms" in r]
    assert measured == [("fused_scan", 1), ("fused_scan", 2)]
    summary = rows[-1]
    assert summary["variant"] == "sweep_summary"
    assert summary["fused_scan"]["n_blocks"] == [1, 2]
    assert summary["fused_scan"]["compile_ratio"] > 0
    assert all(r["peak_method"] == "rss_growth_interleaved" for r in rows if "step_ms" in r)
    assert "fused_scan" in err and "compile s" in err  # the human table


@pytest.mark.slow
def test_worker_subprocess_with_emulated_devices(capsys):
    # The default path: each variant in a fresh process, XLA_FLAGS set before jax starts.
    argv = [*MICRO, "--variants", "fused", "--no-donate-probe", "--devices", "2"]
    assert bench.main(argv) == 0
    (row,), _ = _rows(capsys)
    assert row["variant"] == "fused"
    assert row["n_devices"] == 2 and row["devices"] == 2
    assert row["peak_method"] == "rss_max_subprocess" and row["peak_mb"] > 0
    # the device count went to the worker's environment only, not to this process's
    assert "device_count=2" not in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--width", "6", "--n-heads", "4"], "--n-heads 4 must divide --width 6"),
        (["--max-len", "0"], "--max-len must be >= 1"),
        (["--batch", "3", "--devices", "2"], "must divide over --devices"),
        (["--variants", "fused,warp"], "unknown variants"),
        (["--n-blocks", "1,0"], "integers >= 1"),
    ],
)
def test_bad_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        bench.main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "old, new, value, setting",
    [("--heads", "--n-heads", "2", ("n_heads", 2)),
     ("--blocks", "--n-blocks", "1,3", ("n_blocks", (1, 3))),
     ("--seq", "--max-len", "8", ("max_len", 8))],
)
def test_the_old_flags_still_work_and_say_the_new_spelling(old, new, value, setting):
    # fusedpc train's spelling since 0.4; the old one until fusedpc._deprecation.REMOVED_IN
    with pytest.warns(DeprecationWarning, match=f"fusedpc bench {old} is now {new}; the old "
                      f"name will be removed in {_deprecation.REMOVED_IN}"):
        args, _ = bench.parse_args(["--width", "8", old, value])
    name, want = setting
    assert getattr(args, name) == want
    assert args == bench.parse_args(["--width", "8", new, value])[0]
    assert old not in bench.build_parser().format_help()  # --help names the new flag only


def test_the_new_flags_raise_no_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args, _ = bench.parse_args(["--n-heads", "2", "--n-blocks", "2", "--max-len", "8"])
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert (args.n_heads, args.n_blocks, args.max_len) == (2, (2,), 8)


def test_worker_receives_exactly_the_parents_settings():
    # A worker must measure exactly what the parent was asked for: the whole BenchArgs
    # survives the round trip through the worker's request, with the task and its depth.
    argv = [
        *MICRO, "--n-blocks", "1,3", "--ff-width", "12", "--nonfinite", "ignore", "--profile",
        "--devices", "2", "--seed", "5", "--peak-sizes", "8,16", "--lr", "0.25",
        "--host-memory", "system", "--interleave", "--compare",
    ]
    args, worker = bench.parse_args(argv)
    assert not worker
    assert args.ff_width == 12 and args.n_blocks == (1, 3) and args.lr == 0.25
    assert args.variants == bench.SWEEP_VARIANTS  # the sweep's default, resolved once
    request = _workers.worker_request(args, "fused", 3)
    received, task, n_blocks = _workers.read_worker_request(request)
    assert received == args
    assert (task, n_blocks) == ("fused", 3)
    assert bench.BenchArgs.from_json(args.to_json()) == args


def test_settings_are_checked_when_built():
    with pytest.raises(ValueError, match="must divide --width"):
        bench.BenchArgs(width=6, n_heads=4, ff_width=24)
    with pytest.raises(ValueError, match="unknown variants"):
        bench.BenchArgs(variants=("fused", "warp"))


@pytest.mark.slow
def test_iterative_variants_run_beside_the_single_sweep_step(capsys):
    # --learning all: the feed-forwards learn, so they are IterativeNetworks relaxing T steps
    argv = [*MICRO, "--in-process", "--no-donate-probe", "--learning", "all", "--variants",
            "fused,fused_iterative,fused_run_iterative,fused_iterative_T5", "--inference-steps",
            "3"]
    assert bench.main(argv) == 0
    rows, _ = _rows(capsys)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"fused", "fused_iterative", "fused_run_iterative",
                               "fused_iterative_T5"}
    assert by_variant["fused_iterative_T5"]["inference_steps"] == 5  # T from its name
    for row in by_variant.values():
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
    assert by_variant["fused_run_iterative"]["steps_per_call"] == 2
    assert by_variant["fused_iterative"]["inference_steps"] == 3
    assert "inference_steps" not in by_variant["fused"]


@pytest.mark.slow
def test_tree_pc_variants_run_beside_the_single_sweep_step_and_the_twin(capsys):
    argv = [*MICRO, "--in-process", "--no-donate-probe", "--variants",
            "fused,fused_tree_pc,fused_run_tree_pc,fused_tree_pc_T2,backprop",
            "--inference-steps", "3"]
    assert bench.main(argv) == 0
    rows, _ = _rows(capsys)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"fused", "fused_tree_pc", "fused_run_tree_pc",
                               "fused_tree_pc_T2", "backprop"}
    assert by_variant["fused_tree_pc"]["inference_steps"] == 3
    assert by_variant["fused_tree_pc_T2"]["inference_steps"] == 2  # T from its name
    assert by_variant["fused_run_tree_pc"]["steps_per_call"] == 2
    for row in by_variant.values():
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
    assert "inference_steps" not in by_variant["fused"]


@pytest.mark.slow
def test_the_infill_variant_times_a_fill_in_beside_a_step(capsys):
    argv = [*MICRO, "--in-process", "--no-donate-probe", "--variants",
            "fused,infill,infill_T2", "--inference-steps", "3"]
    assert bench.main(argv) == 0
    rows, _ = _rows(capsys)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"fused", "infill", "infill_T2"}
    assert by_variant["infill"]["inference_steps"] == 3
    assert by_variant["infill_T2"]["inference_steps"] == 2  # T from its name
    assert "not a training step" in by_variant["infill"]["note"]
    assert all(row["step_ms"] > 0 for row in by_variant.values())
    from fusedpc.bench._setup import Setup, _infill_call

    call = _infill_call(Setup(bench.BenchArgs(), 2), "infill_T0")  # 0 sweeps: the causal fill
    filled = np.asarray(call(0))
    ids = np.asarray(Setup(bench.BenchArgs(), 2).batch(0)[0])
    assert filled.shape == ids.shape
    shown = np.ones(ids.shape, bool)
    shown[:, 8::8] = False
    assert (filled[shown] == ids[shown]).all()


def test_bad_inference_settings_are_refused():
    with pytest.raises(ValueError, match="--inference-steps must be >= 0"):
        bench.BenchArgs(inference_steps=-1)
    with pytest.raises(ValueError, match="--inference-rate must be > 0"):
        bench.BenchArgs(inference_rate=0.0)
    with pytest.raises(ValueError, match="unknown variants"):
        bench.BenchArgs(variants=("fused_iterative_Tx",))
    with pytest.raises(ValueError, match="--inference-tolerance must be >= 0"):
        bench.BenchArgs(inference_tolerance=-1.0)
    with pytest.raises(ValueError, match="--incremental-inference and --inference-tolerance"):
        bench.BenchArgs(inference_tolerance=0.01, incremental_inference=True)
    with pytest.raises(ValueError, match="--parameterisation must be standard or mupc"):
        bench.BenchArgs(parameterisation="mup")


@pytest.mark.slow
def test_mupc_reaches_every_variant_and_its_twin(capsys):
    argv = [*MICRO, "--n-blocks", "3", "--in-process", "--no-donate-probe", "--variants",
            "fused,fused_tree_pc,backprop", "--inference-steps", "2",
            "--parameterisation", "mupc"]
    assert bench.main(argv) == 0
    rows, _ = _rows(capsys)
    timed = [row for row in rows if "step_ms" in row]
    assert {row["variant"] for row in timed} == {"fused", "fused_tree_pc", "backprop"}
    assert all(row["parameterisation"] == "mupc" and row["step_ms"] > 0 for row in timed)
    from fusedpc.bench._setup import Setup

    config, part, reference = Setup(bench.BenchArgs(parameterisation="mupc"), 3).build("auto")
    assert config.branch_scale == pytest.approx(1 / 6 ** 0.5)
    assert {b.branch_scale for b in reference.blocks} == {config.branch_scale}
    assert {b.branch_scale for _, b in part.blocks.children()} == {config.branch_scale}


@pytest.mark.slow
@pytest.mark.parametrize("flags, field, value", [
    (["--inference-tolerance", "1e-9"], "inference_tolerance", 1e-9),
    (["--incremental-inference", "true"], "incremental_inference", True),
])
def test_tree_pc_variants_take_adaptive_and_incremental_inference(capsys, flags, field, value):
    argv = [*MICRO, "--in-process", "--no-donate-probe", "--variants", "fused_tree_pc",
            "--inference-steps", "2", *flags]
    assert bench.main(argv) == 0
    rows, _ = _rows(capsys)
    assert rows[0][field] == value and rows[0]["step_ms"] > 0
