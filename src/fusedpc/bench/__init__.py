"""Benchmarks of a GPT part tree, side by side in one run; one JSON object per line.

Variants (each measured on the same config, weights and batches):

* `fused`: `FusedPipeline.step`, the whole training step as one compiled program;
* `fused_run`: `FusedPipeline.run` with `--k` steps per call (a `lax.scan`), per-step time;
* `unfused`: the same tree with one jit per leaf part, the composites walked in Python
  (`fusedpc.execution._unfused`), so errors pass between parts through the host dispatch loop;
* `backprop`: the reference equinox GPT trained by `jax.value_and_grad` and the same optax
  optimiser, state donated (`fusedpc.transformer.reference.make_backprop_step`);
* `fused_scan`, `fused_run_scan`: `fused` and `fused_run` with the blocks always scanned
  (`GPTConfig(scan=True)`); `fused_unrolled`, `fused_run_unrolled`: with the blocks as a tuple,
  unrolled (`GPTConfig(scan=False)`). `fused` and `fused_run` use `build_gpt`'s default,
  `scan="auto"` (a `Repeat` unrolled up to 4 blocks, scanned beyond).

`--blocks 1,2,4,8,16` runs a depth sweep instead: `fused_scan` (blocks in a `Repeat`, one
scanned block) and `fused_unrolled` (blocks unrolled in Python) at each depth. `--peak` adds
a float32 matmul probe (the machine's reachable GFLOP/s) and a `peak_fraction` per row. The
donation probe compares the compiled memory of the fused step with and without its state
donated (`Compiled.memory_analysis()`).

Every measurement runs in its own subprocess by default, so the peak host RSS
(`ru_maxrss`, which only ever grows within a process) belongs to one variant alone;
`--in-process` runs them all in this process (faster; `peak_mb` is then the growth of the
maximum RSS during the variant, a lower bound). `--interleave` builds every variant in this
process and times their calls in turn, one call of each per round, so that a machine shared
with other jobs slows them alike (the fairest ratios on such a machine).

This module imports jax only inside functions, after the flags are parsed, so `--devices N`
can set `XLA_FLAGS=--xla_force_host_platform_device_count=N` before jax starts its backend
(importing the `fusedpc` package imports jax but starts no backend; the workers are fresh
processes that inherit the flag).

Timing: the first call (tracing, compiling, one execution) is `first_call_s`; `compile_s`
is the same figure (the time a user waits before the first step returns) and
`compile_only_s` subtracts one steady step. Then `--warmup` untimed calls, then `--steps`
timed calls, each ended by `jax.block_until_ready` on the outputs and the new state;
`step_ms` is the median (`step_ms_p25`/`p75` the quartiles) and `step_cpu_ms` the median
process CPU time (every thread; on a machine shared with other jobs the steadier figure),
with `sys_fraction` the share of it spent in the kernel and `page_faults_per_call` the minor
page faults per call (fresh temporary buffers being mapped). `gflops` divides the analytic
FLOP count of one backprop step (`fusedpc.transformer.reference.count_flops`: matrix products
only) by the
median step time, `gflops_cpu` by the median CPU time (FLOPs per core-second); with `--peak`,
`peak_fraction` and `peak_fraction_cpu` divide them by the matmul probe's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from fusedpc.training._host_memory import (
    HOST_MEMORY_MODES,
    gpt_step_temporaries,
    host_memory_choice,
    host_memory_env,
    host_memory_reused,
    wants_host_memory_reuse,
)

VARIANTS = ("fused", "fused_run", "unfused", "backprop")
UNROLLED_VARIANTS = ("fused_unrolled", "fused_run_unrolled")
SCANNED_VARIANTS = ("fused_scan", "fused_run_scan")
SWEEP_VARIANTS = ("fused_scan", "fused_unrolled")
PROBES = ("peak", "donation")
OPTIMISERS = ("adam", "adamw", "sgd")


# --------------------------------------------------------------------------- arguments
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or a comma-separated list of integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _variant_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    allowed = VARIANTS + UNROLLED_VARIANTS + SCANNED_VARIANTS + PROBES
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown or values}; choose from {', '.join(allowed)}"
        )
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusedpc bench",
        description="Benchmark a GPT part tree: fused step, fused run (K steps per call), "
        "unfused (one jit per part) and the backprop twin, side by side. Prints one JSON "
        "object per line.",
    )
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size (default 65)")
    p.add_argument("--width", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument(
        "--blocks", type=_int_list, default=[2],
        help="blocks; a comma-separated list (1,2,4,8,16) runs the depth sweep (default 2)",
    )
    p.add_argument("--ff-width", type=int, default=None, help="feed-forward width (4 x width)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (>= 1)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    p.add_argument(
        "--learning", choices=("all", "ff_head", "none"), default="all",
        help="which slots learn (default all)",
    )
    p.add_argument("--k", type=int, default=10, help="steps per `run` call (default 10)")
    p.add_argument("--optimiser", choices=OPTIMISERS, default="adam", help="optax optimiser")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--variants", type=_variant_list, default=None,
        help="comma-separated variants: fused,fused_run,unfused,backprop (the default), "
        "fused_scan,fused_run_scan (blocks always scanned), fused_unrolled,fused_run_unrolled "
        "(blocks a tuple, unrolled); fused and fused_run use build_gpt's scan='auto' (the "
        "sweep's default is fused_scan,fused_unrolled); the probes peak and "
        "donation may be named too (--variants donation runs the donation probe alone)",
    )
    p.add_argument(
        "--nonfinite", choices=("skip", "raise", "ignore"), default="skip",
        help="FusedPipeline's non-finite policy for the fused variants and the donation probe "
        "(default skip; ignore measures the step without its guard)",
    )
    p.add_argument(
        "--profile", action="store_true",
        help="trace 3 more calls per variant with jax.profiler and add the compiled program's "
        "time per kind of kernel (ms per call, summed over threads) to its row",
    )
    p.add_argument("--compare", action="store_true", help="add ratios to backprop at the end")
    p.add_argument("--peak", action="store_true", help="run the matmul peak probe first")
    p.add_argument(
        "--peak-sizes", type=_int_list, default=[1024, 2048],
        help="matrix sizes n for the n x n x n float32 peak probe (best is reported)",
    )
    p.add_argument(
        "--no-donate-probe", action="store_true",
        help="skip the donation probe (compiled memory with and without donation)",
    )
    p.add_argument(
        "--devices", type=int, default=1,
        help="emulated CPU devices (sets XLA_FLAGS before jax starts); batch sharded over them",
    )
    p.add_argument(
        "--in-process", action="store_true",
        help="run every measurement in this process (peak_mb is then an RSS growth)",
    )
    p.add_argument(
        "--interleave", action="store_true",
        help="build every variant in this process and time their calls in turn (one call of "
        "each per round): fairer ratios on a shared machine; peak_mb is then an RSS growth",
    )
    p.add_argument(
        "--host-memory", choices=HOST_MEMORY_MODES, default="auto",
        help="host allocator of every measuring process, as `fusedpc train --host-memory`: "
        "reuse (fusedpc.training.reuse_host_memory(): freed host memory kept for the next step "
        "instead "
        "of unmapped and faulted in again), system (the C library's defaults) or auto (reuse "
        "when the step's estimated temporaries reach 128 MiB; the default)",
    )
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of weights and batches")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("vocab", "width", "heads", "seq", "batch", "steps", "k", "devices"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.width % args.heads:
        p.error(f"--heads {args.heads} must divide --width {args.width}")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must divide over --devices {args.devices}")
    if args.ff_width is None:
        args.ff_width = 4 * args.width
    sweep = len(args.blocks) > 1
    if args.variants is None:
        args.variants = list(SWEEP_VARIANTS if sweep else VARIANTS)


def _config(args: argparse.Namespace, blocks: int) -> dict[str, Any]:
    return {
        "vocab": args.vocab,
        "width": args.width,
        "heads": args.heads,
        "blocks": blocks,
        "ff_width": args.ff_width,
        "seq": args.seq,
        "batch": args.batch,
        "learning": args.learning,
        "optimiser": args.optimiser,
        "lr": args.lr,
        "nonfinite": args.nonfinite,
        "steps": args.steps,
        "devices": args.devices,
    }


# --------------------------------------------------------------------------- measurement
def _maxrss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024.0 if sys.platform != "darwin" else rss / (1024.0 * 1024.0)


def _device_info() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    return {
        "device": str(getattr(device, "device_kind", device.platform)),
        "platform": device.platform,
        "n_devices": jax.device_count(),
        "jax": jax.__version__,
        # what would make compile times incomparable: optimisation flags, a warm disk cache
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compilation_cache": bool(jax.config.jax_compilation_cache_dir),
        "host_memory_reused": host_memory_reused(),
    }


def _device_peak_mb() -> float | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / 2**20


def _optimiser(args: argparse.Namespace):
    import optax

    return {"adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd}[args.optimiser](args.lr)


class _Setup:
    """The GPT config, optimiser, mesh and device-resident batches shared by a variant."""

    def __init__(self, args: argparse.Namespace, blocks: int):
        import jax
        import jax.numpy as jnp

        import fusedpc

        self.args = args
        self.blocks = blocks
        self.optimiser = _optimiser(args)
        self.mesh = None
        if args.devices > 1:
            if jax.device_count() < args.devices:
                raise RuntimeError(
                    f"--devices {args.devices}: jax sees {jax.device_count()} devices; jax "
                    "started before XLA_FLAGS was set. Run the bench in a fresh process."
                )
            self.mesh = jax.sharding.Mesh(jax.devices()[: args.devices], ("data",))

        def cfg(scan: bool) -> Any:
            return fusedpc.GPTConfig(
                vocab_size=args.vocab, width=args.width, n_heads=args.heads, n_blocks=blocks,
                ff_width=args.ff_width, max_len=args.seq, learn=args.learning, scan=scan,
            )

        self.make_config = cfg
        key = jax.random.key(args.seed)
        self.model_key, data_key = jax.random.split(key)
        k_ids, k_targets = jax.random.split(data_key)
        shape = (4, args.batch, args.seq)
        self.ids = jax.random.randint(k_ids, shape, 0, args.vocab, dtype=jnp.int32)
        self.targets = jax.random.randint(k_targets, shape, 0, args.vocab, dtype=jnp.int32)
        # Sliced and placed once: a call's timing holds the step, not the batch's preparation.
        self.batches = [
            (self.shard(self.ids[j]), self.shard(self.targets[j])) for j in range(shape[0])
        ]
        run_shape = (args.k, args.batch, args.seq)
        self.run_ids = jax.random.randint(k_ids, run_shape, 0, args.vocab, dtype=jnp.int32)
        self.run_targets = jax.random.randint(
            k_targets, run_shape, 0, args.vocab, dtype=jnp.int32
        )

    def build(self, scan: bool):
        import fusedpc

        config = self.make_config(scan)
        part, reference = fusedpc.build_gpt(config, self.optimiser, self.model_key)
        return config, part, reference

    def shard(self, x, axis: int = 0):
        """Place a batch with its batch axis over the mesh's 'data' axis (no mesh: as is)."""
        if self.mesh is None:
            return x
        import jax

        spec = [None] * x.ndim
        spec[axis] = "data"
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
        return jax.device_put(x, sharding)

    def batch(self, i: int):
        return self.batches[i % len(self.batches)]


