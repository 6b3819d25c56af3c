"""The GPU check: device facts, the float32 parity tests, and the bench at S, M and L, with
one JSON line per result on stdout. Run it through `scripts/gpu_check.sh` (which says how to
run it on a machine lent for a few minutes); what each line means is in docs/gpu.md.

    bash scripts/gpu_check.sh              # on a GPU: under 8 minutes
    bash scripts/gpu_check.sh --smoke      # anywhere: tiny configs, well under a minute

Stages, each timed, each in processes of its own (this process never starts jax, so it holds
no device memory that the measuring processes would miss):

1. `device`: what jax sees (platform, device kind, versions). Without a GPU the check stops
   here with one line on stderr and exit status 2, unless `--smoke` or `--allow-cpu`.
2. `parity`: the tests whose claim is exactness against an autodiff twin, run by pytest with
   `JAX_DEFAULT_MATMUL_PRECISION=highest` (on a GPU jax multiplies float32 matrices in TF32 by
   default, which no float32 tolerance survives); the precision the tests ran under is read
   back from inside the test process (`pytest_sessionfinish` below).
3. `bench`: `scripts/bench.py` at each config, the variants each in a process of their own;
   every row becomes one line with tokens/s, compile time and the model FLOP utilisation
   (MFU) against the device's datasheet peak and against the matmul peak the bench's `--peak`
   probe measured there (a `peak` line).

A `summary` line ends the output. A stage that fails does not stop the others; it makes the
exit status 1.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench.py"
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
PRECISION_ENV = "JAX_DEFAULT_MATMUL_PRECISION"
PROBE_ENV = "FUSEDPC_GPU_CHECK_PROBE"
"""Where the test process writes the precision and device it ran under (the pytest hook)."""

CONFIGS: dict[str, dict[str, Any]] = {
    # docs/benchmarks.md's S and M; L is GPT-2 small's shape with the bench's vocabulary
    "S": {"width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "max_len": 64,
          "batch": 16, "steps": 20, "warmup": 3, "k": 10, "dtype": "float32", "cap_s": 90},
    "M": {"width": 256, "n_heads": 8, "n_blocks": 4, "ff_width": 1024, "max_len": 128,
          "batch": 32, "steps": 20, "warmup": 3, "k": 10, "dtype": "float32", "cap_s": 150},
    "L": {"width": 768, "n_heads": 12, "n_blocks": 12, "ff_width": 3072, "max_len": 1024,
          "batch": 8, "steps": 10, "warmup": 2, "k": 5, "dtype": "bfloat16", "cap_s": 150},
    # --smoke; the dtype is L's, so that the smoke takes L's path through `--dtype` too
    "tiny": {"width": 16, "n_heads": 2, "n_blocks": 1, "ff_width": 64, "max_len": 8,
             "batch": 2, "steps": 2, "warmup": 0, "k": 2, "dtype": "bfloat16", "cap_s": 100},
}
"""The bench configs (vocabulary 65, the bench's default, throughout). A `bfloat16` config
runs in bfloat16 only where the bench has a `--dtype` flag; float32 otherwise. `cap_s` is the
most one config's bench may take (`--bench-timeout` sets one cap for all): on a GPU each
variant takes a process start and a compile (S took 79 s for its three on an H200; M and L
gave no row within 115 s there, see docs/gpu.md), L the rest of the time limit."""

VARIANTS = ("fused", "fused_run", "backprop")
SMOKE_VARIANTS = ("fused", "backprop")
"""The smoke's: `fused_run` compiles a scan of K steps, the longest compile of the three."""
PEAK_SIZES = {"gpu": "4096,8192", "smoke": "64,128", "cpu": "1024,2048"}
"""The `--peak` probe's matrix sizes: an H200 needs large products to come near its peak."""

PARITY_MARKER = "gpu_parity"
PARITY_SELECTION = ("-m", PARITY_MARKER, "tests")
"""The parity claims that a backend can break, in float32, marked `gpu_parity` where they are
defined: the fused step, the hand-derived backwards and the learning rules against `jax.vjp`
or the backprop twin, and iterative inference's Z-IL step and local updates; 32 tests when
the marker was introduced (tests/bench/test_gpu_check.py checks that it selects them), about
140 s on a loaded 2-core CPU, spread over `PARITY_WORKERS` processes on a GPU where
pytest-xdist is installed. Left out: the tests of one fused form against another (scanned and
unrolled, fused and unfused), which hold on any backend where these do, and the padding test
at XLA's default optimisation level, which runs its own process on the CPU."""
PARITY_WORKERS = 6
SMOKE_PARITY_SELECTION = ("-m", PARITY_MARKER, "tests/parts/learning/test_network.py")
"""The smoke's: the one parity test of the learning network's module (its closed-form
derivatives against autodiff)."""

# Dense peak TFLOP/s by device kind (`jax.Device.device_kind`, matched whole, ignoring case):
# the vendor's datasheets, NVIDIA's "Tensor Core GPU" datasheet of each part. Those give the
# TF32 and BF16 tensor-core figures with structured sparsity; the dense figures here are half
# of them. FP32 is the plain (non-tensor-core) rate, which has no sparse figure.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"nvidia gh200.*", "GH200", {"bfloat16": 989.0, "tf32": 494.0, "float32": 67.0}),
    (r"nvidia h200( sxm.*)?", "H200 SXM", {"bfloat16": 989.0, "tf32": 494.0, "float32": 67.0}),
    (r"nvidia h100 (80gb hbm3|sxm.*)", "H100 SXM",
     {"bfloat16": 989.0, "tf32": 494.0, "float32": 67.0}),
    (r"nvidia h100 pcie", "H100 PCIe", {"bfloat16": 756.0, "tf32": 378.0, "float32": 51.0}),
    (r"nvidia a100.*", "A100", {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5}),
    (r"nvidia l40s", "L40S", {"bfloat16": 362.0, "tf32": 183.0, "float32": 91.6}),
    (r"nvidia l4", "L4", {"bfloat16": 121.0, "tf32": 60.0, "float32": 30.3}),
    (r"nvidia a10", "A10", {"bfloat16": 125.0, "tf32": 62.5, "float32": 31.2}),
)
"""`(pattern, part, {arithmetic: TFLOP/s})`; a kind not here (an NVL part, a CPU) has no
datasheet MFU unless `--peak-tflops` gives the figure."""


