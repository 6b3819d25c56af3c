"""`reuse_host_memory`: freed host memory is kept for the next call instead of being unmapped
and faulted in again (each case in a fresh process: the allocator is set once per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import json, resource, sys
import fusedpc
applied = fusedpc.reuse_host_memory() if sys.argv[1] == "reuse" else False
again = fusedpc.reuse_host_memory() if sys.argv[1] == "reuse" else False
import jax, jax.numpy as jnp
import numpy as np

@jax.jit
def big(x):  # a 64 MiB temporary, fresh every call
    return jnp.sum(jnp.sin(jnp.outer(x, x)), axis=0)

x = jnp.linspace(0.0, 1.0, 4096, dtype=jnp.float32)
first = np.asarray(big(x))
for _ in range(2):
    big(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    big(x).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(json.dumps({"applied": applied, "again": again, "reused": fusedpc.host_memory_reused(),
                  "faults": faults, "checksum": float(np.sum(first, dtype=np.float64))}))
"""


def _probe(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_reuse_host_memory_stops_page_faults_and_changes_no_result():
    default, reused = _probe("default"), _probe("reuse")
    assert reused["applied"] and reused["again"] and reused["reused"]
    assert not default["reused"]
    # 64 MiB of fresh pages per call is ~16,000 faults with the default allocator
    assert default["faults"] > 4000, default
    assert reused["faults"] < default["faults"] / 10, (default, reused)
    assert reused["checksum"] == default["checksum"]
