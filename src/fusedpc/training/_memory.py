"""The memory a run needs, estimated before anything is built or compiled.

A config too large for the machine (`--width 1048576`, `--batch 1000000000`) would otherwise
end in an allocation failure deep inside XLA, minutes later. `estimate_run_memory` adds up,
from the config alone, what the run holds at its peak; `check_run_memory` refuses a run whose
estimate exceeds what the device has, with one line naming the largest part.
"""

from __future__ import annotations

import os
from typing import Any

from fusedpc.training._config import TrainConfig
from fusedpc.training._host_memory import gpt_step_temporaries
from fusedpc.training._setup import parameter_count

FLOAT_BYTES = 4
# Optimiser moments per parameter (Adam's m and v); SGD keeps none.
OPTIMISER_SLOTS = {"adam": 2, "adamw": 2, "sgd": 0}


def estimate_run_memory(
    config: TrainConfig, vocab_size: int, parameters: int | None = None
) -> dict[str, int]:
    """Bytes a run needs at its peak, by part: `state` (weights, optimiser moments and the
    commit rule's transient copy of what a step updates), `step` (one step's temporaries,
    logits included), `batches` (`steps_per_call` batches of ids and targets, and the
    validation batches) and `sample` (the final sample's buffer); `total` is their sum.

    A rough upper estimate from shapes (float32 everywhere), meant to refuse configs that
    cannot fit, not to plan a tight one. `parameters`: the model's parameter count
    (`parameter_count`), when the caller has it already."""
    m = config.model
    d, f, t, v, n = m.width, m.ff_width, m.max_len, vocab_size, m.n_blocks
    if parameters is None:
        parameters = parameter_count(config, vocab_size)
    slots = OPTIMISER_SLOTS.get(config.optimiser, 2)
    state = FLOAT_BYTES * parameters * (1 + slots) * 2  # x2: the step's new state beside it
    rows = config.batch * t
    step = gpt_step_temporaries(
        batch=config.batch, seq=t, width=d, heads=m.n_heads, blocks=n, ff_width=f
    ) + 3 * FLOAT_BYTES * rows * v
    batches = 2 * FLOAT_BYTES * rows * (config.steps_per_call + config.eval_batches)
    sample = FLOAT_BYTES * (config.sample_tokens + t) * (2 + v)
    total = state + step + batches + sample
    return {"state": state, "step": step, "batches": batches, "sample": sample, "total": total}


def available_memory() -> tuple[int | None, str]:
    """`(bytes, what)`: the first device's memory limit when JAX reports one (GPU, TPU), else
    the host memory available (`MemAvailable`, or the physical memory); None if unknown."""
    import jax

    device = jax.devices()[0]
    try:
        stats: dict[str, Any] | None = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform} device memory"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host memory"
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory"
    except (ValueError, OSError, AttributeError):
        return None, "memory"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_run_memory(
    config: TrainConfig, vocab_size: int, parameters: int | None = None
) -> dict[str, int]:
    """Refuse (a `ValueError`, one line) a run whose estimate exceeds the memory available;
    returns the estimate otherwise."""
    need = estimate_run_memory(config, vocab_size, parameters)
    have, what = available_memory()
    if have is not None and need["total"] > have:
        parts = sorted((k for k in need if k != "total"), key=need.__getitem__, reverse=True)
        listed = ", ".join(f"{k} {_gib(need[k])}" for k in parts)
        hints = {
            "state": "--width, --n-blocks, --ff-width or the vocabulary",
            "step": "--batch, --max-len or --width",
            "batches": "--steps-per-call, --eval-batches or --batch",
            "sample": "--sample-tokens",
        }
        raise ValueError(
            f"this run needs about {_gib(need['total'])} ({listed}) but the {what} is "
            f"{_gib(have)}; lower {hints[parts[0]]}."
        )
    return need


__all__ = ["available_memory", "check_run_memory", "estimate_run_memory"]