def _time_calls(call, warmup: int, steps: int) -> dict[str, Any]:
    """Time `call(i)` (blocking on its results): the first call, `warmup` untimed calls, then
    `steps` timed calls. Wall-clock and process CPU time (all threads) are both recorded: on a
    shared machine the CPU time is the steadier figure."""
    import jax

    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(call(0))
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    for i in range(warmup):
        jax.block_until_ready(call(1 + i))
    times, cpu = [], []
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(call(1 + warmup + i))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    user, system = usage1.ru_utime - usage0.ru_utime, usage1.ru_stime - usage0.ru_stime
    return {
        "first": first,
        "first_cpu": first_cpu,
        "times": times,
        "cpu": cpu,
        "sys_fraction": system / max(user + system, 1e-12),
        "page_faults": (usage1.ru_minflt - usage0.ru_minflt) / steps,
    }


def _profile(call, start: int, calls: int = 3) -> list[list]:
    """Trace `calls` calls with `jax.profiler`; the XLA kernels' time by kind (the fusion's
    name without its numeric suffix), ms per call summed over the runtime's threads."""
    import collections
    import glob
    import re
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as where:
        jax.profiler.start_trace(where)
        for i in range(calls):
            jax.block_until_ready(call(start + i))
        jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return []
        data = jax.profiler.ProfileData.from_file(files[-1])
    totals: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name == "python":
                continue  # the host (dispatch) thread
            for event in line.events:
                if event.name.startswith(("ThunkExecutor", "SlinkyThreadPool", "PjRt")):
                    continue  # containers and waits, not kernels
                totals[re.sub(r"\.\d+$", "", event.name)] += event.duration_ns
    return [[name, ns / 1e6 / calls] for name, ns in totals.most_common(15)]


