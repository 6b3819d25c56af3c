"""Checkpoints: bit-exact round trips, bit-identical resumption, refusal of other trees and of
damaged files, atomic writes under faults (killed writer, full disk), deterministic bytes."""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.core import Core, FiniteFlag
from fusedpc.execution import (
    CheckpointError,
    _checkpoint,
    load_checkpoint,
    read_checkpoint_manifest,
    save_checkpoint,
)
from fusedpc.execution._checkpoint import FORMAT_VERSION


# --------------------------------------------------------------------------- trees and helpers
def mlp_tree(hidden=8, optimiser=None, frozen_tail=True, seed=1):
    """A learning network [4, hidden, 2] (adam unless told), then a frozen tanh."""
    network = fusedpc.PCNetwork([4, hidden, 2], "tanh", key=jax.random.key(seed))
    learner = fusedpc.LearningNetwork(network, optimiser=optimiser or optax.adam(1e-2))
    return fusedpc.Sequential([learner, fusedpc.frozen.tanh()]) if frozen_tail else learner


# the subprocess tests build the same tree from the same source
MLP_SOURCE = "import jax, optax, fusedpc\n" + inspect.getsource(mlp_tree)


def mlp_batch(i: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(2), i))
    return jax.random.normal(k1, (3, 4)), 0.5 * jax.random.normal(k2, (3, 2))


def mlp_pipeline(**kwargs) -> fusedpc.FusedPipeline:
    return fusedpc.FusedPipeline(mlp_tree(**kwargs))


def train(pipeline: fusedpc.FusedPipeline, start: int, stop: int) -> list[float]:
    losses = []
    for i in range(start, stop):
        pipeline.step(*mlp_batch(i))
        losses.append(pipeline.last_loss)
    return losses


GPT_CONFIG = fusedpc.GPTConfig(
    vocab_size=11, width=16, n_heads=2, n_blocks=2, ff_width=32, max_len=8
)


def gpt_pipeline(config: fusedpc.GPTConfig = GPT_CONFIG, seed: int = 0) -> fusedpc.FusedPipeline:
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(seed))
    return fusedpc.FusedPipeline(part, error_fn=config.error_fn)


def gpt_batches(start: int, k: int) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.fold_in(jax.random.key(3), start), (k, 2, 9), 0, 11)
    return tokens[:, :, :-1], tokens[:, :, 1:]


def leaf_bytes(state) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """Every leaf as (path, dtype, shape, raw bytes); PRNG keys through their key data."""
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        dtype = str(leaf.dtype)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        host = np.asarray(jax.device_get(leaf))
        rows.append((jax.tree_util.keystr(path), dtype, host.shape, host.tobytes()))
    return rows


def snapshot(pipeline: fusedpc.FusedPipeline):
    return leaf_bytes(pipeline.state), pipeline.steps, pipeline.skipped_steps


def file_digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def rewrite(path, out, *, manifest=None, entries=None, drop=()):
    """Copy a checkpoint with a changed manifest / entries, as a valid zip (CRCs recomputed)."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            if name in drop:
                continue
            data = src.read(name)
            if name == "manifest.json" and manifest is not None:
                data = json.dumps(manifest(json.loads(data))).encode()
            if entries and name in entries:
                data = entries[name](data)
            dst.writestr(name, data)


def payload_offset(path, name: str) -> int:
    """Where entry `name`'s data starts in the file (after its local header)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