def datasheet_peak(device_kind: str, arithmetic: str) -> tuple[float | None, str]:
    """The dense datasheet peak of a device for one kind of arithmetic.

    Args:
        device_kind: `jax.Device.device_kind`, e.g. `"NVIDIA H200"`.
        arithmetic: `"bfloat16"`, `"tf32"` or `"float32"` (see `arithmetic`).

    Returns:
        `(tflops, source)`: the figure, or `None` for a device not in `PEAK_TFLOPS`, and
        where it comes from (or why there is none).
    """
    for pattern, part, peaks in PEAK_TFLOPS:
        if re.fullmatch(pattern, device_kind.strip(), flags=re.IGNORECASE):
            return peaks[arithmetic], f"NVIDIA {part} datasheet, {arithmetic}, dense"
    return None, f"no datasheet figure for {device_kind!r}; give one with --peak-tflops"


def arithmetic(dtype: str, platform: str, precision: str | None) -> str:
    """The arithmetic a bench row's matrix products ran in, which picks its peak.

    Args:
        dtype: the row's dtype, `"float32"` or `"bfloat16"`.
        platform: the device's platform (`"gpu"`, `"cpu"`).
        precision: `JAX_DEFAULT_MATMUL_PRECISION` in the bench's environment, if set.

    Returns:
        `"bfloat16"`; `"tf32"` for float32 on a GPU at any precision below `highest` (XLA's
        default there: TF32 tensor cores); else `"float32"`.
    """
    if dtype == "bfloat16":
        return "bfloat16"
    if platform in GPU_PLATFORMS and (precision or "default").lower() not in (
        "highest", "float32"
    ):
        return "tf32"
    return "float32"


