"""The rows that summarise measured rows: the settings of a row, the ratios to backprop
(`--compare`), the depth sweep's summary, and the human table on stderr."""

from __future__ import annotations

from typing import Any

from fusedpc.bench._args import SWEEP_VARIANTS, BenchArgs


def config_fields(args: BenchArgs, n_blocks: int) -> dict[str, Any]:
    """The settings a row was measured at (the model's shape, its training, its devices)."""
    return {
        "vocab": args.vocab,
        "width": args.width,
        "n_heads": args.n_heads,
        "n_blocks": n_blocks,
        "ff_width": args.ff_width,
        "max_len": args.max_len,
        "batch": args.batch,
        "learning": args.learning,
        "optimiser": args.optimiser,
        "lr": args.lr,
        "nonfinite": args.nonfinite,
        "dtype": args.dtype,
        "parameterisation": args.parameterisation,
        "steps": args.steps,
        "devices": args.devices,
    }


def compare_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `compare` row: each variant's step time over backprop's (wall clock and CPU), and
    unfused over fused, fused over fused run; `None` when no row was timed."""
    by_variant = {r["variant"]: r for r in rows if "step_ms" in r}
    if not by_variant:
        return None
    base = by_variant.get("backprop")
    ratios = {
        name: None if base is None else r["step_ms"] / base["step_ms"]
        for name, r in by_variant.items()
    }
    cpu_ratios = {
        name: None if base is None else r["step_cpu_ms"] / base["step_cpu_ms"]
        for name, r in by_variant.items()
    }
    out: dict[str, Any] = {
        "variant": "compare",
        "ratio_to_backprop": ratios,
        "cpu_ratio_to_backprop": cpu_ratios,
    }
    if "unfused" in by_variant and "fused" in by_variant:
        out["unfused_over_fused"] = (
            by_variant["unfused"]["step_ms"] / by_variant["fused"]["step_ms"]
        )
    if "fused_run" in by_variant and "fused" in by_variant:
        out["fused_over_fused_run"] = (
            by_variant["fused"]["step_ms"] / by_variant["fused_run"]["step_ms"]
        )
    return out


def sweep_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `sweep_summary` row: per sweep variant, the deepest over the shallowest depth's
    compile and step times; `None` when no variant was measured at two depths."""
    out: dict[str, Any] = {"variant": "sweep_summary"}
    for variant in SWEEP_VARIANTS:
        mine = sorted((r for r in rows if r.get("variant") == variant),
                      key=lambda r: r["n_blocks"])
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]
        out[variant] = {
            "n_blocks": [lo["n_blocks"], hi["n_blocks"]],
            "compile_ratio": hi["compile_s"] / lo["compile_s"],
            "compile_only_ratio": hi["compile_only_s"] / max(lo["compile_only_s"], 1e-9),
            "step_ratio": hi["step_ms"] / lo["step_ms"],
        }
    return out if len(out) > 1 else None


def table(rows: list[dict[str, Any]], compare: dict[str, Any] | None) -> str:
    """The timed rows as a fixed-width text table (`fusedpc.training.format_rows`), with the
    ratio to backprop if compared (`-` where there is none)."""
    from fusedpc.training import format_rows

    ratios = (compare or {}).get("ratio_to_backprop", {})
    timed = [{**r, "ratio": ratios.get(r["variant"])} for r in rows if "step_ms" in r]
    return format_rows(timed, _TABLE_COLUMNS, frame=False)


_TABLE_COLUMNS = (
    ("variant", "variant"),
    ("n_blocks", "blocks", "", ">"),
    ("step_ms", "step ms", ".2f", ">"),
    ("step_cpu_ms", "cpu ms", ".2f", ">"),
    ("tokens_per_s", "tokens/s", ".0f", ">"),
    ("compile_s", "compile s", ".2f", ">"),
    ("peak_mb", "peak MB", ".0f", ">"),
    ("gflops", "GFLOP/s", ".2f", ">"),
    ("ratio", "ratio", ".2f", ">"),
)