def _quartiles(times: list[float]) -> tuple[float, float, float]:
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[0], statistics.median(times), q[2]


def _variant_scan(variant: str) -> bool | str:
    """The `GPTConfig.scan` a fused variant is built with."""
    if variant in SCANNED_VARIANTS:
        return True
    if variant in UNROLLED_VARIANTS:
        return False
    return "auto"


def _step_temporaries(args: argparse.Namespace) -> int:
    """`gpt_step_temporaries` of the deepest config measured (all depths share the choice)."""
    return gpt_step_temporaries(
        batch=args.batch, seq=args.seq, width=args.width, heads=args.heads,
        blocks=max(args.blocks), ff_width=args.ff_width,
    )


def _reuse_host_memory(args: argparse.Namespace) -> bool:
    """Whether `--host-memory` asks the measuring processes to reuse host memory."""
    return wants_host_memory_reuse(args.host_memory, _step_temporaries(args))


def _blocks_form(variant: str, blocks: int) -> str:
    """How a fused variant runs its blocks: "scanned", "unrolled" (an unrolled `Repeat`,
    what `scan="auto"` gives for few blocks) or "tuple" (`scan=False`)."""
    from fusedpc.transformer._build import blocks_form

    return blocks_form(_variant_scan(variant), blocks)


def _prepare_variant(args: argparse.Namespace, variant: str, blocks: int):
    """Build one variant; returns `(call, steps_per_call)` with `call(i)` running one call on
    batch `i` and returning what to block on."""
    import equinox as eqx
    import jax

    import fusedpc
    from fusedpc.execution._unfused import UnfusedPipeline
    from fusedpc.transformer.reference import make_backprop_step

    setup = _Setup(args, blocks)
    if variant in ("fused", "fused_run", *SCANNED_VARIANTS, *UNROLLED_VARIANTS):
        config, part, _ = setup.build(scan=_variant_scan(variant))
        pipeline = fusedpc.FusedPipeline(
            part, config.error_fn, mesh=setup.mesh, nonfinite=args.nonfinite
        )
        if variant in ("fused_run", "fused_run_scan", "fused_run_unrolled"):

            def run_call(i):
                pipeline.run(setup.run_ids, setup.run_targets, keep_outputs=False)
                return pipeline.state, pipeline.last_metrics.loss

            return run_call, args.k

        def step_call(i):
            y, e = pipeline.step(*setup.batch(i))
            return y, e, pipeline.state

        return step_call, 1

    if variant == "unfused":
        config, part, _ = setup.build(scan=False)
        plain = UnfusedPipeline(part, config.error_fn, mesh=setup.mesh)

        def unfused_call(i):
            y, e = plain.step(*setup.batch(i))
            return y, e, plain.state

        return unfused_call, 1

    if variant == "backprop":
        _, _, reference = setup.build(scan=True)
        step = make_backprop_step(setup.optimiser)
        holder = {"model": reference, "opt": None}
        if setup.mesh is not None:
            replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
            holder["model"] = jax.device_put(holder["model"], replicated)
        holder["opt"] = setup.optimiser.init(eqx.filter(holder["model"], eqx.is_array))

        def backprop_call(i):
            model, opt, loss = step(holder["model"], holder["opt"], *setup.batch(i))
            holder["model"], holder["opt"] = model, opt
            return model, loss

        return backprop_call, 1
    raise ValueError(f"unknown variant {variant!r}")