def pytest_sessionfinish(session, exitstatus):
    """pytest hook, loaded in the parity stage's test processes (`-p gpu_check`): each process
    that runs tests writes the matmul precision and the device they ran under to
    `$FUSEDPC_GPU_CHECK_PROBE.<pid>`, after tests/conftest.py and every test had their say."""
    del exitstatus
    path = os.environ.get(PROBE_ENV)
    xdist_controller = getattr(session.config.option, "numprocesses", None) and not hasattr(
        session.config, "workerinput"
    )
    if not path or xdist_controller:
        return
    import jax

    device = jax.devices()[0]
    Path(f"{path}.{os.getpid()}").write_text(json.dumps({
        # jax.config's flags are attributes made at runtime, unknown to its type stubs
        "matmul_precision": jax.config.jax_default_matmul_precision,  # type: ignore[attr-defined]
        "platform": device.platform,
        "device_kind": device.device_kind,
    }))


_DEVICE_PROBE = """
import importlib.metadata, json, jax
devices = jax.devices()
versions = {}
for name in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "equinox", "optax"):
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
try:
    stats = devices[0].memory_stats() or {}
except Exception:
    stats = {}
print(json.dumps({
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "devices": [str(d) for d in devices],
    "n_devices": len(devices),
    "jax": jax.__version__,
    "versions": versions,
    "memory_gib": stats["bytes_limit"] / 2**30 if "bytes_limit" in stats else None,
}))
"""


