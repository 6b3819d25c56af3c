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


def build():
    import jax
    import optax

    import fusedpc

    config = fusedpc.GPTConfig(
        vocab_size=VOCAB, width=16, n_heads=2, n_blocks=2, ff_width=32, max_len=SEQ, learn="all"
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
    else:
        raise SystemExit(f"unknown mode {mode!r}; expected mesh, emulate or distributed")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