METADATA = {"which": "previous", "data_position": 3}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One pipeline trained 3 steps (compiled once for the module) and its checkpoint.

    Tests only read this pipeline (never step it or load into it)."""
    pipeline = mlp_pipeline()
    train(pipeline, 0, 3)
    path = tmp_path_factory.mktemp("trained") / "model.ckpt"
    pipeline.save(path, metadata=METADATA)
    return pipeline, path


@pytest.fixture
def saved(trained, tmp_path):
    """The trained pipeline and a private copy of its checkpoint, `tmp_path/model.ckpt`."""
    pipeline, source = trained
    path = tmp_path / "model.ckpt"
    shutil.copyfile(source, path)
    return pipeline, path


# --------------------------------------------------------------------------- round trips
def test_round_trip_is_bit_identical(saved):
    pipeline, path = saved
    other = fusedpc.FusedPipeline(mlp_tree(), key=jax.random.key(9))
    assert leaf_bytes(other.state) != leaf_bytes(pipeline.state)  # the load must do the work
    metadata = other.load(path)
    assert metadata == METADATA
    assert snapshot(other) == snapshot(pipeline)
    assert other.steps == 3 and other.skipped_steps == 0
    # the merged tree of the loaded pipeline is the saved pipeline's tree
    a, b = eqx.filter(other.merge(), eqx.is_array), eqx.filter(pipeline.merge(), eqx.is_array)
    assert leaf_bytes(a) == leaf_bytes(b)


def test_module_functions_match_the_methods(saved, tmp_path):
    pipeline, path = saved
    save_checkpoint(pipeline, tmp_path / "again.ckpt", METADATA)
    assert file_digest(tmp_path / "again.ckpt") == file_digest(path)
    other = mlp_pipeline()
    assert load_checkpoint(other, str(path))["data_position"] == 3
    assert snapshot(other) == snapshot(pipeline)


def test_manifest_fields(saved):
    pipeline, path = saved
    manifest = read_checkpoint_manifest(path, verify=True)
    assert manifest["format"] == "fusedpc-checkpoint"
    assert manifest["format_version"] == _checkpoint.SINGLE_FILE_VERSION  # no shard files
    assert manifest["library_version"] == fusedpc.__version__
    assert manifest["jax_version"] == jax.__version__
    assert (manifest["steps"], manifest["skipped_steps"]) == (3, 0)
    assert manifest["metadata"] == METADATA
    assert "SequentialState" in manifest["treedef"] and " at 0x" not in manifest["treedef"]
    paths = [r["path"] for r in manifest["leaves"]]
    leaves = jax.tree_util.tree_leaves_with_path(pipeline.state)
    assert paths == [jax.tree_util.keystr(p) for p, _ in leaves]
    first = manifest["leaves"][0]
    assert first["path"] == ".parts[0].params.weights[0]"
    assert (first["shape"], first["dtype"]) == ([8, 4], "float32")
    host = np.asarray(leaves[0][1])
    assert first["sha256"] == hashlib.sha256(host.tobytes()).hexdigest()


def test_resume_in_a_new_pipeline_equals_the_uninterrupted_run(tmp_path):
    straight = mlp_pipeline()
    losses = train(straight, 0, 5)
    straight.save(tmp_path / "half.ckpt", {"data_position": 5})  # saving disturbs nothing
    losses += train(straight, 5, 10)

    resumed = fusedpc.FusedPipeline(mlp_tree(), key=jax.random.key(4))
    position = resumed.load(tmp_path / "half.ckpt")["data_position"]
    assert resumed.steps == 5
    assert train(resumed, position, 10) == losses[5:]
    assert snapshot(resumed) == snapshot(straight)  # weights, optimiser state and counters


@pytest.mark.slow
def test_gpt_resume_with_run_equals_uninterrupted(tmp_path):
    pipeline = gpt_pipeline()
    pipeline.run(*gpt_batches(0, 3), keep_outputs=False)
    pipeline.save(tmp_path / "gpt.ckpt", {"config": {"width": 16}})
    at_save = snapshot(pipeline)
    _, _, straight = pipeline.run(*gpt_batches(3, 3), keep_outputs=False)
    straight_losses, straight_end = np.asarray(straight.loss).tobytes(), snapshot(pipeline)

    # a new pipeline of the same config (other initial weights) takes the checkpoint exactly
    fresh = gpt_pipeline(seed=5)
    assert fresh.load(tmp_path / "gpt.ckpt") == {"config": {"width": 16}}
    assert snapshot(fresh) == at_save
    # continuing from the checkpoint repeats the uninterrupted steps bit for bit (the same
    # pipeline, so the compiled run program is reused: a new one would compile it again)
    pipeline.load(tmp_path / "gpt.ckpt")
    assert pipeline.steps == 3
    _, _, resumed = pipeline.run(*gpt_batches(3, 3), keep_outputs=False)
    assert np.asarray(resumed.loss).tobytes() == straight_losses
    assert snapshot(pipeline) == straight_end
    assert pipeline.trace_counts["run"] == 1  # the loaded state did not force a retrace


class NoiseState(eqx.Module):
    key: jax.Array


class Noise(fusedpc.AbstractPart):
    """A test part whose state is a PRNG key, split at every step: y = x + scale * noise."""

    scale: float = eqx.field(static=True)

    def init_state(self, key):
        return NoiseState(key=jax.random.fold_in(key, 7))

    def compile(self, path):
        def forward(state, x, ctx):
            return x + self.scale * jax.random.normal(state.key, x.shape, x.dtype), None

        def backward(state, cache, error, ctx):
            new = NoiseState(key=jax.random.split(state.key)[0])
            return error, new, FiniteFlag(finite=jnp.all(jnp.isfinite(error)))

        return Core(forward, backward, lambda state: self)


def test_prng_key_leaves_round_trip_and_resume(tmp_path):
    def noisy():
        return fusedpc.FusedPipeline(fusedpc.Sequential([Noise(0.1), mlp_tree(frozen_tail=False)]))

    first = noisy()
    train(first, 0, 2)
    first.save(tmp_path / "keys.ckpt")
    at_save = snapshot(first)
    later_losses = train(first, 2, 4)
    straight_end = snapshot(first)
    manifest = read_checkpoint_manifest(tmp_path / "keys.ckpt")
    key_record = manifest["leaves"][0]
    assert key_record["path"] == ".parts[0].key"
    assert key_record["dtype"] == "key<fry>" and key_record["key_impl"] == "threefry2x32"

    resumed = fusedpc.FusedPipeline(
        fusedpc.Sequential([Noise(0.1), mlp_tree(frozen_tail=False)]),
        key=jax.random.key(8),
    )
    assert leaf_bytes(resumed.state)[0] != at_save[0][0]
    resumed.load(tmp_path / "keys.ckpt")
    assert jax.dtypes.issubdtype(resumed.state.parts[0].key.dtype, jax.dtypes.prng_key)
    assert snapshot(resumed) == at_save
    first.load(tmp_path / "keys.ckpt")  # the noise continues from the saved key
    assert train(first, 2, 4) == later_losses
    assert snapshot(first) == straight_end


class Holder:
    """The duck-typed pipeline surface the checkpoint functions use (no executor checks)."""

    def __init__(self, state, steps=0, skipped=0):
        self.state, self.steps, self.skipped_steps = state, steps, skipped

    @property
    def counters(self):
        return fusedpc.execution.Counters(jnp.int32(self.steps), jnp.int32(self.skipped_steps))

    def set_state(self, state, steps=0, skipped=0, *, counters=None):
        if counters is not None:
            steps, skipped = int(counters.steps), int(counters.skipped)
        self.state, self.steps, self.skipped_steps = state, steps, skipped


def test_bfloat16_bool_and_none_leaves_round_trip(tmp_path):
    state = {
        "half": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 7,
        "flags": jnp.array([True, False, True]),
        "nothing": None,
        "empty": jnp.zeros((0, 3), jnp.float32),
        "ids": jnp.arange(4, dtype=jnp.uint8),
    }
    save_checkpoint(Holder(state, 7, 2), tmp_path / "mixed.ckpt")
    target = Holder(jax.tree_util.tree_map(jnp.zeros_like, state))
    load_checkpoint(target, tmp_path / "mixed.ckpt")
    assert target.state["nothing"] is None
    assert leaf_bytes(target.state) == leaf_bytes(state)
    assert (target.steps, target.skipped_steps) == (7, 2)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: mlp_pipeline(hidden=16),
            "First difference: leaf .parts[0].params.weights[0]: this pipeline expects "
            "float32[16, 4], the checkpoint has float32[8, 4]",
        ),
        (
            lambda: mlp_pipeline(optimiser=optax.sgd(1e-2)),
            "First difference: the checkpoint has leaf .parts[0].opt_state[0].count (int32[]), "
            "this pipeline has no such leaf",
        ),
        (
            lambda: mlp_pipeline(frozen_tail=False),
            "First difference: this pipeline has leaf .params.weights[0] (float32[8, 4]), the "
            "checkpoint has no such leaf",
        ),
        (
            lambda: gpt_pipeline(),
            "First difference: this pipeline has leaf .token.table (float32[11, 16])",
        ),
    ],
    ids=["width", "optimiser", "structure", "gpt"],
)
def test_other_tree_is_refused_naming_the_first_difference(saved, make, expected):
    _, path = saved
    other = make()
    before = snapshot(other)
    with pytest.raises(CheckpointError, match="different tree") as info:
        other.load(path)
    assert expected in str(info.value)
    assert snapshot(other) == before


def test_gpt_of_another_depth_is_refused(tmp_path):
    pipeline = gpt_pipeline()
    pipeline.save(tmp_path / "gpt.ckpt")
    deeper = gpt_pipeline(GPT_CONFIG.__class__(**{**GPT_CONFIG.__dict__, "n_blocks": 3}))
    before = snapshot(deeper)
    with pytest.raises(CheckpointError) as info:
        deeper.load(tmp_path / "gpt.ckpt")
    assert (
        "leaf .blocks.blocks.n1.params.weight: this pipeline expects float32[3, 16], the "
        "checkpoint has float32[2, 16]" in str(info.value)
    )
    assert snapshot(deeper) == before


def test_same_leaves_in_another_structure_are_refused(tmp_path):
    class Pair(NamedTuple):
        a: jax.Array
        b: jax.Array

    class PairModule(eqx.Module):
        a: jax.Array
        b: jax.Array

    values = (jnp.zeros(3), jnp.ones(2))
    save_checkpoint(Holder(Pair(*values)), tmp_path / "pair.ckpt")
    target = Holder(PairModule(*values))  # the same key paths .a and .b, another node type
    with pytest.raises(CheckpointError, match="the leaves match but the tree structures differ"):
        load_checkpoint(target, tmp_path / "pair.ckpt")
    assert isinstance(target.state, PairModule)


def test_treedef_text_is_only_compared_under_the_same_jax_version(saved, tmp_path):
    _, path = saved
    pipeline = mlp_pipeline()

    def garble(m):
        return {**m, "treedef": m["treedef"].replace("SequentialState", "OtherState")}

    same = tmp_path / "same.ckpt"
    rewrite(path, same, manifest=garble)
    with pytest.raises(CheckpointError, match="OtherState"):
        pipeline.load(same)
    older = tmp_path / "older.ckpt"
    rewrite(path, older, manifest=lambda m: {**garble(m), "jax_version": "0.4.35"})
    assert pipeline.load(older) == METADATA  # the key paths still bind every leaf


@pytest.mark.parametrize("keep", [0, 10, 0.5, -22, -1])
def test_truncated_file_is_refused(saved, tmp_path, keep):
    _, path = saved
    pipeline = mlp_pipeline()  # a fresh target: refused loads must leave it as it is
    data = path.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    before = snapshot(pipeline)
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        pipeline.load(cut)
    assert snapshot(pipeline) == before


@pytest.mark.parametrize(
    "where", ["leaf payload", "manifest payload", "local header", "central directory"]
)
def test_corrupted_file_is_refused(saved, tmp_path, where):
    _, path = saved
    pipeline = mlp_pipeline()  # a fresh target: refused loads must leave it as it is
    data = bytearray(path.read_bytes())
    if where == "leaf payload":
        offset = payload_offset(path, "leaves/00001.bin") + 5
    elif where == "manifest payload":
        offset = payload_offset(path, "manifest.json") + 40
    elif where == "local header":
        offset = payload_offset(path, "leaves/00003.bin") - 20
    else:
        offset = data.rfind(b"PK\x01\x02") + 16  # the CRC-32 of the last entry
    data[offset] ^= 0xFF
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(bytes(data))
    before = snapshot(pipeline)
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        pipeline.load(bad)
    assert snapshot(pipeline) == before
    with pytest.raises(CheckpointError):
        read_checkpoint_manifest(bad, verify=True)


def test_no_single_byte_flip_loads_a_different_state(saved, tmp_path):
    """A flipped byte (sampled across the whole file) is refused, or lands in a header field
    that does not change what is loaded (a zip timestamp, say); none loads other values, and
    every flip inside an entry's data (leaves and manifest) is refused."""
    trained_pipeline, path = saved
    expected = snapshot(trained_pipeline)
    data = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        sizes = {info.filename: info.file_size for info in zf.infolist()}
    payload = set()
    for name, size in sizes.items():
        start = payload_offset(path, name)
        payload.update(range(start, start + size))
    target = mlp_pipeline()
    untouched = snapshot(target)
    bad = tmp_path / "bad.ckpt"
    refused = 0
    for offset in range(0, len(data), 23):
        flipped = bytearray(data)
        flipped[offset] ^= 0x5A
        bad.write_bytes(bytes(flipped))
        try:
            target.load(bad)
        except CheckpointError:
            refused += 1
            assert snapshot(target) == untouched, offset
        else:
            assert offset not in payload, f"a flip at {offset}, inside an entry, was loaded"
            assert snapshot(target) == expected, offset
            target = mlp_pipeline()
    assert refused >= len(payload.intersection(range(0, len(data), 23))) > 200