class Check:
    """One run of the check: its settings, its deadline, its lines and their files.

    Args:
        options: the parsed command line (`build_parser`).
    """

    def __init__(self, options: argparse.Namespace):
        self.options = options
        self.start = time.perf_counter()
        self.deadline = self.start + options.time_limit
        self.failed: list[str] = []
        self.stages: dict[str, float] = {}
        self.device: dict[str, Any] = {}
        out = options.out
        self.out = None
        self.raw = None
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            self.out = open(out, "w")  # closed by `close`
            self.raw = Path(out).with_name(Path(out).stem + "_raw.jsonl").open("w")

    def close(self) -> None:
        for f in (self.out, self.raw):
            if f is not None:
                f.close()

    def emit(self, line: dict[str, Any]) -> None:
        """Print one JSON line, flushed, and write it to `--out`."""
        text = json.dumps(line)
        print(text, flush=True)
        if self.out is not None:
            self.out.write(text + "\n")
            self.out.flush()

    def keep_raw(self, stage: str, config: str | None, row: dict[str, Any]) -> None:
        """Write a bench row whole, beside `--out` (`<out>_raw.jsonl`)."""
        if self.raw is not None:
            self.raw.write(json.dumps({"stage": stage, "config": config, "row": row}) + "\n")
            self.raw.flush()

    def say(self, text: str) -> None:
        """Progress, on stderr."""
        print(f"gpu_check [{time.perf_counter() - self.start:6.1f} s] {text}", file=sys.stderr,
              flush=True)

    def left(self, cap: float) -> float:
        """Seconds a stage may take: `cap`, or what is left before the deadline."""
        return max(0.0, min(cap, self.deadline - time.perf_counter()))

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with the repository's `src` on `PYTHONPATH`."""
        env = dict(os.environ)
        paths = [str(ROOT / "src"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(extra)
        return env

    def finish_stage(self, name: str, began: float, ok: bool) -> float:
        wall = time.perf_counter() - began
        self.stages[name] = wall
        if not ok:
            self.failed.append(name)
        return wall


def run(
    command: list[str],
    env: dict[str, str],
    timeout: float,
    on_line: Callable[[str], None] | None = None,
) -> tuple[int | None, str, str]:
    """Run `command` in a process group of its own (the bench starts workers), killing the
    group at `timeout`.

    Args:
        command: the command line.
        env: its environment.
        timeout: seconds it may take.
        on_line: called with each line of its stdout as it comes.

    Returns:
        `(exit status, or None when it was killed at the timeout; stdout; stderr)`.
    """
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(process.stderr.read()), daemon=True)
    reader.start()
    timer = threading.Timer(max(timeout, 1.0), kill)
    timer.start()
    out = []
    try:
        for line in process.stdout:
            out.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
        process.wait()
    finally:
        timer.cancel()
        if process.poll() is None:  # on_line raised: the group goes too
            kill()
            process.wait()
        reader.join()
    return (None if killed.is_set() else process.returncode), "".join(out), "".join(err)


def tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def device_stage(check: Check) -> bool:
    """Stage 1; returns whether the check may go on (a GPU, or `--smoke` / `--allow-cpu`)."""
    began = time.perf_counter()
    env = check.env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
    code, out, err = run([sys.executable, "-c", _DEVICE_PROBE], env, check.left(120.0))
    rows = [line for line in out.splitlines() if line.startswith("{")]
    if code != 0 or not rows:
        last = tail(err, 1) or "no output"
        print(f"gpu_check: the device probe (python -c 'import jax; jax.devices()') failed "
              f"with exit status {code}: {last}", file=sys.stderr)
        return False
    facts = json.loads(rows[-1])
    gpu = facts["platform"] in GPU_PLATFORMS
    if not gpu and not (check.options.smoke or check.options.allow_cpu):
        print(f"gpu_check: no GPU: jax {facts['jax']} sees only {facts['platform']} devices "
              f"({facts['device_kind']}); install jax's CUDA plugin (see scripts/gpu_check.sh), "
              "JAX_PLATFORMS=cuda says why it fails, or pass --smoke or --allow-cpu to run on "
              "the CPU", file=sys.stderr)
        return False
    smi = None
    if gpu:
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        try:
            done = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=False,
            )
            smi = done.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            smi = None
    check.device = facts
    wall = check.finish_stage("device", began, True)
    check.emit({"stage": "device", "ok": True, "gpu": gpu, **facts, "nvidia_smi": smi,
                "python": sys.version.split()[0], "wall_s": wall})
    return True


def parity_stage(check: Check) -> None:
    """Stage 2: the parity tests, in pytest, at `highest` matmul precision."""
    began = time.perf_counter()
    options = check.options
    selection = list(SMOKE_PARITY_SELECTION if options.smoke else PARITY_SELECTION)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as where:
        probe, junit = Path(where, "probe"), Path(where, "junit.xml")
        extra = {PRECISION_ENV: "highest", PROBE_ENV: str(probe)}
        workers: list[str] = []
        if check.device.get("platform") in GPU_PLATFORMS:
            extra["FUSEDPC_TEST_FAST_COMPILE"] = "0"  # XLA's own level, as users run it
            # several test processes share the GPU: none may take 75 % of it up front
            extra["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            if importlib.util.find_spec("xdist") is not None:
                workers = ["-n", str(PARITY_WORKERS)]
        env = check.env(**extra)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "scripts"), env["PYTHONPATH"]])
        command = [
            sys.executable, "-m", "pytest", "-p", "gpu_check", "-p", "no:cacheprovider",
            "-q", "--strict-markers", f"--junitxml={junit}", *workers, *selection,
        ]
        check.say(f"parity: pytest {' '.join(selection)} (cap {options.parity_timeout:.0f} s)")
        code, out, err = run(command, env, check.left(options.parity_timeout))
        counts = junit_counts(junit) if junit.exists() else {}
        seen = [json.loads(p.read_text()) for p in Path(where).glob("probe.*")]
    if options.out:
        Path(options.out).with_name(Path(options.out).stem + "_pytest.log").write_text(out + err)
    precisions = sorted({str(p["matmul_precision"]) for p in seen})
    kinds = sorted({str(p["device_kind"]) for p in seen})
    on_gpu = check.device.get("platform") in GPU_PLATFORMS
    platforms = {str(p["platform"]) for p in seen}
    ok = (
        code == 0 and counts.get("passed", 0) > 0 and precisions == ["highest"]
        and (not on_gpu or platforms <= set(GPU_PLATFORMS))  # the tests ran on the GPU
    )
    wall = check.finish_stage("parity", began, ok)
    line = {
        "stage": "parity", "ok": ok, "exit_code": code, "timed_out": code is None,
        **{k: counts.get(k, 0) for k in ("passed", "failed", "errors", "skipped")},
        "failures": counts.get("failures", []),
        # as the test processes saw it: one value, or a list where they differed
        "matmul_precision": precisions[0] if len(precisions) == 1 else precisions or None,
        "device_kind": kinds[0] if len(kinds) == 1 else kinds or None,
        "platform": seen[0]["platform"] if seen else None,
        "test_processes": len(seen),
        "selected": " ".join(selection), "wall_s": wall,
    }
    if not ok:
        line["output_tail"] = tail(out + "\n" + err, 15)
    check.emit(line)


