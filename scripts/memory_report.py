"""Peak memory of one training step, fused (unrolled, scanned, `run`) and its backprop twin.

Host RSS and the compiled program's `memory_analysis()`, the donated state's aliasing read
from the compiled HLO's `input_output_alias` and mapped back to the state's leaves.

Each variant runs in a fresh Python process (so its `ru_maxrss` is its own): it builds the
variant as the bench does (`fusedpc.bench`'s `Setup`), compiles it, runs three steps (one
`run` call of K steps), and prints one JSON line. The lines of a config end with the ratio
of each variant's temporaries to the twin's.

    python scripts/memory_report.py                    # S and M, every variant
    python scripts/memory_report.py --configs S --variants fused_scan
    python scripts/memory_report.py --smoke            # a tiny config, a few seconds

What every field means: docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from typing import Any

# The configs of docs/benchmarks.md (Adam, every weight learning), and a tiny one for tests.
CONFIGS: dict[str, dict[str, int]] = {
    "S": dict(vocab=65, width=64, n_heads=4, n_blocks=2, ff_width=256, max_len=64, batch=16,
              k=10),
    "M": dict(vocab=65, width=256, n_heads=8, n_blocks=4, ff_width=1024, max_len=128, batch=32,
              k=10),
    "smoke": dict(vocab=11, width=8, n_heads=2, n_blocks=2, ff_width=16, max_len=8, batch=4,
                  k=2),
}
# The bench's variant names: `backprop` is the twin; `fused` and `fused_run` use
# `scan="auto"` (S and M: an unrolled `Repeat`), `fused_scan` forces the scan.
VARIANTS = ("backprop", "fused", "fused_scan", "fused_run")
# `*_ignore`: the same without the commit rule (`nonfinite="ignore"`: no select between the
# old state and the new), to see what the rule's selects cost in temporaries.
EXTRA_VARIANTS = ("fused_run_scan", "fused_unrolled", "fused_ignore", "fused_scan_ignore")
IGNORE = "_ignore"
STEP_CALLS = 3
MB = 2**20

# Bytes per element of the HLO element types a state or a batch holds.
_HLO_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ALIAS = re.compile(r"\{([\d,\s]*)\}:\s*\((\d+),\s*\{([\d,\s]*)\},\s*([\w-]+)\)")
_PARAMETER = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+parameter\((\d+)\)")


# ---------------------------------------------------------------------------- reading HLO
def hlo_aliases(text: str) -> dict[int, list[tuple[int, ...]]]:
    """The `input_output_alias` config of a compiled HLO module: parameter number -> the
    output indices that alias it (empty when nothing is aliased)."""
    header = text.split("\n", 1)[0]
    start = header.find("input_output_alias={")
    if start < 0:
        return {}
    depth, end = 0, start + len("input_output_alias=")
    while end < len(header):  # up to the config's closing brace
        depth += {"{": 1, "}": -1}.get(header[end], 0)
        end += 1
        if depth == 0:
            break
    aliases: dict[int, list[tuple[int, ...]]] = {}
    for out, param, _, _ in _ALIAS.findall(header[start:end]):
        index = tuple(int(i) for i in out.split(",") if i.strip())
        aliases.setdefault(int(param), []).append(index)
    return aliases


def entry_parameter_bytes(text: str) -> dict[int, int]:
    """The entry computation's parameters: parameter number -> bytes (array parameters)."""
    entry = text[text.index("\nENTRY "):]
    entry = entry[: entry.find("\n}")]
    sizes = {}
    for dtype, dims, number in _PARAMETER.findall(entry):
        shape = [int(d) for d in dims.split(",") if d]
        sizes[int(number)] = _HLO_BYTES.get(dtype, 0) * math.prod(shape)
    return sizes


def entry_copies(text: str, min_bytes: int) -> list[str]:
    """The entry computation's `copy` instructions of at least `min_bytes`: the copies XLA
    adds when a value cannot be written in place (e.g. into an aliased output buffer)."""
    entry = text[text.index("\nENTRY "):]
    entry = entry[: entry.find("\n}")]
    found = []
    for line in entry.splitlines():
        match = re.search(r"=\s*(\w+)\[([\d,]*)\]\S*\s+copy\(", line)
        if match:
            shape = [int(d) for d in match.group(2).split(",") if d]
            if _HLO_BYTES.get(match.group(1), 0) * math.prod(shape) >= min_bytes:
                found.append(f"{match.group(1)}[{match.group(2)}]")
    return found


