"""Benchmarks of a GPT part tree, side by side in one run; one JSON object per line.

Variants (each measured on the same config, weights and batches):

* `fused`: `FusedPipeline.step`, the whole training step as one compiled program;
* `fused_run`: `FusedPipeline.run` with `--k` steps per call (a `lax.scan`), per-step time;
* `unfused`: the same tree with one jit per leaf part, the composites walked in Python
  (`fusedpc.execution.UnfusedPipeline`), so errors pass between parts through the host
  dispatch loop;
* `backprop`: the reference equinox GPT trained by `jax.value_and_grad` and the same optax
  optimiser, state donated (`fusedpc.transformer.reference.make_backprop_step`);
* `fused_scan`, `fused_run_scan`: `fused` and `fused_run` with the blocks always scanned
  (`GPTConfig(scan=True)`); `fused_unrolled`, `fused_run_unrolled`: with the blocks as a
  tuple, unrolled (`GPTConfig(scan=False)`). `fused` and `fused_run` use `build_gpt`'s
  default, `scan="auto"` (a `Repeat` unrolled up to `fusedpc.transformer.AUTO_UNROLL_BLOCKS`
  blocks, scanned beyond).

`--n-blocks 1,2,4,8,16` runs a depth sweep instead: `fused_scan` (blocks in a `Repeat`, one
scanned block) and `fused_unrolled` (blocks unrolled in Python) at each depth. `--peak` adds
a float32 matmul probe (the machine's reachable GFLOP/s) and a `peak_fraction` per row. The
donation probe compares the compiled memory of the fused step with and without its state
donated (`Compiled.memory_analysis()`).

The settings are one frozen `BenchArgs`, parsed once (`parse_args`). Every measurement runs
in its own subprocess by default, a worker handed the parent's whole `BenchArgs` as JSON on
stdin, so the peak host RSS (`ru_maxrss`, which only ever grows within a process) belongs to
one variant alone; `--in-process` runs them all in this process (faster; `peak_mb` is then
the growth of the maximum RSS during the variant, a lower bound). `--interleave` builds
every variant in this process and times their calls in turn, one call of each per round, so
that a machine shared with other jobs slows them alike (the fairest ratios on such a
machine).

The modules import jax only inside functions, so `--devices N` can set
`JAX_NUM_CPU_DEVICES=N` before jax starts its backend (importing the `fusedpc` package
imports jax but starts no backend; the workers are fresh processes that inherit it).

Timing: the first call (tracing, compiling, one execution) is `first_call_s`; `compile_s`
is the same figure (the time a user waits before the first step returns; in a worker, a
fresh process) and `compile_only_s` subtracts one steady step. Then `--warmup` untimed
calls, then `--steps` timed calls, each ended by `jax.block_until_ready` on the outputs and
the new state; `step_ms` is the median (`step_ms_p25`/`p75` the quartiles) and
`step_cpu_ms` the median process CPU time (every thread; on a machine shared with other
jobs the steadier figure), with `sys_fraction` the share of it spent in the kernel and
`page_faults_per_call` the minor page faults per call (fresh temporary buffers being
mapped). `gflops` divides the analytic FLOP count of one backprop step
(`fusedpc.transformer.reference.count_flops`: matrix products only) by the median step
time, `gflops_cpu` by the median CPU time (FLOPs per core-second); with `--peak`,
`peak_fraction` and `peak_fraction_cpu` divide them by the matmul probe's figures.
"""

from fusedpc.bench._args import ALL_VARIANTS as ALL_VARIANTS
from fusedpc.bench._args import PROBES as PROBES
from fusedpc.bench._args import SCANNED_VARIANTS as SCANNED_VARIANTS
from fusedpc.bench._args import SWEEP_VARIANTS as SWEEP_VARIANTS
from fusedpc.bench._args import UNROLLED_VARIANTS as UNROLLED_VARIANTS
from fusedpc.bench._args import VARIANTS as VARIANTS
from fusedpc.bench._args import BenchArgs as BenchArgs
from fusedpc.bench._args import build_parser as build_parser
from fusedpc.bench._args import parse_args as parse_args
from fusedpc.bench._main import main as main
from fusedpc.bench._workers import run_task as run_task

__all__ = [
    "ALL_VARIANTS",
    "PROBES",
    "SCANNED_VARIANTS",
    "SWEEP_VARIANTS",
    "UNROLLED_VARIANTS",
    "VARIANTS",
    "BenchArgs",
    "build_parser",
    "main",
    "parse_args",
    "run_task",
]