def junit_counts(path: Path) -> dict[str, Any]:
    """Passed, failed, errors and skipped, and the failing tests' ids, from a JUnit XML."""
    root = ElementTree.parse(path).getroot()
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failures.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failures.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["failures"] = failures
    return counts


def start_bench_help(check: Check) -> subprocess.Popen:
    """Start `scripts/bench.py --help` (read by `bench_has_dtype`; it runs beside the parity
    tests)."""
    return subprocess.Popen(
        [sys.executable, str(BENCH), "--help"], cwd=ROOT, env=check.env(),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )


def bench_has_dtype(help_process: subprocess.Popen) -> bool:
    """Whether `scripts/bench.py --help` lists `--dtype`."""
    try:
        out, _ = help_process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        help_process.kill()
        help_process.communicate()
        return False
    return help_process.returncode == 0 and re.search(r"(^|\s)--dtype\b", out) is not None


def bench_command(
    check: Check, config: dict[str, Any], dtype_flag: str | None, peak: bool
) -> list[str]:
    """The `scripts/bench.py` command line of one config."""
    options = check.options
    command = [sys.executable, str(BENCH), "--no-donate-probe", "--variants", options.variants]
    for name in ("width", "n_heads", "n_blocks", "ff_width", "max_len", "batch", "steps",
                 "warmup", "k"):
        command += [f"--{name.replace('_', '-')}", str(config[name])]
    if dtype_flag is not None:
        command += ["--dtype", dtype_flag]
    if peak:
        platform = check.device.get("platform")
        sizes = "smoke" if options.smoke else ("gpu" if platform in GPU_PLATFORMS else "cpu")
        command += ["--peak", "--peak-sizes", PEAK_SIZES[sizes]]
    if options.smoke:
        command.append("--in-process")  # one jax start for all: the smoke times nothing
    return command


