"""Helper for tests/test_sharding.py, run in a subprocess: `python _sharding_worker.py MODE ...`.

The device count of JAX's CPU platform is fixed when JAX starts, so every check that needs
emulated devices (or a `jax.distributed` process group) runs here, in a fresh interpreter
started with the right `XLA_FLAGS`, and prints one line `RESULT <json>` for the test to parse.

Modes:
* `mesh`: 8 emulated devices. Sharded `step` / `run` / `predict` against one device, the
  compiled step's HLO, the state's shardings, donation, errors, `model`-axis sharding and
  checkpoints across placements.
* `emulate`: started without `XLA_FLAGS`; `fusedpc.training.emulate_cpu_devices` before and
  after JAX starts.
* `distributed`: one process of a local `jax.distributed` run (`FUSEDPC_COORDINATOR`,
  `FUSEDPC_NUM_PROCESSES`, `FUSEDPC_PROCESS_ID` set); trains 5 steps, feeding its own rows of
  each batch, and reports a digest and the norms of its weights.
* `distributed_checkpoint FOLDER`: one process of a local `jax.distributed` run of 2 processes
  with 2 devices each, on a mesh whose `model` axis spans the processes (`shard_widest`
  splits a small MLP's weights across them). Trains 2 steps, saves to `FOLDER/ckpt.fpc`, loads
  into a fresh pipeline, trains 3 more steps against 5 uninterrupted ones, saves again, and
  checks the refusal of an altered shard file; leaves the second checkpoint in `FOLDER`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import traceback

import numpy as np

STEPS, BATCH, SEQ, VOCAB = 5, 8, 8, 11
COUNT_FLAG = "--xla_force_host_platform_device_count"
FORBIDDEN_OPS = ("infeed", "outfeed", "send", "recv", "send-done", "recv-done")


def batches() -> tuple[np.ndarray, np.ndarray]:
    """The same `(STEPS, BATCH, SEQ)` token ids and targets in every process."""
    rng = np.random.default_rng(0)
    xs = rng.integers(0, VOCAB, (STEPS, BATCH, SEQ)).astype(np.int32)
    ts = rng.integers(0, VOCAB, (STEPS, BATCH, SEQ)).astype(np.int32)
    return xs, ts


def build(**learning):
    import jax
    import optax

    import fusedpc

    config = fusedpc.GPTConfig(
        vocab_size=VOCAB, width=16, n_heads=2, n_blocks=2, ff_width=32, max_len=SEQ, learn="all",
        **learning,
    )
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-2), jax.random.key(0))
    return part, config


def leaves(tree) -> dict[str, np.ndarray]:
    import jax

    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def errors(a, b) -> dict[str, float]:
    """Per leaf of two trees, $\\lVert a - b \\rVert / \\lVert b \\rVert$ (float64; integers: 0
    when equal, inf otherwise; inf on a shape or dtype difference)."""
    la, lb = leaves(a), leaves(b)
    if list(la) != list(lb):
        return {"<tree structure>": float("inf")}
    out = {}
    for path, x in la.items():
        y = lb[path]
        if x.shape != y.shape or x.dtype != y.dtype:
            out[path] = float("inf")
        elif x.dtype.kind in "biu":
            out[path] = 0.0 if np.array_equal(x, y) else float("inf")
        else:
            x64, y64 = x.astype(np.float64), y.astype(np.float64)
            num, den = np.linalg.norm(x64 - y64), np.linalg.norm(y64)
            out[path] = float(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))
    return out


def hlo_ops(text: str) -> dict[str, int]:
    ops: dict[str, int] = {}
    for op in re.findall(r"\s([a-z][a-z0-9-]*)\(", text):
        ops[op] = ops.get(op, 0) + 1
    return ops


def host_round_trips(text: str) -> list[str]:
    """Opcodes or custom calls in an HLO module that would move data to or from the host."""
    ops = hlo_ops(text)
    found = [op for op in FORBIDDEN_OPS if op in ops]
    targets = re.findall(r'custom_call_target="([^"]*)"', text)
    found += [t for t in targets if "callback" in t.lower() or "host" in t.lower()]
    return found


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported back to the test as text
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------- modes
def arrays(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def replicated_over(tree, n: int) -> bool:
    return all(a.sharding.is_fully_replicated and len(a.devices()) == n for a in arrays(tree))


def mode_mesh() -> dict:
    import jax
    from jax.sharding import PartitionSpec

    import fusedpc
    from fusedpc.execution import _sharding

    out: dict = {"devices": len(jax.devices())}
    part, config = build()
    xs, ts = batches()

    # One device: the reference, 5 steps.
    single = fusedpc.FusedPipeline(part, config.error_fn)
    for k in range(STEPS):
        single.step(xs[k], ts[k])
    out["single_devices"] = sorted({d.id for a in arrays(single.state) for d in a.devices()})
    out["reference_norms"] = {p: float(np.linalg.norm(v)) for p, v in leaves(single.state).items()}

    # Sharded step, 5 times. `jax.make_mesh` gives Explicit axes; the pipeline makes them Auto.
    sharded = fusedpc.FusedPipeline(part, config.error_fn, mesh=jax.make_mesh((8,), ("data",)))
    out["mesh_shape"] = dict(sharded.mesh.shape)
    out["mesh_axis_types"] = [str(t) for t in sharded.mesh.axis_types]
    x0 = jax.numpy.asarray(xs[0])
    before = arrays(sharded.state)
    y0, _ = sharded.step(x0, ts[0])
    out["old_state_deleted"] = all(a.is_deleted() for a in before)
    out["caller_batch_alive"] = not x0.is_deleted()
    out["output_spec"] = str(y0.sharding.spec)
    for k in range(1, STEPS):
        sharded.step(xs[k], ts[k])
    out["step_errors"] = errors(sharded.state, single.state)
    out["state_replicated"] = replicated_over(sharded.state, 8)
    out["counters_replicated"] = replicated_over(sharded.carry.counters, 8)
    placed = sharded.place_batch(xs[0])
    out["batch_spec"] = str(placed.sharding.spec)
    out["batch_shard_shapes"] = sorted({tuple(s.data.shape) for s in placed.addressable_shards})

    # The compiled step (served from the cache of the calls above): reductions, no host trips.
    text = sharded.compiled_step(xs[0], ts[0]).as_text()
    ops = hlo_ops(text)
    out["hlo_all_reduce"] = ops.get("all-reduce", 0) + ops.get("all-reduce-start", 0)
    out["hlo_host_round_trips"] = host_round_trips(text)

    # Predict, sharded, against one device (the same weights up to rounding).
    p_sharded = sharded.predict(xs[0])
    out["predict_error"] = errors(p_sharded, single.predict(xs[0]))[""]
    out["predict_spec"] = str(p_sharded.sharding.spec)
    out["predict_state_alive"] = not any(a.is_deleted() for a in arrays(sharded.state))

    # Run: 5 steps in one call, sharded, against 5 single-device steps.
    ran = fusedpc.FusedPipeline(part, config.error_fn, mesh=_sharding.data_mesh())
    ys, _, _ = ran.run(xs, ts)
    out["run_errors"] = errors(ran.state, single.state)
    out["run_state_replicated"] = replicated_over(ran.state, 8)
    out["run_outputs_spec"] = str(ys.sharding.spec)
    out["run_steps"] = ran.steps

    # Errors: a batch that does not divide, a mesh without a data axis; nothing is consumed.
    out["bad_batch_error"] = error_of(lambda: sharded.step(xs[0][:6], ts[0][:6]))
    out["bad_run_error"] = error_of(lambda: ran.run(xs[:, :6], ts[:, :6]))
    out["no_data_axis_error"] = error_of(
        lambda: fusedpc.FusedPipeline(part, config.error_fn, mesh=jax.make_mesh((8,), ("x",)))
    )
    out["steps_after_errors"] = [sharded.steps, ran.steps]

    # emulate_cpu_devices once JAX runs: enough devices is fine, more is an error.
    from fusedpc.training._runtime import emulate_cpu_devices

    out["emulate_enough"] = error_of(lambda: emulate_cpu_devices(8))
    out["emulate_too_many"] = error_of(lambda: emulate_cpu_devices(16))

    # Model axis: the widest weights split over "model" on a 4 x 2 mesh.
    mesh2 = _sharding.data_mesh(model=2)
    rule = _sharding.shard_widest(mesh2, min_size=128)
    model = fusedpc.FusedPipeline(part, config.error_fn, mesh=mesh2, state_sharding=rule)
    asked = arrays(_sharding.state_shardings(model.state, mesh2, rule))
    for k in range(STEPS):
        model.step(xs[k], ts[k])
    out["model_errors"] = errors(model.state, single.state)
    out["model_sharding_kept"] = all(
        a.sharding.is_equivalent_to(s, a.ndim)
        for a, s in zip(arrays(model.state), asked, strict=True)
    )
    out["model_sharded_leaves"] = sorted(
        p for p, s in zip(leaves(model.state), asked, strict=True) if s.spec != PartitionSpec()
    )

    out["checkpoint"] = checkpoints(part, config, xs, ts, single, sharded)

    # Iterative inference in every feed-forward: sharded steps against single-device steps.
    iterative, config = build(learning_kind="iterative",
                              learning_kwargs={"inference_steps": 3, "inference_rate": 0.2})
    alone = fusedpc.FusedPipeline(iterative, config.error_fn)
    spread = fusedpc.FusedPipeline(iterative, config.error_fn, mesh=_sharding.data_mesh())
    for k in range(STEPS):
        alone.step(xs[k], ts[k])
        spread.step(xs[k], ts[k])
    out["iterative_errors"] = errors(spread.state, alone.state)
    out["iterative_energies"] = [
        (row["energy_before"], row["energy_after"]) for row in spread.report()
        if "energy_after" in row
    ]

    # Every boundary a latent, relaxed on the whole GPT's energy: sharded against one device.
    latent, config = build(latents="all")
    relaxation = fusedpc.Relaxation(steps=3, rate=0.2)
    alone = fusedpc.FusedPipeline(latent, config.error_fn, relaxation=relaxation)
    spread = fusedpc.FusedPipeline(latent, config.error_fn, relaxation=relaxation,
                                   mesh=_sharding.data_mesh())
    for k in range(STEPS):
        alone.step(xs[k], ts[k])
        spread.step(xs[k], ts[k])
    out["tree_pc_errors"] = errors(spread.state, alone.state)
    out["tree_pc_energies"] = [(row["energy_before"], row["energy_after"])
                               for row in spread.report() if row["part"] == "<relaxation>"]
    return out


def checkpoints(part, config, xs, ts, single, sharded) -> dict:
    """Save from one placement, load into the other; the loaded state takes the loader's."""
    try:
        import fusedpc.execution._checkpoint  # noqa: F401
    except ImportError as e:
        return {"skipped": f"fusedpc.execution._checkpoint not importable: {e}"}
    import fusedpc

    out: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            from_sharded = os.path.join(tmp, "sharded.ckpt")
            from_single = os.path.join(tmp, "single.ckpt")
            sharded.save(from_sharded, {"from": "sharded"})
            single.save(from_single, {"from": "single"})

            into_single = fusedpc.FusedPipeline(part, config.error_fn)
            meta = into_single.load(from_sharded)
            out["sharded_to_single_metadata"] = meta.get("from") if isinstance(meta, dict) else None
            out["sharded_to_single_errors"] = errors(into_single.state, sharded.state)
            out["sharded_to_single_devices"] = sorted(
                {d.id for a in arrays(into_single.state) for d in a.devices()}
            )
            out["sharded_to_single_steps"] = into_single.steps

            sharded.load(from_single)
            out["single_to_sharded_errors"] = errors(sharded.state, single.state)
            out["single_to_sharded_replicated"] = replicated_over(sharded.state, 8)
            # Training continues from the loaded state on 8 devices as on one.
            sharded.step(xs[0], ts[0])
            single.step(xs[0], ts[0])
            out["continue_errors"] = errors(sharded.state, single.state)
            out["continue_replicated"] = replicated_over(sharded.state, 8)
    except Exception:  # noqa: BLE001 - the test prints it
        out["error"] = traceback.format_exc()
    return out