def _timed_calls(args: argparse.Namespace, steps_per_call: int) -> int:
    if steps_per_call == 1:
        return args.steps
    return max(math.ceil(args.steps / steps_per_call), 5)


def _variant_row(
    args: argparse.Namespace,
    variant: str,
    blocks: int,
    timing: dict[str, Any],
    steps_per_call: int,
    rss: tuple[float, float],
    profile: list | None,
) -> dict[str, Any]:
    from fusedpc.transformer.reference import count_flops

    p25, median, p75 = (t / steps_per_call for t in _quartiles(timing["times"]))
    cpu = statistics.median(timing["cpu"]) / steps_per_call
    flops = count_flops(
        args.vocab, args.width, args.heads, blocks, args.ff_width, args.seq, args.batch
    )
    tokens = args.batch * args.seq
    note = {}
    if variant == "backprop" and args.learning != "all":
        note = {"note": "the backprop twin trains every weight, whatever --learning says"}
    row = {
        "variant": variant,
        "step_ms": median * 1e3,
        "step_ms_p25": p25 * 1e3,
        "step_ms_p75": p75 * 1e3,
        "tokens_per_s": tokens / median,
        "compile_s": timing["first"],
        "first_call_s": timing["first"],
        "compile_only_s": max(timing["first"] - median * steps_per_call, 0.0),
        "compile_cpu_s": timing["first_cpu"],
        "step_cpu_ms": cpu * 1e3,
        "sys_fraction": timing["sys_fraction"],
        "page_faults_per_call": timing["page_faults"],
        "load_avg_1m": os.getloadavg()[0],
        "peak_mb": rss[1],
        "rss_growth_mb": rss[1] - rss[0],
        "device_peak_mb": _device_peak_mb(),
        "gflops": flops / median / 1e9,
        "gflops_cpu": flops / cpu / 1e9,
        "flops_per_step": flops,
        "timed_steps": len(timing["times"]) * steps_per_call,
        "steps_per_call": steps_per_call,
        **({"blocks_form": _blocks_form(variant, blocks)} if variant.startswith("fused") else {}),
        **_device_info(),
        **_config(args, blocks),
        **note,
    }
    if profile is not None:
        row["profile_ms_per_call"] = profile
    return row


