"""Process-level runtime settings (`_runtime`): Ctrl-C, joining processes, emulated devices."""

from __future__ import annotations

import os
import signal

import jax
import pytest

from fusedpc.training import _runtime, emulate_cpu_devices


def test_first_ctrl_c_asks_to_stop_and_the_second_aborts():
    asked, before = [], signal.getsignal(signal.SIGINT)
    with _runtime.StopRequest(lambda: asked.append(True)) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and asked == [True] and not stop.aborted
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.aborted
    assert signal.getsignal(signal.SIGINT) is before


def test_distributed_launch_variables_must_come_together(monkeypatch):
    for name in _runtime.PROCESS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FUSEDPC_COORDINATOR", "127.0.0.1:23456")
    # one reader of the variables: fusedpc.initialize_distributed
    with pytest.raises(ValueError, match="--distributed: .* together .*num_processes=None, "
                       "process_id=None"):
        _runtime.join_processes()
    monkeypatch.setenv("FUSEDPC_NUM_PROCESSES", "two")
    monkeypatch.setenv("FUSEDPC_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="FUSEDPC_NUM_PROCESSES: expected an integer"):
        _runtime.join_processes()


def test_emulate_cpu_devices_in_this_process_checks_only():
    have = len(jax.devices("cpu"))
    flags = os.environ.get("XLA_FLAGS")
    emulate_cpu_devices(have)  # already started with enough: a no-op
    assert os.environ.get("XLA_FLAGS") == flags
    with pytest.raises(RuntimeError, match="already started"):
        emulate_cpu_devices(have + 1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        emulate_cpu_devices(0)