def mode_emulate() -> dict:
    from fusedpc.execution import _sharding
    from fusedpc.training._runtime import emulate_cpu_devices

    out: dict = {"xla_flags_before": os.environ.get("XLA_FLAGS", "")}
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 " + COUNT_FLAG + "=2"
    emulate_cpu_devices(3)  # jax_num_cpu_devices: wins over the count in XLA_FLAGS
    out["xla_flags_after"] = os.environ["XLA_FLAGS"]
    import jax

    out["devices"] = len(jax.devices())
    out["after_start_enough"] = error_of(lambda: emulate_cpu_devices(2))
    out["after_start_too_many"] = error_of(lambda: emulate_cpu_devices(4))
    out["mesh_shape"] = dict(_sharding.data_mesh().shape)
    out["mesh_too_big"] = error_of(lambda: _sharding.data_mesh(5))
    return out


def mode_distributed() -> dict:
    from fusedpc.execution import _sharding

    # Coordinator, process count and id come from FUSEDPC_* variables, as in `fusedpc train
    # --distributed` launched by hand.
    _sharding.initialize_distributed()
    import jax

    import fusedpc

    out: dict = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": len(jax.local_devices()),
        "global_devices": len(jax.devices()),
    }
    part, config = build()
    xs, ts = batches()
    mesh = _sharding.data_mesh()
    pipeline = fusedpc.FusedPipeline(part, config.error_fn, mesh=mesh)
    rows = _sharding.process_batch_slice(BATCH)
    out["rows"] = [rows.start, rows.stop]
    initial = leaves(pipeline.state)
    # Two steps one call each, then three in one `run` call (what `fusedpc train` does).
    for k in range(2):
        x = _sharding.make_global_batch(xs[k, rows], mesh)
        t = _sharding.make_global_batch(ts[k, rows], mesh)
        out["global_batch_shape"] = list(x.shape)
        out["global_batch_spec"] = str(x.sharding.spec)
        pipeline.step(x, t)
    xs_run = _sharding.make_global_batch(xs[2:, rows], mesh, axis=1)
    ts_run = _sharding.make_global_batch(ts[2:, rows], mesh, axis=1)
    out["global_run_shape"] = list(xs_run.shape)
    pipeline.run(xs_run, ts_run, keep_outputs=False)
    out["state_replicated"] = replicated_over(pipeline.state, len(jax.devices()))
    final = leaves(pipeline.state)
    out["steps"] = pipeline.steps
    out["loss"] = pipeline.last_loss
    out["moved"] = any(not np.array_equal(initial[p], v) for p, v in final.items())
    out["digest"] = hashlib.sha256(b"".join(v.tobytes() for v in final.values())).hexdigest()
    out["norms"] = {p: float(np.linalg.norm(v)) for p, v in final.items()}
    jax.distributed.shutdown()
    return out