def _measure_variant(args: argparse.Namespace, variant: str, blocks: int) -> dict[str, Any]:
    """Build, warm and time one variant in this process; returns its JSON row."""
    rss_before = _maxrss_mb()
    call, steps_per_call = _prepare_variant(args, variant, blocks)
    calls = _timed_calls(args, steps_per_call)
    timing = _time_calls(call, args.warmup, calls)
    profile = _profile(call, 1 + args.warmup + calls) if args.profile else None
    rss = (rss_before, _maxrss_mb())
    return _variant_row(args, variant, blocks, timing, steps_per_call, rss, profile)


def _measure_interleaved(
    args: argparse.Namespace, variants: list[str], blocks: int
) -> list[dict[str, Any]]:
    """All variants in this process, their timed calls taken in turn (one call of each per
    round), so that a load that comes and goes on a shared machine hits them alike.

    Each variant is built and its first call (compilation) timed on its own first; `peak_mb`
    is the growth of the maximum RSS over that phase."""
    import jax

    prepared, firsts, rss = {}, {}, {}
    for variant in variants:
        before = _maxrss_mb()
        call, steps_per_call = _prepare_variant(args, variant, blocks)
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(call(0))
        firsts[variant] = (time.perf_counter() - t0, time.process_time() - c0)
        for i in range(args.warmup):
            jax.block_until_ready(call(1 + i))
        prepared[variant] = (call, steps_per_call)
        rss[variant] = (before, _maxrss_mb())
    rounds = max(_timed_calls(args, spc) for _, spc in prepared.values())
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    for r in range(rounds):
        for variant, (call, steps_per_call) in prepared.items():
            if r >= _timed_calls(args, steps_per_call):
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(call(1 + args.warmup + r))
            times[variant].append(time.perf_counter() - t0)
            cpu[variant].append(time.process_time() - c0)
    rows = []
    for variant, (call, steps_per_call) in prepared.items():
        timing = {
            "first": firsts[variant][0],
            "first_cpu": firsts[variant][1],
            "times": times[variant],
            "cpu": cpu[variant],
            "sys_fraction": None,
            "page_faults": None,
        }
        profile = None
        if args.profile:
            profile = _profile(call, 1 + args.warmup + rounds)
        growth = rss[variant][1] - rss[variant][0]
        row = _variant_row(
            args, variant, blocks, timing, steps_per_call, (0.0, growth), profile
        )
        row["peak_method"] = "rss_growth_interleaved"
        rows.append(row)
    return rows