def test_checksum_mismatch_is_refused(saved, tmp_path):
    _, path = saved
    pipeline = mlp_pipeline()  # a fresh target: refused loads must leave it as it is
    bad = tmp_path / "bad.ckpt"
    # a valid zip whose leaf bytes were changed after the manifest was written
    rewrite(path, bad, entries={"leaves/00002.bin": lambda d: bytes(d[:-1]) + bytes([d[-1] ^ 1])})
    before = snapshot(pipeline)
    with pytest.raises(CheckpointError, match=r"leaf .parts\[0\].params.biases\[0\].*SHA-256"):
        pipeline.load(bad)
    assert snapshot(pipeline) == before
    read_checkpoint_manifest(bad)  # the manifest alone is fine ...
    with pytest.raises(CheckpointError, match="SHA-256"):
        read_checkpoint_manifest(bad, verify=True)  # ... the payload is not


def test_missing_leaf_entry_and_bad_manifest_are_refused(saved, tmp_path):
    _, path = saved
    pipeline = mlp_pipeline()  # a fresh target: refused loads must leave it as it is
    before = snapshot(pipeline)
    cases = {
        "missing leaf": dict(drop=("leaves/00004.bin",)),
        "no manifest": dict(drop=("manifest.json",)),
        "bad json": dict(entries={"manifest.json": lambda d: d[:-3]}),
        "bad table": dict(manifest=lambda m: {**m, "leaves": [{"path": 1}]}),
        # Crafted counters and a missing metadata entry are refused before anything is
        # replaced (they used to fail after the state was swapped in).
        "huge steps": dict(manifest=lambda m: {**m, "steps": 2**40}),
        "negative skipped": dict(manifest=lambda m: {**m, "skipped_steps": -1}),
        "more skipped than steps": dict(manifest=lambda m: {**m, "skipped_steps": 10**6}),
        "no metadata": dict(manifest=lambda m: {k: v for k, v in m.items() if k != "metadata"}),
    }
    messages = {
        "missing leaf": "missing from the container",
        "no manifest": "no manifest.json",
        "bad json": "not valid JSON",
        "bad table": "leaf table is malformed",
        "huge steps": r"'steps' is 1099511627776, not an integer in \[0, 2\*\*31\)",
        "negative skipped": r"'skipped_steps' is -1",
        "more skipped than steps": "skipped_steps 1000000 exceeds its steps",
        "no metadata": "has no 'metadata'",
    }
    for name, change in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.ckpt"
        rewrite(path, bad, **change)
        with pytest.raises(CheckpointError, match=messages[name]):
            pipeline.load(bad)
        assert snapshot(pipeline) == before, name


