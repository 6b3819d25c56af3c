"""Running one measurement, here or in a fresh measuring process.

A worker is `python -m fusedpc.bench --worker`, its environment this process's plus the
device count (`JAX_NUM_CPU_DEVICES`) and the host allocator's settings (read by glibc and XLA
when the process starts); it reads one request from stdin, the parent's whole `BenchArgs`
with the task and depth to measure (`worker_request`), and prints the measured row as one
JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from fusedpc.bench._args import BenchArgs

# The estimate of a step's temporaries and the `--host-memory` decision `fusedpc train` makes.
from fusedpc.training import gpt_step_temporaries, wants_host_memory_reuse


def run_task(args: BenchArgs, task: str, n_blocks: int) -> dict[str, Any]:
    """One measurement in this process.

    Args:
        args: the bench's settings.
        task: a variant's name, `"peak"` or `"donation"`.
        n_blocks: the number of GPT blocks.

    Returns:
        The measurement's JSON row.
    """
    from fusedpc.bench._measure import measure_variant
    from fusedpc.bench._probes import measure_donation, measure_peak

    if task == "peak":
        return measure_peak(args)
    if task == "donation":
        return measure_donation(args, n_blocks)
    return measure_variant(args, task, n_blocks)


def step_temporaries(args: BenchArgs) -> int:
    """`gpt_step_temporaries` of the deepest config measured (all depths share the choice)."""
    return gpt_step_temporaries(
        batch=args.batch, seq=args.max_len, width=args.width, heads=args.n_heads,
        blocks=max(args.n_blocks), ff_width=args.ff_width,
    )


def wants_reuse(args: BenchArgs) -> bool:
    """Whether `--host-memory` asks the measuring processes to reuse host memory."""
    return wants_host_memory_reuse(args.host_memory, step_temporaries(args))


def with_device_flags(env: dict[str, str], n: int) -> dict[str, str]:
    """`env` asking for `n` CPU devices (`JAX_NUM_CPU_DEVICES`, the environment form of
    `jax.config.update("jax_num_cpu_devices", n)` that `fusedpc.training.emulate_cpu_devices`
    uses; unchanged for n = 1)."""
    if n <= 1:
        return env
    return {**env, "JAX_NUM_CPU_DEVICES": str(n)}


def worker_request(args: BenchArgs, task: str, n_blocks: int) -> str:
    """The JSON a worker reads from stdin: the settings whole, the task and the depth."""
    return json.dumps({"task": task, "n_blocks": n_blocks, "args": json.loads(args.to_json())})


def read_worker_request(text: str) -> tuple[BenchArgs, str, int]:
    """`(args, task, n_blocks)` from `worker_request`'s JSON; `args` equals the parent's."""
    request = json.loads(text)
    return BenchArgs.from_json(json.dumps(request["args"])), request["task"], request["n_blocks"]


def in_subprocess(args: BenchArgs, task: str, n_blocks: int) -> dict[str, Any]:
    """One measurement in a fresh worker process.

    Args:
        args: the bench's settings, handed to the worker whole.
        task: a variant's name, `"peak"` or `"donation"`.
        n_blocks: the number of GPT blocks.

    Returns:
        The row the worker printed.

    Raises:
        RuntimeError: when the worker fails or prints no row; the message ends with its
            stderr.
    """
    command = [sys.executable, "-m", "fusedpc.bench", "--worker"]
    env = with_device_flags(dict(os.environ), args.devices)  # this process's env untouched
    if wants_reuse(args):
        from fusedpc.training import host_memory_env

        env.update(host_memory_env())  # read by glibc when the worker starts
    # progress on stderr, so that a run cut short says which worker it was waiting for
    print(f"bench: {task} (n_blocks={n_blocks}): a fresh worker process", file=sys.stderr,
          flush=True)
    began = time.perf_counter()
    done = subprocess.run(
        command, input=worker_request(args, task, n_blocks), capture_output=True, text=True,
        env=env,
    )
    print(f"bench: {task} (n_blocks={n_blocks}): done in {time.perf_counter() - began:.1f} s",
          file=sys.stderr, flush=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(
            f"bench worker for {task!r} (n_blocks={n_blocks}) failed with exit code "
            f"{done.returncode}:\n{done.stderr[-4000:]}"
        )
    return json.loads(rows[-1])


def emit(row: dict[str, Any]) -> None:
    """Print `row` as one JSON line, flushed."""
    print(json.dumps(row), flush=True)


def worker_main(stdin=None) -> int:
    """A worker's body: read the request, measure, print the row as one JSON line.

    Args:
        stdin: where the request (`worker_request`'s JSON) is read from; `sys.stdin` if
            `None`.

    Returns:
        0.
    """
    args, task, n_blocks = read_worker_request((stdin or sys.stdin).read())
    # jax starts here; the device count came with the environment, it is set again for a
    # worker started by hand
    if args.devices > 1:
        from fusedpc.training import emulate_cpu_devices

        emulate_cpu_devices(args.devices)
    emit(run_task(args, task, n_blocks))
    return 0