def donation_report(compiled, leaves: list[tuple[str, Any]], donated: int) -> dict[str, Any]:
    """Which donated leaves the compiled program's output aliases, read from its HLO.

    Args:
        compiled: the `jax.stages.Compiled` program.
        leaves: `(key path, array)` of every flattened argument, in the jit's order.
        donated: how many of the leading leaves are donated (the state comes first).

    Returns:
        The bytes and counts of donated, kept (not pruned as unused) and aliased leaves,
        and the donated leaves that are not aliased, by key path.
    """
    text = compiled.as_text()
    aliases, sizes = hlo_aliases(text), entry_parameter_bytes(text)
    kept = getattr(compiled._executable, "_kept_var_idx", None)  # jax-private: pruned args
    kept = sorted(kept) if kept is not None else list(range(len(leaves)))
    if len(kept) != len(sizes):
        raise RuntimeError(
            f"the HLO entry has {len(sizes)} parameters, jax kept {len(kept)} arguments: "
            "the parameters cannot be mapped to the state's leaves."
        )
    param_of = {leaf: number for number, leaf in enumerate(kept)}
    aliased_bytes, mismatched, not_aliased = 0, [], []
    for i, (path, leaf) in enumerate(leaves[:donated]):
        number = param_of.get(i)
        if number is not None and sizes[number] != leaf.nbytes:
            mismatched.append(path)
        if number is not None and number in aliases:
            aliased_bytes += leaf.nbytes
            continue
        not_aliased.append({
            "path": path, "shape": list(leaf.shape), "dtype": str(leaf.dtype),
            "mb": leaf.nbytes / MB, "why": "pruned (unused)" if number is None else "no alias",
        })
    return {
        "donated_leaves": donated,
        "aliased_params": sum(1 for n in aliases if kept[n] < donated),
        "aliased_other_params": sum(1 for n in aliases if kept[n] >= donated),
        "hlo_aliased_mb": aliased_bytes / MB,
        "not_aliased": not_aliased,
        "param_size_mismatches": mismatched,
        "entry_copies_over_64kb": entry_copies(text, 64 * 1024),
    }