def _memory_stats(compiled) -> dict[str, float] | None:
    """A compiled program's memory: `total_mb` = arguments + outputs + temporaries - aliased
    (what one call allocates), and XLA's own liveness-based `xla_peak_mb` where reported."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    fields = ("argument", "output", "alias", "temp")
    out = {f"{f}_mb": getattr(stats, f"{f}_size_in_bytes") / 2**20 for f in fields}
    out["total_mb"] = out["argument_mb"] + out["output_mb"] + out["temp_mb"] - out["alias_mb"]
    peak = getattr(stats, "peak_memory_in_bytes", None)
    out["xla_peak_mb"] = None if peak is None else peak / 2**20
    return out


def _measure_donation(args: argparse.Namespace, blocks: int) -> dict[str, Any]:
    """Compiled memory of the fused step with the state donated and without."""
    import jax

    import fusedpc

    setup = _Setup(args, blocks)
    config, part, _ = setup.build(scan="auto")  # as `fused`
    pipeline = fusedpc.FusedPipeline(
        part, config.error_fn, mesh=setup.mesh, nonfinite=args.nonfinite
    )
    ids, targets = setup.batch(0)
    carry = (pipeline.state, pipeline._counters)
    donated = pipeline._step_jit.lower(carry, ids, targets).compile()
    kept = jax.jit(pipeline._step_program).lower(carry, ids, targets).compile()
    with_donation, without = _memory_stats(donated), _memory_stats(kept)
    state_mb = sum(
        leaf.nbytes for leaf in jax.tree_util.tree_leaves(pipeline.state)
        if hasattr(leaf, "nbytes")
    ) / 2**20
    row = {
        "variant": "donation",
        "state_mb": state_mb,
        "donated": with_donation,
        "not_donated": without,
        "donated_peak_mb": None if with_donation is None else with_donation["total_mb"],
        "not_donated_peak_mb": None if without is None else without["total_mb"],
        "blocks_form": _blocks_form("fused", blocks),
        **_device_info(),
        **_config(args, blocks),
    }
    return row


def _measure_peak(args: argparse.Namespace) -> dict[str, Any]:
    """The best float32 matmul rate over `--peak-sizes` (median of several repetitions)."""
    import jax
    import jax.numpy as jnp

    results, results_cpu = {}, {}
    for n in args.peak_sizes:
        a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
        matmul = jax.jit(jnp.matmul)
        jax.block_until_ready(matmul(a, b))
        reps = max(3, min(20, int(2e10 / (2 * n**3))))
        times, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(matmul(a, b))
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        results[str(n)] = 2 * n**3 / statistics.median(times) / 1e9
        results_cpu[str(n)] = 2 * n**3 / statistics.median(cpu) / 1e9
    best = max(results, key=results.get)
    return {
        "variant": "peak",
        "peak_gflops": results[best],
        "peak_gflops_cpu": max(results_cpu.values()),
        "peak_size": int(best),
        "by_size_gflops": results,
        "by_size_gflops_cpu": results_cpu,
        "load_avg_1m": os.getloadavg()[0],
        **_device_info(),
    }


def run_task(args: argparse.Namespace, task: str, blocks: int) -> dict[str, Any]:
    """One measurement in this process: a variant, `peak` or `donation`."""
    if task == "peak":
        return _measure_peak(args)
    if task == "donation":
        return _measure_donation(args, blocks)
    return _measure_variant(args, task, blocks)


# --------------------------------------------------------------------------- orchestration
def _worker_argv(args: argparse.Namespace, task: str, blocks: int) -> list[str]:
    argv = [
        "--vocab", str(args.vocab), "--width", str(args.width), "--heads", str(args.heads),
        "--blocks", str(blocks), "--ff-width", str(args.ff_width), "--seq", str(args.seq),
        "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--learning", args.learning, "--k", str(args.k), "--optimiser", args.optimiser,
        "--lr", repr(args.lr), "--devices", str(args.devices), "--seed", str(args.seed),
        "--peak-sizes", ",".join(str(n) for n in args.peak_sizes),
        "--nonfinite", args.nonfinite, "--worker", task,
    ]
    if args.profile:
        argv.append("--profile")
    argv += ["--host-memory", args.host_memory]
    return argv


def _in_subprocess(args: argparse.Namespace, task: str, blocks: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "fusedpc.bench", *_worker_argv(args, task, blocks)]
    env = _with_device_flags(dict(os.environ), args.devices)  # this process's env untouched
    if _reuse_host_memory(args):
        env.update(host_memory_env())  # read by glibc when the worker starts: see _host_memory
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(
            f"bench worker for {task!r} (blocks={blocks}) failed with exit code "
            f"{done.returncode}:\n{done.stderr[-4000:]}"
        )
    return json.loads(rows[-1])


def _with_device_flags(env: dict[str, str], n: int) -> dict[str, str]:
    """`env` with `XLA_FLAGS` asking for `n` host-platform devices (unchanged for n = 1)."""
    if n <= 1:
        return env
    flags = [
        f for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return {**env, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])}


def _emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _compare_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
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


def _sweep_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    out: dict[str, Any] = {"variant": "sweep_summary"}
    for variant in SWEEP_VARIANTS:
        mine = sorted((r for r in rows if r.get("variant") == variant), key=lambda r: r["blocks"])
        if len(mine) < 2:
            continue
        lo, hi = mine[0], mine[-1]
        out[variant] = {
            "blocks": [lo["blocks"], hi["blocks"]],
            "compile_ratio": hi["compile_s"] / lo["compile_s"],
            "compile_only_ratio": hi["compile_only_s"] / max(lo["compile_only_s"], 1e-9),
            "step_ratio": hi["step_ms"] / lo["step_ms"],
        }
    return out if len(out) > 1 else None


def _table(rows: list[dict[str, Any]], compare: dict[str, Any] | None) -> str:
    ratios = (compare or {}).get("ratio_to_backprop", {})
    head = (
        f"{'variant':<15}{'blocks':>7}{'step ms':>10}{'cpu ms':>9}{'tokens/s':>11}{'compile s':>11}"
        f"{'peak MB':>9}{'GFLOP/s':>9}{'ratio':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "step_ms" not in r:
            continue
        ratio = ratios.get(r["variant"])
        lines.append(
            f"{r['variant']:<15}{r['blocks']:>7}{r['step_ms']:>10.2f}{r['step_cpu_ms']:>9.2f}"
            f"{r['tokens_per_s']:>11.0f}"
            f"{r['compile_s']:>11.2f}{r['peak_mb']:>9.0f}{r['gflops']:>9.2f}"
            f"{'' if ratio is None else format(ratio, '.2f'):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the measurements, print one JSON object per line. Returns 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.worker is not None or args.in_process or args.interleave:
        if args.worker is None:  # a worker has its allocator from its environment
            host_memory_choice(args.host_memory, _step_temporaries(args))
        # jax runs here: ask for the devices before it starts its backend (a worker is a
        # fresh process that inherited the flag already; in-process it may be too late, and
        # `_Setup` says so)
        os.environ.update(_with_device_flags(dict(os.environ), args.devices))

    if args.worker is not None:
        _emit(run_task(args, args.worker, args.blocks[0]))
        return 0

    sweep = len(args.blocks) > 1
    tasks: list[tuple[str, int]] = []
    if args.peak or "peak" in args.variants:
        tasks.append(("peak", args.blocks[0]))
    for blocks in args.blocks:
        for variant in args.variants:
            if variant not in PROBES:
                tasks.append((variant, blocks))
    if "donation" in args.variants or (not sweep and not args.no_donate_probe):
        tasks.append(("donation", args.blocks[0]))

    rows: list[dict[str, Any]] = []
    peak = None
    if args.interleave:  # the measured variants of each depth at once, in this process
        grouped: list[tuple[str, int]] = []
        for task, blocks in tasks:
            if task in PROBES:
                grouped.append((task, blocks))
            elif not any(t == "*" and b == blocks for t, b in grouped):
                grouped.append(("*", blocks))
        tasks = grouped
    for task, blocks in tasks:
        if task == "*":
            measured = [v for v in args.variants if v not in PROBES]
            for row in _measure_interleaved(args, measured, blocks):
                if peak is not None:
                    row["peak_fraction"] = row["gflops"] / peak["peak_gflops"]
                    row["peak_fraction_cpu"] = row["gflops_cpu"] / peak["peak_gflops_cpu"]
                rows.append(row)
                _emit(row)
            continue
        if args.in_process or args.interleave:
            row = run_task(args, task, blocks)
        else:
            row = _in_subprocess(args, task, blocks)
        if (args.in_process or args.interleave) and "rss_growth_mb" in row:
            row["peak_mb"] = row["rss_growth_mb"]
            row["peak_method"] = "rss_growth_in_process"
        elif "peak_mb" in row:
            row["peak_method"] = "rss_max_subprocess"
        if task == "peak":
            peak = row
        elif peak is not None and "gflops" in row:
            row["peak_fraction"] = row["gflops"] / peak["peak_gflops"]
            row["peak_fraction_cpu"] = row["gflops_cpu"] / peak["peak_gflops_cpu"]
        rows.append(row)
        _emit(row)

    compare = _compare_row(rows) if args.compare and not sweep else None
    if compare is not None:
        _emit(compare)
    if sweep:
        summary = _sweep_row(rows)
        if summary is not None:
            _emit(summary)
    if args.compare or sweep:
        print(_table(rows, compare), file=sys.stderr)
    return 0

