"""`fusedpc bench`: the plan of measurements, where each runs, and the rows printed."""

from __future__ import annotations

import sys
from typing import Any

from fusedpc.bench._args import PROBES, BenchArgs, parse_args
from fusedpc.bench._report import compare_row, sweep_row, table
from fusedpc.bench._workers import (
    emit,
    in_subprocess,
    run_task,
    step_temporaries,
    worker_main,
)


def plan(args: BenchArgs) -> list[tuple[str, int]]:
    """The measurements to take, in order, as `(task, n_blocks)`: the peak probe first, then
    every variant at every depth, then the donation probe; with `--interleave` the variants
    of one depth are one task `"*"` (measured together, in this process)."""
    tasks: list[tuple[str, int]] = []
    if args.peak or "peak" in args.variants:
        tasks.append(("peak", args.n_blocks[0]))
    for n_blocks in args.n_blocks:
        for variant in args.variants:
            if variant not in PROBES:
                tasks.append((variant, n_blocks))
    if "donation" in args.variants or (not args.sweep and not args.no_donate_probe):
        tasks.append(("donation", args.n_blocks[0]))
    if not args.interleave:
        return tasks
    grouped: list[tuple[str, int]] = []
    for task, n_blocks in tasks:
        if task in PROBES:
            grouped.append((task, n_blocks))
        elif not any(t == "*" and b == n_blocks for t, b in grouped):
            grouped.append(("*", n_blocks))
    return grouped


def _add_peak_fraction(row: dict[str, Any], peak: dict[str, Any] | None) -> None:
    if peak is not None and "gflops" in row:
        row["peak_fraction"] = row["gflops"] / peak["peak_gflops"]
        row["peak_fraction_cpu"] = row["gflops_cpu"] / peak["peak_gflops_cpu"]


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the measurements, print one JSON object per line.

    Args:
        argv: the flags (default `sys.argv[1:]`); see `build_parser`.

    Returns:
        0. A bad flag exits with code 2 (argparse's).
    """
    args, worker = parse_args(argv)
    if worker:  # a measuring process: its settings come from stdin
        return worker_main()
    here = args.in_process or args.interleave
    if here:
        from fusedpc.training import host_memory_choice

        host_memory_choice(args.host_memory, step_temporaries(args))
        # jax runs here: ask for the devices before it starts its backend (in-process it may
        # be too late, and `Setup` says so)
        if args.devices > 1:
            from fusedpc.training import emulate_cpu_devices

            emulate_cpu_devices(args.devices)

    rows: list[dict[str, Any]] = []
    peak = None
    for task, n_blocks in plan(args):
        if task == "*":
            from fusedpc.bench._measure import measure_interleaved

            measured = [v for v in args.variants if v not in PROBES]
            for row in measure_interleaved(args, measured, n_blocks):
                _add_peak_fraction(row, peak)
                rows.append(row)
                emit(row)
            continue
        row = run_task(args, task, n_blocks) if here else in_subprocess(args, task, n_blocks)
        if here and "rss_growth_mb" in row:
            row["peak_mb"] = row["rss_growth_mb"]
            row["peak_method"] = "rss_growth_in_process"
        elif "peak_mb" in row:
            row["peak_method"] = "rss_max_subprocess"
        if task == "peak":
            peak = row
        else:
            _add_peak_fraction(row, peak)
        rows.append(row)
        emit(row)

    compare = compare_row(rows) if args.compare and not args.sweep else None
    if compare is not None:
        emit(compare)
    if args.sweep:
        summary = sweep_row(rows)
        if summary is not None:
            emit(summary)
    if args.compare or args.sweep:
        print(table(rows, compare), file=sys.stderr)
    return 0