# ---------------------------------------------------------------------------- one variant
def current_rss_mb() -> float:
    """This process's resident set size now, in MB (Linux `/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _args(config: str, variant: str):
    from fusedpc.bench import BenchArgs

    c = CONFIGS[config]
    return BenchArgs(
        vocab=c["vocab"], width=c["width"], n_heads=c["n_heads"], n_blocks=(c["n_blocks"],),
        ff_width=c["ff_width"], max_len=c["max_len"], batch=c["batch"], k=c["k"],
        learning="all",
        optimiser="adam", lr=1e-3, nonfinite="ignore" if variant.endswith(IGNORE) else "skip",
    )


def _paths(tree) -> list[tuple[str, Any]]:
    import jax

    return [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _fused(setup, variant: str):
    """`(compiled, leaves, donated)` of a fused variant after its calls."""
    import jax

    from fusedpc.bench._args import RUN_VARIANTS

    pipeline = setup.pipeline(variant)
    if variant in RUN_VARIANTS:  # one call of K steps
        xs, ts = setup.run_ids, setup.run_targets
        pipeline.run(xs, ts, keep_outputs=False)
        jax.block_until_ready(pipeline.state)
        # `run`'s own jit (no public accessor), served from its cache: what `run` ran
        compiled = pipeline._run_jit.lower(
            jax.tree_util.tree_leaves(pipeline.carry), xs, ts, None, keep_outputs=False
        )
        compiled = compiled.compile()
        batch: tuple = (xs, ts)
    else:
        for i in range(STEP_CALLS):
            pipeline.step(*setup.batch(i))
        jax.block_until_ready(pipeline.state)
        compiled = pipeline.compiled_step(*setup.batch(0))
        batch = setup.batch(0)
    state = _paths({"carry": pipeline.carry})
    return compiled, state + _paths({"batch": batch}), len(state)


def _twin(setup):
    """`(compiled, leaves, donated)` of the backprop twin after its calls: its step
    (`make_backprop_step`) jitted over the model's and the optimiser's arrays, donated, as
    the bench donates them (its own `filter_jit` is inlined)."""
    import equinox as eqx
    import jax

    from fusedpc.transformer.reference import make_backprop_step

    _, _, reference = setup.build(scan=True)
    step = make_backprop_step(setup.optimiser)
    opt = setup.optimiser.init(eqx.filter(reference, eqx.is_array))
    arrays, static = eqx.partition((reference, opt), eqx.is_array)

    def twin_step(arrays, ids, targets):
        model, opt = eqx.combine(arrays, static)
        model, opt, loss = step(model, opt, ids, targets)
        return eqx.filter((model, opt), eqx.is_array), loss

    jitted = jax.jit(twin_step, donate_argnums=0)
    for i in range(STEP_CALLS):
        arrays, loss = jitted(arrays, *setup.batch(i))
    jax.block_until_ready(arrays)
    compiled = jitted.lower(arrays, *setup.batch(0)).compile()  # from the cache
    state = _paths({"model": arrays[0], "opt": arrays[1]})
    return compiled, state + _paths({"batch": setup.batch(0)}), len(state)


def measure(config: str, variant: str) -> dict[str, Any]:
    """Build, compile and run one variant in this process; returns its JSON row."""
    import jax

    from fusedpc.bench._measure import device_info, maxrss_mb
    from fusedpc.bench._probes import memory_stats
    from fusedpc.bench._setup import Setup

    jax.devices()  # the backend starts before the baseline: it is not the variant's
    rss_before = current_rss_mb()
    args = _args(config, variant)
    setup = Setup(args, args.n_blocks[0])
    if variant == "backprop":
        compiled, leaves, donated = _twin(setup)
    else:
        compiled, leaves, donated = _fused(setup, variant.removesuffix(IGNORE))
    peak = maxrss_mb()
    stats = memory_stats(compiled)
    analysis = compiled.memory_analysis()
    donated_bytes = sum(leaf.nbytes for _, leaf in leaves[:donated])
    row: dict[str, Any] = {
        "config": config,
        "variant": variant,
        "blocks_form": "twin" if variant == "backprop" else _blocks_form(variant, args),
        "nonfinite": None if variant == "backprop" else args.nonfinite,
        "host_peak_rss_mb": peak,
        "host_rss_before_build_mb": rss_before,
        "host_rss_growth_mb": peak - rss_before,
        "argument_mb": None if stats is None else stats["argument_mb"],
        "output_mb": None if stats is None else stats["output_mb"],
        "alias_mb": None if stats is None else stats["alias_mb"],
        "temp_mb": None if stats is None else stats["temp_mb"],
        "generated_code_mb": None
        if analysis is None else analysis.generated_code_size_in_bytes / MB,
        "total_mb": None if stats is None else stats["total_mb"],
        "donated_mb": donated_bytes / MB,
        **donation_report(compiled, leaves, donated),
        "steps": args.k if "run" in variant else STEP_CALLS,
        **{key: value for key, value in device_info().items() if key in ("device", "jax")},
        "cpus": os.cpu_count(),
    }
    row["alias_gap_mb"] = row["donated_mb"] - (row["alias_mb"] or 0.0)
    return row


def _blocks_form(variant: str, args) -> str:
    from fusedpc.bench._setup import variant_blocks_form

    return variant_blocks_form(variant.removesuffix(IGNORE), args.n_blocks[0])


# ---------------------------------------------------------------------------- the driver
def in_subprocess(config: str, variant: str) -> dict[str, Any]:
    """`measure(config, variant)` in a fresh Python process; raises with its stderr."""
    command = [sys.executable, __file__, "--worker", f"{config}:{variant}"]
    done = subprocess.run(command, capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(
            f"memory_report worker {config}:{variant} failed with exit code "
            f"{done.returncode}:\n{done.stderr[-4000:]}"
        )
    return json.loads(rows[-1])


def _list(text: str, allowed: tuple[str, ...], name: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"--{name}: unknown {unknown or values}; choose from {', '.join(allowed)}"
        )
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", default="S,M", type=lambda t: _list(t, ("S", "M"), "configs"),
        help="comma-separated configs: S, M (default S,M)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS),
        type=lambda t: _list(t, VARIANTS + EXTRA_VARIANTS, "variants"),
        help=f"comma-separated variants (default {','.join(VARIANTS)}; also "
        f"{','.join(EXTRA_VARIANTS)}); backprop is the twin, measured first",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny config only, every variant (seconds)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        config, variant = args.worker.split(":")
        print(json.dumps(measure(config, variant)), flush=True)
        return 0
    configs = ["smoke"] if args.smoke else args.configs
    variants = sorted(args.variants, key=lambda v: v != "backprop")  # the twin first
    for config in configs:
        twin_temp = None
        for variant in variants:
            row = in_subprocess(config, variant)
            if variant == "backprop":
                twin_temp = row["temp_mb"]
            row["temp_ratio_to_twin"] = (
                None if not twin_temp or row["temp_mb"] is None else row["temp_mb"] / twin_temp
            )
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