def bench_line(
    check: Check, name: str, row: dict[str, Any], dtype: str, peak: dict[str, Any] | None
) -> dict[str, Any]:
    """The check's line for one bench row: throughput, compile time and the two MFUs."""
    dtype = str(row.get("dtype", dtype))
    kind = str(row.get("device", check.device.get("device_kind")))
    precision = os.environ.get(PRECISION_ENV)
    maths = arithmetic(dtype, str(row.get("platform")), precision)
    if check.options.peak_tflops is not None:
        peak_tflops, source = check.options.peak_tflops, "--peak-tflops"
    else:
        peak_tflops, source = datasheet_peak(kind, maths)
    achieved = row["gflops"] / 1e3  # model TFLOP/s: count_flops over the median step
    measured = None if peak is None else peak["peak_gflops"] / 1e3
    return {
        "stage": "bench", "ok": True, "config": name, "variant": row["variant"],
        "device_kind": kind, "dtype": dtype, "arithmetic": maths,
        "matmul_precision": precision or "default",
        "tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"],
        "model_tflops": achieved,
        "mfu": None if peak_tflops is None else achieved / peak_tflops,
        "peak_tflops": peak_tflops, "peak_source": source,
        "mfu_measured": None if measured is None else achieved / measured,
        "measured_peak_tflops": measured,
        "measured_peak_dtype": None if peak is None else str(peak.get("dtype", "float32")),
        "compile_s": row["compile_s"], "flops_per_step": row["flops_per_step"],
        "timed_steps": row["timed_steps"], "peak_mb": row.get("peak_mb"),
        "device_peak_mb": row.get("device_peak_mb"), "blocks_form": row.get("blocks_form"),
        **{k: row[k] for k in ("vocab", "width", "n_heads", "n_blocks", "ff_width", "max_len",
                               "batch")},
    }


def bench_stage(check: Check, help_process: subprocess.Popen) -> None:
    """Stage 3: the bench at each config; a `peak` line per dtype, a line per row."""
    options = check.options
    names = options.configs.split(",")
    has_dtype = bench_has_dtype(help_process)
    peaks: dict[str, dict[str, Any]] = {}
    for name in names:
        began = time.perf_counter()
        config = CONFIGS[name]
        dtype = config["dtype"] if has_dtype else "float32"
        want_peak = dtype not in peaks
        command = bench_command(check, config, dtype if has_dtype else None, want_peak)
        budget = check.left(options.bench_timeout or config["cap_s"])
        check.say(f"bench {name}: {dtype}, {options.variants} (cap {budget:.0f} s)")
        lines: list[dict[str, Any]] = []
        take = functools.partial(take_row, check, name, dtype, peaks, lines)
        if budget < 5.0:
            code, err = None, "skipped: the check's --time-limit was spent"
        else:
            code, _, err = run(command, check.env(**smoke_flags(options)), budget, take)
        measured = {line["variant"] for line in lines if line["ok"]}
        missing = [v for v in options.variants.split(",") if v not in measured]
        ok = code == 0 and not missing and all(line["ok"] for line in lines)
        wall = check.finish_stage(f"bench:{name}", began, ok)
        if not ok:
            check.emit({
                "stage": "bench", "ok": False, "config": name, "dtype": dtype,
                "exit_code": code, "timed_out": code is None, "missing": missing,
                "error": (f"timed out after {budget:.0f} s; " if code is None else "")
                + (tail(err, 8) or "no rows"), "wall_s": wall,
            })


def take_row(
    check: Check,
    name: str,
    dtype: str,
    peaks: dict[str, dict[str, Any]],
    lines: list[dict[str, Any]],
    text: str,
) -> None:
    """Turn one line of the bench's stdout into the check's line, as it comes: a `peak` line
    (and the probe kept in `peaks` under `dtype`), or a `bench` line (kept in `lines`)."""
    if not text.startswith("{"):
        return
    try:
        row = json.loads(text)
    except json.JSONDecodeError:
        return  # a line cut off by the timeout
    check.keep_raw("bench", name, row)
    if row.get("variant") == "peak":
        peaks[dtype] = row
        check.emit(peak_line(check, row))
        return
    if "step_ms" not in row:
        return
    peak = peaks.get(dtype) or peaks.get("float32")
    try:
        line = bench_line(check, name, row, dtype, peak)
        line["ok"] = all(_positive(line[k]) for k in ("tokens_per_s", "step_ms", "compile_s"))
    except (KeyError, TypeError, ZeroDivisionError) as error:
        line = {"stage": "bench", "ok": False, "config": name, "variant": row.get("variant"),
                "error": f"the bench's row has no usable {error!r}"}
    lines.append(line)
    check.emit(line)