def local_blocks(pipeline) -> dict[str, dict[str, str]]:
    """Per state leaf, the SHA-256 of every distinct block this process holds, by its index
    (`"0:16,0:8"`); step counters included (as `counters.<name>`)."""
    import jax

    out: dict[str, dict[str, str]] = {}
    named = {"state": pipeline.state, "counters": pipeline.counters}
    for path, leaf in jax.tree_util.tree_leaves_with_path(named):
        blocks = out.setdefault(jax.tree_util.keystr(path), {})
        for shard in leaf.addressable_shards:
            index = ",".join(
                f"{s.indices(d)[0]}:{s.indices(d)[1]}" for s, d in zip(shard.index, leaf.shape)
            )
            blocks[index] = hashlib.sha256(np.asarray(shard.data).tobytes()).hexdigest()
    return out


def flip_byte(file: str, entry: str) -> None:
    """Invert the first data byte of `entry` in the zip file `file` (in place)."""
    import zipfile

    with zipfile.ZipFile(file) as zf:
        info = zf.getinfo(entry)
    with open(file, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = np.frombuffer(f.read(4), "<u2")
        at = info.header_offset + 30 + int(name_length) + int(extra_length)
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def build_mlp():
    """A learning network [16, 32, 8] with Adam: its weights and moments (512 and 256 entries)
    are split by `shard_widest(mesh, min_size=128)`, its biases and counts are not."""
    import jax
    import optax

    import fusedpc

    network = fusedpc.PCNetwork([16, 32, 8], "tanh", key=jax.random.key(1))
    return fusedpc.LearningNetwork(network, optimiser=optax.adam(1e-2))


def mlp_batches() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, BATCH, 16)).astype(np.float32)
    ts = rng.normal(size=(STEPS, BATCH, 8)).astype(np.float32)
    return xs, ts


