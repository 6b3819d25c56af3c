"""`reuse_host_memory`: the allocator settings that keep freed host memory for the next call
(each case in a fresh process: the allocator is set once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fusedpc.training import host_memory_env

_PROBE = r"""
import json, resource, sys
import fusedpc
from fusedpc.training import REUSE_ABOVE_BYTES, host_memory_choice
mode, size = sys.argv[1], {"small": REUSE_ABOVE_BYTES - 1, "large": REUSE_ABOVE_BYTES}
applied = host_memory_choice(mode.split("-")[0], size.get(mode.split("-")[-1], 0))
again = fusedpc.training.reuse_host_memory() if mode == "reuse" else applied
import jax, jax.numpy as jnp
import numpy as np

@jax.jit
def big(x):  # a 64 MiB temporary, fresh every call
    return jnp.sum(jnp.sin(jnp.outer(x, x)), axis=0)

x = jnp.linspace(0.0, 1.0, 4096, dtype=jnp.float32)
first = np.asarray(big(x))
for _ in range(2):
    big(x).block_until_ready()
per_call = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big(x).block_until_ready()
    per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(per_call)[3]  # the median: an occasional heap growth does not count
reused = fusedpc.training.host_memory_reused()
print(json.dumps({"applied": applied, "again": again, "reused": reused,
                  "faults": faults, "checksum": float(np.sum(first, dtype=np.float64))}))
"""


def _probe(mode: str, env: dict | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=300,
        # without the suite's XLA_FLAGS (optimisation level 0 leaves the 64 MiB product
        # unfused: two large temporaries a call instead of one)
        env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.slow
def test_reuse_host_memory_settings_change_no_result():
    # started with the settings in its environment, as fusedpc bench starts its workers.
    # Their effect on page faults and step time is a benchmark figure (scripts/bench.py
    # reports page_faults_per_call; docs/benchmarks.md), not asserted here: how often the
    # heap must grow for a 64 MiB block depends on its fragmentation, which varies by run.
    default, reused = _probe("system"), _probe("system", env=host_memory_env())
    assert reused["reused"] and not default["reused"]
    assert default["faults"] > 4000, default  # the probe does allocate fresh memory per call
    assert reused["checksum"] == default["checksum"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.slow
def test_reuse_in_a_running_process_and_auto_only_for_large_steps():
    reused = _probe("reuse")  # applied at run time (threads started before keep their arenas)
    assert reused["applied"] and reused["again"] and reused["reused"]
    assert not _probe("auto-small")["reused"]
    large = _probe("auto-large")
    assert large["applied"] and large["reused"]


def test_host_memory_mode_is_checked_and_the_estimate_scales():
    from fusedpc.training._host_memory import (
        REUSE_ABOVE_BYTES,
        gpt_step_temporaries,
        host_memory_choice,
    )

    with pytest.raises(ValueError, match="one of \\('auto', 'reuse', 'system'\\), got 'fast'"):
        host_memory_choice("fast", 0)
    m = {"batch": 32, "seq": 128, "width": 256, "heads": 8, "blocks": 4, "ff_width": 1024}
    s = {"batch": 16, "seq": 64, "width": 64, "heads": 4, "blocks": 2, "ff_width": 256}
    assert gpt_step_temporaries(**s) < REUSE_ABOVE_BYTES <= gpt_step_temporaries(**m)
    assert gpt_step_temporaries(**{**m, "blocks": 8}) == 2 * gpt_step_temporaries(**m)
