"""Scale-out: data-parallel (and model-axis) sharding, multi-host launch, device emulation.

JAX fixes the CPU device count when it starts, and this test process has already started it
with one device, so every check on several devices runs in a subprocess
(`tests/_sharding_worker.py`) started with `XLA_FLAGS=--xla_force_host_platform_device_count=N`;
the worker prints `RESULT <json>` and the tests here assert on it. The `mesh` worker runs once
per session (a module fixture) and serves several tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import fusedpc
from fusedpc.execution import _sharding

sys.path.insert(0, str(Path(__file__).parent))
from _sharding_worker import build_mlp, flip_byte  # noqa: E402

# every test here waits on emulated-device or multi-process workers (minutes together):
# end to end, left out of the fast loop (-m 'not slow')
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_sharding_worker.py")
# Every subprocess compiles the tiny GPT's step from scratch; LLVM's optimisation passes are a
# third of that time and change nothing that is checked here (HLO-level sharding, and values
# compared within one process or between processes built alike).
FAST_COMPILE = "--xla_backend_optimization_level=0"
TIMEOUT_S = 600  # generous: the suite may share two cores with other jobs
RTOL = 1e-5


def _env(n_devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    if n_devices is not None:
        env["XLA_FLAGS"] = f"{FAST_COMPILE} --xla_force_host_platform_device_count={n_devices}"
    return env


def _parse(stdout: str, stderr: str, what: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"{what}: no RESULT line.\nstdout:\n{stdout}\nstderr:\n{stderr[-6000:]}")


class _Worker:
    """A worker subprocess started now and read later (so that several run side by side)."""

    def __init__(self, *args: str, n_devices: int | None, extra_env: dict | None = None):
        self.what = f"worker {' '.join(args)} {extra_env or ''}".strip()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env={**_env(n_devices), **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(self) -> dict:
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.what}: no result within {TIMEOUT_S} s") from None
        assert self.proc.returncode == 0, f"{self.what} failed:\n{stderr[-6000:]}"
        return _parse(stdout, stderr, self.what)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _is_key_bias(path: str) -> bool:
    # The key bias adds the same score to every column of a softmax row, so its gradient is
    # exactly zero; Adam turns the float32 noise in it into full-size steps, differently for
    # any two summation orders. It changes no output (predict is compared below).
    # (`.attention.parts[0].wk.`: the attention of a GPT with latents)
    return (".attention.wk." in path or ".attention.parts[0].wk." in path) and "biases" in path


def _assert_close(errors: dict[str, float], what: str, rtol: float = RTOL) -> None:
    checked = {p: e for p, e in errors.items() if not _is_key_bias(p)}
    assert len(checked) >= 60, f"{what}: only {len(checked)} leaves compared"
    worst = max(checked, key=checked.get)
    assert checked[worst] <= rtol, f"{what}: leaf {worst} differs by {checked[worst]:.3e}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers():
    """The 8-device worker and the two processes of a local `jax.distributed` launch (2 CPU
    devices each), all started at once; each test reads the results it needs."""
    started = {"mesh": _Worker("mesh", n_devices=8)}
    try:
        port = _free_port()
    except OSError as e:
        started["distributed_skip"] = f"cannot open a local TCP port for the coordinator: {e}"
    else:
        for i in range(2):
            env = {
                "FUSEDPC_COORDINATOR": f"127.0.0.1:{port}",
                "FUSEDPC_NUM_PROCESSES": "2",
                "FUSEDPC_PROCESS_ID": str(i),
            }
            started[f"process{i}"] = _Worker("distributed", n_devices=2, extra_env=env)
    yield started
    for worker in started.values():
        if isinstance(worker, _Worker):
            worker.kill()


@pytest.fixture(scope="module")
def mesh_result(workers) -> dict:
    return workers["mesh"].result()


# --------------------------------------------------------------------------- data parallel
def test_sharded_steps_equal_single_device_steps(mesh_result):
    r = mesh_result
    assert r["devices"] == 8 and r["single_devices"] == [0]
    assert r["mesh_shape"] == {"data": 8}
    assert r["mesh_axis_types"] == ["AxisType.Auto"]  # jax.make_mesh's Explicit, made Auto
    _assert_close(r["step_errors"], "5 sharded steps vs 5 single-device steps")
    assert r["predict_error"] <= RTOL


def test_iterative_feed_forwards_shard_like_every_part(mesh_result):
    r = mesh_result
    _assert_close(r["iterative_errors"], "iterative GPT: 5 sharded vs 5 single-device steps")
    assert len(r["iterative_energies"]) == 2  # one feed-forward per block
    assert all(0 < after < before for before, after in r["iterative_energies"])


def test_a_relaxing_tree_shards_like_every_tree(mesh_result):
    r = mesh_result
    # 1e-3, not RTOL: below a latent the errors are the small relaxed ones, which Adam
    # (rate 1e-2) scales up, and with them the summation-order noise of 8 devices' row sums
    # (worst seen 2.3e-4, in the attention biases, the norms and their Adam moments)
    _assert_close(r["tree_pc_errors"], "fully-PC GPT: 5 sharded vs 5 single-device steps",
                  rtol=1e-3)
    ((before, after),) = r["tree_pc_energies"]
    assert after < before


def test_sharded_run_equals_single_device_steps(mesh_result):
    r = mesh_result
    assert r["run_steps"] == 5
    _assert_close(r["run_errors"], "run(5 steps) sharded vs 5 single-device steps")
    assert r["run_outputs_spec"] == "P(None, 'data')"
    assert r["run_state_replicated"]


def test_compiled_step_reduces_across_devices_without_host_round_trips(mesh_result):
    assert mesh_result["hlo_all_reduce"] >= 1
    assert mesh_result["hlo_host_round_trips"] == []


def test_state_replicated_batch_sharded_and_state_donated(mesh_result):
    r = mesh_result
    assert r["state_replicated"] and r["counters_replicated"]
    assert r["batch_spec"] == "P('data', None)"
    assert r["batch_shard_shapes"] == [[1, 8]]  # 8 rows over 8 devices
    assert r["output_spec"] == "P('data',)"
    assert r["predict_spec"] == "P('data',)"
    assert r["old_state_deleted"] and r["caller_batch_alive"] and r["predict_state_alive"]


def test_batch_not_dividing_over_devices_is_a_clear_error(mesh_result):
    r = mesh_result
    for key, axis in (("bad_batch_error", 0), ("bad_run_error", 1)):
        message = r[key]
        assert message is not None and message.startswith("ValueError: batch:"), message
        assert f"(axis {axis}, size 6)" in message
        assert "'data' axis of 8 devices" in message and "multiple of 8 rows (e.g. 8)" in message
    assert r["steps_after_errors"] == [5, 5]  # nothing was consumed or donated
    assert "'data' axis" in r["no_data_axis_error"] and "('x',)" in r["no_data_axis_error"]


def test_model_axis_sharding_kept_and_equal_to_single_device(mesh_result):
    r = mesh_result
    _assert_close(r["model_errors"], "5 steps on a 4x2 data/model mesh vs one device")
    assert r["model_sharding_kept"]
    sharded = r["model_sharded_leaves"]
    for name in (
        ".blocks.blocks.feed_forward.params.weights[0]",
        ".blocks.blocks.feed_forward.params.weights[1]",
        ".blocks.blocks.feed_forward.opt_state[0].mu.weights[0]",
        ".head.params.weights[0]",
        ".token.table",
    ):
        assert name in sharded, name
    assert not any("biases" in p or "count" in p for p in sharded)


def test_checkpoints_move_between_sharded_and_single_device(mesh_result):
    pytest.importorskip("fusedpc.execution._checkpoint")
    c = mesh_result["checkpoint"]
    assert "error" not in c, c.get("error")
    assert c["sharded_to_single_metadata"] == "sharded"
    assert set(c["sharded_to_single_errors"].values()) == {0.0}  # bit-exact
    assert c["sharded_to_single_devices"] == [0]
    assert c["sharded_to_single_steps"] == 5
    assert set(c["single_to_sharded_errors"].values()) == {0.0}
    assert c["single_to_sharded_replicated"] and c["continue_replicated"]
    _assert_close(c["continue_errors"], "a step after loading, sharded vs one device")


# --------------------------------------------------------------------------- emulation
def test_emulate_cpu_devices_before_and_after_jax_starts():
    r = _Worker("emulate", n_devices=None).result()
    assert r["xla_flags_before"] == ""
    # jax_num_cpu_devices: XLA_FLAGS is left as it was, the option's count wins over its count
    assert r["xla_flags_after"] == f"{FAST_COMPILE} --xla_force_host_platform_device_count=2"
    assert r["devices"] == 3 and r["mesh_shape"] == {"data": 3}
    assert r["after_start_enough"] is None
    assert r["after_start_too_many"].startswith("RuntimeError: emulate_cpu_devices(4)")
    assert "already started with 3 CPU device(s)" in r["after_start_too_many"]
    assert r["mesh_too_big"].startswith("ValueError: data_mesh: n_devices")


# --------------------------------------------------------------------------- helpers in-process
def test_data_mesh_and_resolve_mesh_on_one_device():
    mesh = _sharding.data_mesh(1)
    assert mesh.axis_names == ("data",) and mesh.shape["data"] == 1
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    explicit = jax.make_mesh((1,), ("data",))
    assert _sharding.resolve_mesh(explicit).axis_types == (jax.sharding.AxisType.Auto,)
    assert _sharding.resolve_mesh(None) is None
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        _sharding.resolve_mesh("data")
    with pytest.raises(ValueError, match="model=3 must be >= 1 and divide"):
        _sharding.data_mesh(1, model=3)


def test_pipeline_mesh_arguments_are_checked():
    part = fusedpc.frozen.relu()
    with pytest.raises(ValueError, match="'data' axis"):
        fusedpc.FusedPipeline(part, mesh=jax.make_mesh((1,), ("batch",)))
    with pytest.raises(ValueError, match="state_sharding: needs a mesh"):
        fusedpc.FusedPipeline(part, state_sharding=lambda path, leaf: None)


def test_state_shardings_reject_specs_that_do_not_divide():
    mesh = _sharding.data_mesh(1)
    tree = {"w": np.zeros((3, 4), np.float32)}
    rule = lambda path, leaf: PartitionSpec("data", None, None)  # noqa: E731
    with pytest.raises(ValueError, match=r"\['w'\] of shape \(3, 4\) cannot be split"):
        _sharding.state_shardings(tree, mesh, rule)
    with pytest.raises(TypeError, match="PartitionSpec or None"):
        _sharding.state_shardings(tree, mesh, lambda path, leaf: ("data",))
    placed = _sharding.state_shardings(tree, mesh)
    assert placed["w"].spec == PartitionSpec()


def test_shard_widest_picks_the_wider_of_the_last_two_axes():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    rule = _sharding.shard_widest(mesh, min_size=4)
    leaf = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    assert rule("", leaf(2, 32, 16)) == PartitionSpec(None, "model", None)
    assert rule("", leaf(2, 16, 32)) == PartitionSpec(None, None, "model")
    assert rule("", leaf(11, 16)) == PartitionSpec(None, "model")
    assert rule("", leaf(16)) is None  # vectors stay replicated
    assert rule("", leaf(1, 2)) is None  # below min_size
    with pytest.raises(ValueError, match="no 'model' axis"):
        _sharding.shard_widest(_sharding.data_mesh(1))


def test_process_batch_slice_splits_rows_evenly():
    assert _sharding.process_batch_slice(8, 0, 2) == slice(0, 4)
    assert _sharding.process_batch_slice(8, 1, 2) == slice(4, 8)
    assert _sharding.process_batch_slice(8) == slice(0, 8)  # one process here
    with pytest.raises(ValueError, match="must divide over 3 processes"):
        _sharding.process_batch_slice(8, 0, 3)


def test_initialize_distributed_wants_all_or_none_of_its_settings(monkeypatch):
    for name in ("FUSEDPC_COORDINATOR", "FUSEDPC_NUM_PROCESSES", "FUSEDPC_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="together"):
        _sharding.initialize_distributed("127.0.0.1:1234")
    monkeypatch.setenv("FUSEDPC_COORDINATOR", "127.0.0.1:1234")
    with pytest.raises(ValueError, match="FUSEDPC_NUM_PROCESSES"):
        _sharding.initialize_distributed()
    monkeypatch.setenv("FUSEDPC_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="FUSEDPC_NUM_PROCESSES: expected an integer"):
        _sharding.initialize_distributed()


def test_make_global_batch_in_one_process_is_the_placed_batch():
    mesh = _sharding.data_mesh(1)
    local = np.arange(12, dtype=np.int32).reshape(2, 6)
    batch = _sharding.make_global_batch(local, mesh)
    np.testing.assert_array_equal(np.asarray(batch), local)
    assert batch.sharding.spec == PartitionSpec("data", None)
    stacked = _sharding.make_global_batch(local[None], mesh, axis=1)
    assert stacked.sharding.spec == PartitionSpec(None, "data", None)


# --------------------------------------------------------------------------- multi-host
def test_two_process_local_launch_trains_identical_weights(workers, mesh_result):
    if "distributed_skip" in workers:
        pytest.skip(workers["distributed_skip"])
    results = [workers[f"process{i}"].result() for i in range(2)]
    for i, r in enumerate(results):
        assert r["process_index"] == i and r["process_count"] == 2
        assert r["local_devices"] == 2 and r["global_devices"] == 4
        assert r["rows"] == [4 * i, 4 * i + 4]
        assert r["global_batch_shape"] == [8, 8] and r["global_run_shape"] == [3, 8, 8]
        assert r["global_batch_spec"] == "P('data', None)"
        assert r["steps"] == 5 and r["moved"] and np.isfinite(r["loss"])
        assert r["state_replicated"]
    assert results[0]["digest"] == results[1]["digest"]  # bit-identical weights
    # and they are the weights of 5 single-device steps on the whole batches
    reference = mesh_result["reference_norms"]
    assert set(results[0]["norms"]) == set(reference)
    for path, norm in results[0]["norms"].items():
        if not _is_key_bias(path):
            assert abs(norm - reference[path]) <= RTOL * abs(reference[path]), path


# --------------------------------------------------------------------------- multi-host checkpoints
@pytest.fixture(scope="module")
def checkpoint_workers(tmp_path_factory):
    """Two processes of a local `jax.distributed` launch (2 CPU devices each) on a mesh whose
    `model` axis spans them; they save to and load from one shared folder, left for the
    tests below (the second checkpoint, after 5 steps)."""
    folder = tmp_path_factory.mktemp("multiprocess-checkpoint")
    try:
        port = _free_port()
    except OSError as e:
        pytest.skip(f"cannot open a local TCP port for the coordinator: {e}")
    started = [
        _Worker(
            "distributed_checkpoint",
            str(folder),
            n_devices=2,
            extra_env={
                "FUSEDPC_COORDINATOR": f"127.0.0.1:{port}",
                "FUSEDPC_NUM_PROCESSES": "2",
                "FUSEDPC_PROCESS_ID": str(i),
            },
        )
        for i in range(2)
    ]
    try:
        yield folder, [worker.result() for worker in started]
    finally:
        for worker in started:
            worker.kill()


def _mlp_pipeline() -> fusedpc.FusedPipeline:
    return fusedpc.FusedPipeline(build_mlp())


def test_state_split_across_processes_saves_and_resumes_bit_for_bit(checkpoint_workers):
    _, results = checkpoint_workers
    for i, r in enumerate(results):
        assert r["process_index"] == i and r["process_count"] == 2
        # the weights and their Adam moments really are split across the two processes
        assert ".params.weights[0]" in r["split_leaves"] and len(r["split_leaves"]) == 6
        assert r["split_records"] == r["split_leaves"]
        assert r["format_version"] == 2
        files = r["shard_files"]["files"]
        assert r["first_files"] == files and [f.split(".", 1)[1] for f in files] == [
            "process-0-of-2.zip",
            "process-1-of-2.zip",
        ]
        assert r["shard_files"]["folder"] == "ckpt.fpc.shards"
        assert r["metadata"] == {"position": 2} and r["loaded_steps"] == 2
        assert r["loaded_identical"] and r["loaded_sharding_kept"]  # every local block, bit-exact
        assert r["moved"] and r["resumed_identical"]  # 2 + 3 steps == 5 uninterrupted steps
    assert results[0]["shard_files"] == results[1]["shard_files"]


def test_second_save_replaces_the_first_and_its_shard_files(checkpoint_workers):
    _, results = checkpoint_workers
    for r in results:
        assert r["second_files"] == r["second_manifest_files"]
        assert not set(r["second_files"]) & set(r["first_files"])  # the first's are removed
        assert r["second_loaded_identical"]


def test_altered_shard_file_is_refused_in_every_process(checkpoint_workers):
    _, results = checkpoint_workers
    altered = results[0]["altered"]
    for r in results:
        assert r["verify_error"].startswith("CheckpointError: checkpoint ")
        assert f"shard file {altered['file']!r} is corrupted" in r["verify_error"]
        assert f"leaf {altered['leaf']} block [" in r["verify_error"]
        assert r["untouched"]  # load refused, state and counters as they were
    # process 1 reads that file (its devices hold those blocks); process 0 is told
    assert results[1]["load_error"] == results[1]["verify_error"]
    assert results[0]["load_error"].startswith("CheckpointError: checkpoint ")
    assert "refused by process(es) [1]" in results[0]["load_error"]


def test_multi_process_checkpoint_loads_into_one_process(checkpoint_workers):
    folder, results = checkpoint_workers
    pipeline = _mlp_pipeline()
    assert pipeline.load(str(folder / "ckpt.fpc")) == {"position": 5}
    named = {"state": pipeline.state, "counters": pipeline.counters}
    values = {
        jax.tree_util.keystr(p): np.asarray(a)
        for p, a in jax.tree_util.tree_leaves_with_path(named)
    }
    compared = 0
    for r in results:  # every block either process held after 5 steps, bit for bit
        assert set(r["blocks"]) == set(values)
        for path, blocks in r["blocks"].items():
            for index, digest in blocks.items():
                region = tuple(slice(*map(int, b.split(":"))) for b in index.split(",") if b)
                assert hashlib.sha256(values[path][region].tobytes()).hexdigest() == digest, path
                compared += 1
    assert compared >= 2 * len(values)
    # saved again from one process: one file, the shard folder removed
    copy = folder.parent / (folder.name + "-single")
    shutil.copytree(folder, copy)
    pipeline.save(str(copy / "ckpt.fpc"))
    assert sorted(os.listdir(copy)) == ["ckpt.fpc"]
    assert fusedpc.read_checkpoint_manifest(copy / "ckpt.fpc", verify=True)["format_version"] == 1


@pytest.mark.parametrize("damage", ["missing", "truncated", "altered"])
def test_damaged_shard_file_is_refused_naming_it_and_the_leaf(checkpoint_workers, tmp_path, damage):
    folder, _ = checkpoint_workers
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / "ckpt.fpc"
    manifest = fusedpc.read_checkpoint_manifest(path, verify=True)
    record = next(r for r in manifest["leaves"] if "shards" in r)
    shard = record["shards"][-1]
    target = copy / manifest["shard_files"]["folder"] / shard["file"]
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        flip_byte(str(target), shard["entry"])
    pipeline = _mlp_pipeline()
    before = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves(pipeline.state)]
    fusedpc.read_checkpoint_manifest(path)  # the manifest alone still reads
    for attempt in (
        lambda: fusedpc.read_checkpoint_manifest(path, verify=True),
        lambda: pipeline.load(str(path)),
    ):
        with pytest.raises(fusedpc.CheckpointError) as caught:
            attempt()
        message = str(caught.value)
        assert repr(str(target)) in message and "shard file" in message
        assert f"leaf {record['path']} block [" in message  # the first leaf that file holds
        assert ("does not exist" if damage == "missing" else "corrupted or truncated") in message
    after = [np.asarray(a) for a in jax.tree_util.tree_leaves(pipeline.state)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert pipeline.steps == 0


def _first_split(manifest: dict) -> dict:
    return next(r for r in manifest["leaves"] if "shards" in r)


def _blocks_overlap(m: dict) -> dict:
    _first_split(m)["shards"][1]["index"] = _first_split(m)["shards"][0]["index"]
    return m


def _block_missing(m: dict) -> dict:
    del _first_split(m)["shards"][1]
    return m


def _folder_escapes(m: dict) -> dict:
    m["shard_files"]["folder"] = "../elsewhere"
    return m


def _file_unlisted(m: dict) -> dict:
    _first_split(m)["shards"][0]["file"] = "0123456789abcdef.process-7-of-8.zip"
    return m


@pytest.mark.parametrize(
    "change, detail",
    [
        (_blocks_overlap, "its blocks do not tile its shape"),
        (_block_missing, "its blocks do not tile its shape"),
        (_folder_escapes, "not shard files"),
        (_file_unlisted, "names the unlisted file"),
    ],
)
def test_malformed_shard_table_is_refused(checkpoint_workers, tmp_path, change, detail):
    import zipfile

    folder, _ = checkpoint_workers
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    path = copy / "ckpt.fpc"
    with zipfile.ZipFile(path) as zf:
        entries = {name: zf.read(name) for name in zf.namelist()}
    manifest = change(json.loads(entries["manifest.json"]))
    entries["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    with pytest.raises(fusedpc.CheckpointError, match="corrupted or truncated") as caught:
        _mlp_pipeline().load(str(path))
    assert detail in str(caught.value)