def mode_distributed_checkpoint(folder: str) -> dict:
    from fusedpc.execution import _sharding

    _sharding.initialize_distributed()
    import jax
    from jax.experimental.multihost_utils import sync_global_devices
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import fusedpc

    me, n = jax.process_index(), jax.process_count()
    # Row d of the mesh holds the d-th device of every process: "data" stays inside a process,
    # "model" spans the processes, so the widest weights are split across them.
    by_process = [[d for d in jax.devices() if d.process_index == k] for k in range(n)]
    mesh = Mesh(np.array(by_process).T, ("data", "model"))
    rule = _sharding.shard_widest(mesh, min_size=128)
    part = build_mlp()
    xs, ts = mlp_batches()
    rows = NamedSharding(mesh, PartitionSpec("data", None))

    def pipeline():
        return fusedpc.FusedPipeline(part, mesh=mesh, state_sharding=rule)

    def feed(p, k):  # every process holds every batch; each device takes its rows
        x, t = (
            jax.make_array_from_callback(a[k].shape, rows, lambda i, a=a: a[k][i])
            for a in (xs, ts)
        )
        p.step(x, t)

    path = os.path.join(folder, "ckpt.fpc")
    shards = path + ".shards"
    out: dict = {"process_index": me, "process_count": n}
    uninterrupted = pipeline()
    out["split_leaves"] = sorted(
        jax.tree_util.keystr(p)
        for p, a in jax.tree_util.tree_leaves_with_path(uninterrupted.state)
        if not a.is_fully_addressable and not a.is_fully_replicated
    )
    for k in range(2):
        feed(uninterrupted, k)
    at_two = local_blocks(uninterrupted)
    uninterrupted.save(path, {"position": 2})
    manifest = fusedpc.read_checkpoint_manifest(path, verify=True)
    out["first_files"] = sorted(os.listdir(shards))
    out["format_version"] = manifest["format_version"]
    out["shard_files"] = manifest.get("shard_files")
    out["split_records"] = sorted(r["path"] for r in manifest["leaves"] if "shards" in r)

    # Into a fresh pipeline: the same state, placed alike; then 3 more steps against 5.
    resumed = pipeline()
    out["metadata"] = resumed.load(path)
    out["loaded_identical"] = local_blocks(resumed) == at_two
    out["loaded_sharding_kept"] = all(
        a.sharding.is_equivalent_to(b.sharding, a.ndim)
        for a, b in zip(arrays(resumed.state), arrays(uninterrupted.state), strict=True)
    )
    out["loaded_steps"] = resumed.steps
    for k in range(2, STEPS):
        feed(uninterrupted, k)
        feed(resumed, k)
    final = local_blocks(uninterrupted)
    out["resumed_identical"] = local_blocks(resumed) == final
    out["moved"] = final != at_two

    # A second save replaces the first: new shard files, the old ones gone.
    resumed.save(path, {"position": STEPS})
    out["second_files"] = sorted(os.listdir(shards))
    out["second_manifest_files"] = fusedpc.read_checkpoint_manifest(path)["shard_files"]["files"]
    fresh = pipeline()
    fresh.load(path)
    out["second_loaded_identical"] = local_blocks(fresh) == final and fresh.steps == STEPS

    # An altered byte in process 1's shard file: refused everywhere, the pipeline untouched.
    record = next(r for r in fusedpc.read_checkpoint_manifest(path)["leaves"] if "shards" in r)
    shard = next(s for s in record["shards"] if ".process-1-of-" in s["file"])
    target = os.path.join(shards, shard["file"])
    out["altered"] = {"file": target, "leaf": record["path"]}
    sync_global_devices("checkpoint saved")
    if me == 0:
        flip_byte(target, shard["entry"])
    sync_global_devices("shard file altered")
    out["verify_error"] = error_of(lambda: fusedpc.read_checkpoint_manifest(path, verify=True))
    out["load_error"] = error_of(lambda: fresh.load(path))
    out["untouched"] = local_blocks(fresh) == final and fresh.steps == STEPS
    sync_global_devices("shard file read")
    if me == 0:
        flip_byte(target, shard["entry"])  # restored, for the test's own checks
    sync_global_devices("shard file restored")
    out["blocks"] = final
    jax.distributed.shutdown()
    return out


def main() -> None:
    import jax

    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py
    mode = sys.argv[1]
    if mode == "mesh":
        result = mode_mesh()
    elif mode == "emulate":
        result = mode_emulate()
    elif mode == "distributed":
        result = mode_distributed()
    elif mode == "distributed_checkpoint":
        result = mode_distributed_checkpoint(sys.argv[2])
    else:
        raise SystemExit(
            f"unknown mode {mode!r}; expected mesh, emulate, distributed or "
            "distributed_checkpoint"
        )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