def test_newer_format_version_is_refused(saved, tmp_path):
    _, path = saved
    pipeline = mlp_pipeline()  # a fresh target: refused loads must leave it as it is
    newer = tmp_path / "newer.ckpt"
    rewrite(path, newer, manifest=lambda m: {**m, "format_version": FORMAT_VERSION + 1})
    with pytest.raises(CheckpointError, match=f"format version {FORMAT_VERSION + 1}.*Upgrade"):
        pipeline.load(newer)


def test_not_a_checkpoint_and_missing_file(tmp_path):
    pipeline = mlp_pipeline()
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        pipeline.load(tmp_path / "notes.txt")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("manifest.json", json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a fusedpc checkpoint"):
        pipeline.load(tmp_path / "other.zip")
    missing = tmp_path / "nowhere.ckpt"
    with pytest.raises(FileNotFoundError, match="nowhere.ckpt"):
        pipeline.load(missing)
    with pytest.raises(FileNotFoundError, match="nowhere.ckpt"):
        read_checkpoint_manifest(missing)


# --------------------------------------------------------------------------- faults while saving
KILL_SCRIPT = MLP_SOURCE + textwrap.dedent(
    """
    import sys, time, zipfile
    path, marker = sys.argv[1], sys.argv[2]
    pipeline = fusedpc.FusedPipeline(mlp_tree(seed=2))  # other values than the saved ones
    original = zipfile.ZipFile.writestr
    written = []

    def stalling_writestr(self, *args, **kwargs):
        original(self, *args, **kwargs)
        written.append(1)
        if len(written) == 3:  # three leaves are in the temporary file: stall mid-write
            self.fp.flush()
            open(marker, "w").close()
            time.sleep(600)

    zipfile.ZipFile.writestr = stalling_writestr
    pipeline.save(path, {"which": "killed"})
    """
)


@pytest.mark.slow
def test_killed_save_leaves_the_previous_checkpoint_intact(saved, tmp_path):
    pipeline, path = saved
    digest = file_digest(path)
    marker = tmp_path / "midway"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(path), str(marker)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the saving subprocess never reached mid-write"
            time.sleep(0.05)
        temporaries = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert len(temporaries) == 1 and temporaries[0].stat().st_size > 0  # half-written
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert file_digest(path) == digest  # the half-written file never replaced it
    resumed = mlp_pipeline()
    assert resumed.load(path) == {"which": "previous", "data_position": 3}
    assert snapshot(resumed) == snapshot(pipeline)
    # the leftover temporary file does not get in the way of the next save
    pipeline.save(path, {"which": "next"})
    assert read_checkpoint_manifest(path, verify=True)["metadata"] == {"which": "next"}


class FillingFile:
    """A file that runs out of space after `room` bytes (like a full disk)."""

    def __init__(self, file, room: int, error: BaseException):
        self._file, self._room, self._error = file, room, error

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._room:
            self._file.write(data[: self._room])
            self._room = 0
            raise self._error
        self._room -= len(data)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


@pytest.mark.parametrize(
    "fault",
    ["disk full while writing", "disk full at fsync", "Ctrl-C while writing", "rename fails"],
)
def test_failed_save_leaves_the_previous_checkpoint_intact(saved, monkeypatch, fault):
    _, path = saved
    digest = file_digest(path)
    pipeline = mlp_pipeline()  # untrained: other values than the checkpoint on disk
    full = OSError(errno.ENOSPC, "No space left on device")
    original = _checkpoint._open_for_writing
    if fault == "disk full while writing":
        monkeypatch.setattr(
            _checkpoint, "_open_for_writing", lambda p: FillingFile(original(p), 700, full)
        )
        raised = OSError
    elif fault == "Ctrl-C while writing":
        monkeypatch.setattr(
            _checkpoint,
            "_open_for_writing",
            lambda p: FillingFile(original(p), 700, KeyboardInterrupt()),
        )
        raised = KeyboardInterrupt
    elif fault == "disk full at fsync":

        def failing_fsync(fd):
            raise full

        monkeypatch.setattr(os, "fsync", failing_fsync)
        raised = OSError
    else:

        def failing_replace(src, dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "replace", failing_replace)
        raised = OSError
    with pytest.raises(raised) as info:
        pipeline.save(path, {"which": "failed"})
    monkeypatch.undo()
    if raised is OSError:
        assert info.value.errno in (errno.ENOSPC, errno.EXDEV)
    if fault.startswith("disk full"):  # Reliability III: the message names the file
        assert info.value.filename == os.fspath(path), info.value
        assert info.value.strerror.startswith("No space left on device while writing")
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left
    assert file_digest(path) == digest
    assert mlp_pipeline().load(path) == {"which": "previous", "data_position": 3}


def test_bad_metadata_and_bad_destination_write_nothing(tmp_path):
    pipeline = mlp_pipeline()
    with pytest.raises(TypeError, match="metadata must be JSON-serialisable"):
        pipeline.save(tmp_path / "a.ckpt", {"when": object()})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pipeline.save(tmp_path / "missing" / "a.ckpt")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        pipeline.save(tmp_path)
    assert list(tmp_path.iterdir()) == []
    pipeline.save(tmp_path / "np.ckpt", {"loss": np.float32(0.5), "step": np.int64(3)})
    assert read_checkpoint_manifest(tmp_path / "np.ckpt")["metadata"] == {"loss": 0.5, "step": 3}


# --------------------------------------------------------------------------- determinism
def test_saves_are_byte_identical(trained, tmp_path):
    one, _ = trained
    two = mlp_pipeline()  # a second, separate run of the same training
    train(two, 0, 3)
    one.save(tmp_path / "a.ckpt", {"config": {"seed": 0}, "data_position": 3})
    time.sleep(1.1)  # a zip timestamp taken from the clock would now differ
    one.save(tmp_path / "b.ckpt", {"config": {"seed": 0}, "data_position": 3})
    two.save(tmp_path / "c.ckpt", {"data_position": 3, "config": {"seed": 0}})
    digests = {file_digest(tmp_path / n) for n in ("a.ckpt", "b.ckpt", "c.ckpt")}
    assert len(digests) == 1
    mlp_pipeline().save(tmp_path / "d.ckpt", {"config": {"seed": 0}, "data_position": 3})
    assert file_digest(tmp_path / "d.ckpt") not in digests  # other values, other bytes


# --------------------------------------------------------------------------- devices
SHARDED_SCRIPT = MLP_SOURCE + textwrap.dedent(
    """
    import sys
    import numpy as np
    from jax.sharding import AxisType
    path = sys.argv[1]
    assert len(jax.devices()) == 2
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    x, t = jax.numpy.ones((4, 4)), jax.numpy.ones((4, 2))

    def values(p):
        return [np.asarray(jax.device_get(a)).tobytes() for a in jax.tree_util.tree_leaves(p.state)]

    def devices(p):
        return {len(a.sharding.device_set) for a in jax.tree_util.tree_leaves(p.state)}

    sharded = fusedpc.FusedPipeline(mlp_tree(seed=1), mesh=mesh)
    assert devices(sharded) == {2}
    sharded.save(path + ".sharded", {"steps": 0})
    single = fusedpc.FusedPipeline(mlp_tree(seed=2))
    assert values(single) != values(sharded)
    single.load(path + ".sharded")
    assert devices(single) == {1} and values(single) == values(sharded)
    single.save(path + ".single")
    again = fusedpc.FusedPipeline(mlp_tree(seed=3), mesh=mesh)
    again.load(path + ".single")
    assert devices(again) == {2} and values(again) == values(sharded)
    again.step(x, t)  # the loaded, replicated state trains
    assert again.steps == 1 and values(again) != values(sharded)
    print("OK")
    """
)


@pytest.mark.slow
def test_sharded_and_single_device_checkpoints_are_interchangeable(tmp_path):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


# --------------------------------------------------------------------------- older releases
V01 = {"ff_head": dict(learn="ff_head"), "none_tuple": dict(learn="none", scan=False)}
DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.mark.parametrize("name", sorted(V01))
@pytest.mark.slow
def test_a_release_01_checkpoint_with_frozen_parameters_loads(name):
    # Written by release 0.1 (data/make_v01_checkpoints.py): frozen parameters stored as
    # dicts in sorted key order (bias before weight) and the frozen LayerNorm's eps as a leaf.
    config = fusedpc.GPTConfig(
        vocab_size=11, width=16, n_heads=2, n_blocks=2, ff_width=32, max_len=8, **V01[name]
    )
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 11)

    def pipeline():
        part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
        return fusedpc.FusedPipeline(part, error_fn=config.error_fn)

    stepped = pipeline()  # the same build and step as the file's, on this release
    stepped.step(ids, ids)
    loaded = pipeline()
    metadata = loaded.load(os.path.join(DATA, f"v0.1_{name}.fpc"))
    assert metadata == {"made_by": "0.1.0"}
    assert loaded.steps == 1
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(loaded.state)]
    for path, a, b in zip(
        paths,
        jax.tree_util.tree_leaves(stepped.state),
        jax.tree_util.tree_leaves(loaded.state),
        strict=True,
    ):
        # Each leaf lands where it belongs (LayerNorm weights are ones, biases zeros: a swap
        # of the two would show): equal to the same step taken on this release. Tolerance: the
        # file was made at XLA's default optimisation level, this suite compiles at level 0,
        # whose random initialisation differs in the last bit (bit-equal at the default).
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7, err_msg=path)
    loaded.step(ids, ids)
    assert np.isfinite(loaded.last_loss)


def test_a_checkpoint_of_another_tree_is_still_refused_after_migration():
    config = fusedpc.GPTConfig(
        vocab_size=11, width=16, n_heads=2, n_blocks=3, ff_width=32, max_len=8, learn="ff_head"
    )
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(part, error_fn=config.error_fn)
    before = [np.asarray(leaf).copy() for leaf in jax.tree_util.tree_leaves(pipeline.state)]
    with pytest.raises(CheckpointError, match="different tree"):
        pipeline.load(os.path.join(DATA, "v0.1_ff_head.fpc"))
    for old, new in zip(before, jax.tree_util.tree_leaves(pipeline.state), strict=True):
        np.testing.assert_array_equal(old, np.asarray(new))