def peak_line(check: Check, row: dict[str, Any]) -> dict[str, Any]:
    """The `peak` line: the bench's matmul probe, in TFLOP/s."""
    return {
        "stage": "peak", "ok": _positive(row.get("peak_gflops")),
        "device_kind": str(row.get("device", check.device.get("device_kind"))),
        "dtype": str(row.get("dtype", "float32")),  # the probe's own, else float32
        "matmul_precision": os.environ.get(PRECISION_ENV) or "default",
        "peak_tflops": row["peak_gflops"] / 1e3, "peak_size": row.get("peak_size"),
        "by_size_tflops": {n: g / 1e3 for n, g in row.get("by_size_gflops", {}).items()},
    }


def smoke_flags(options: argparse.Namespace) -> dict[str, str]:
    """The smoke's bench at XLA's cheapest code generation (its figures mean nothing)."""
    if not options.smoke:
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = (flags + " --xla_backend_optimization_level=0").strip()
    return {"XLA_FLAGS": flags}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def build_parser() -> argparse.ArgumentParser:
    out = os.environ.get("OUT")
    p = argparse.ArgumentParser(
        prog="gpu_check",
        description="Device facts, the float32 parity tests and the bench at S, M and L on a "
        "GPU, one JSON line per result (docs/gpu.md).",
    )
    p.add_argument("--smoke", action="store_true",
                   help="tiny config and one parity test, on any device (a test of this script)")
    p.add_argument("--allow-cpu", action="store_true", help="run the full check without a GPU")
    p.add_argument("--stages", default="parity,bench",
                   help="stages after the device facts, comma-separated (default parity,bench)")
    p.add_argument("--configs", default=None,
                   help=f"bench configs from {', '.join(CONFIGS)} (default S,M,L; smoke: tiny)")
    p.add_argument("--variants", default=None,
                   help="bench variants (default fused,fused_run,backprop; smoke: fused,backprop)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole check; stages past it are cut (default 470; "
                   "smoke 120)")
    p.add_argument("--parity-timeout", type=float, default=None,
                   help="seconds for the parity tests (default 150; smoke 60)")
    p.add_argument("--bench-timeout", type=float, default=None,
                   help="seconds for each config's bench (default S 90, M 150, L 150)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s, for a device not in the datasheet table")
    p.add_argument("--out", default=os.path.join(out, "gpu_check.jsonl") if out else None,
                   help="also write the lines here (default $OUT/gpu_check.jsonl when $OUT is "
                   "set); the bench's rows go beside it (_raw.jsonl), pytest's output too")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 0 when every stage passed, 1 when one failed, 2 without a GPU
    (or when the device probe itself fails)."""
    parser = build_parser()
    options = parser.parse_args(argv)
    options.configs = options.configs or ("tiny" if options.smoke else "S,M,L")
    options.variants = options.variants or ",".join(SMOKE_VARIANTS if options.smoke else VARIANTS)
    options.time_limit = options.time_limit or (120.0 if options.smoke else 470.0)
    options.parity_timeout = options.parity_timeout or (60.0 if options.smoke else 150.0)
    unknown = [c for c in options.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    stages = [s for s in options.stages.split(",") if s]
    if any(s not in ("parity", "bench") for s in stages):
        parser.error(f"--stages: choose from parity, bench; got {options.stages!r}")
    check = Check(options)
    try:
        if not device_stage(check):
            return 2
        help_process = start_bench_help(check) if "bench" in stages else None
        if "parity" in stages:
            parity_stage(check)
        if help_process is not None:
            bench_stage(check, help_process)
        total = time.perf_counter() - check.start
        check.emit({
            "stage": "summary", "ok": not check.failed, "failed": check.failed,
            "device_kind": check.device.get("device_kind"),
            "stages_s": check.stages, "total_s": total,
            "within_limit": total <= options.time_limit,
        })
        return 1 if check.failed else 0
    finally:
        check.close()


if __name__ == "__main__":
    sys.exit(main())
