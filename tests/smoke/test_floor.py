"""A quick smoke subset that .ci/run also runs on the oldest supported versions (the floors in
pyproject.toml, pinned in a fresh environment): import, a step, `run` equal to K steps bit for
bit, a checkpoint round trip, a GPT's steps and resume, and a data-parallel step on emulated
CPU devices. Public API only; a few seconds on any supported jax."""

from __future__ import annotations

import json
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc import frozen


def _tree(seed: int = 0) -> fusedpc.Sequential:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return fusedpc.Sequential([
        frozen.layer_norm(width=4),
        fusedpc.Residual(fusedpc.LearningNetwork(
            fusedpc.PCNetwork([4, 8, 4], "tanh", key=k1), optimiser=optax.adam(1e-2))),
        frozen.linear(eqx.nn.Linear(4, 2, key=k2)),
    ])


def _batches(k: int, rows: int = 6, same: bool = False) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (1 if same else k, rows, 4))
    x = jnp.broadcast_to(x, (k, rows, 4))
    return x, jnp.stack([jnp.sin(x[..., 0]), x[..., 1] * x[..., 2]], axis=-1)


def _bytes(state) -> list[bytes]:
    leaves = []
    for leaf in jax.tree_util.tree_leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        leaves.append(np.asarray(jax.device_get(leaf)).tobytes())
    return leaves


def test_import_and_version():
    assert isinstance(fusedpc.__version__, str) and fusedpc.__version__
    assert callable(fusedpc.FusedPipeline)


@pytest.mark.slow
def test_steps_learn_and_run_equals_the_same_steps_bit_for_bit():
    xs, ys = _batches(4, same=True)  # one batch again and again: its loss must fall
    stepped = fusedpc.FusedPipeline(_tree())
    losses = []
    for i in range(4):
        out, input_error = stepped.step(xs[i], ys[i])
        losses.append(stepped.last_loss)
    assert out.shape == (6, 2) and input_error.shape == (6, 4)
    assert losses[-1] < losses[0]

    scanned = fusedpc.FusedPipeline(_tree())
    outs, _, metrics = scanned.run(xs, ys)
    assert outs.shape == (4, 6, 2)
    assert np.asarray(metrics.loss).tolist() == [float(v) for v in losses]
    assert _bytes(scanned.state) == _bytes(stepped.state)
    assert scanned.steps == stepped.steps == 4


def test_a_skipped_inner_step_of_run_leaves_the_state_bit_for_bit():
    # run(3 batches, the second poisoned) == step(first), step(third), bit for bit: the
    # transactional guard inside the scan (on jax 0.6 a frozen weight came back 1 ulp off)
    def tree() -> fusedpc.Sequential:
        k1, k2 = jax.random.split(jax.random.key(2))
        return fusedpc.Sequential([
            frozen.linear(eqx.nn.Linear(4, 4, key=k1)),
            frozen.tanh(),
            fusedpc.LearningNetwork(fusedpc.PCNetwork([4, 5, 3], "tanh", key=k2),
                                    optimiser=optax.sgd(0.05)),
            frozen.layer_norm(width=3),
        ])

    xs = jax.random.normal(jax.random.key(10), (3, 6, 4))
    targets = jax.random.normal(jax.random.key(11), (3, 6, 3))
    scanned = fusedpc.FusedPipeline(tree())
    _, _, metrics = scanned.run(xs.at[1, 0, 0].set(jnp.nan), targets)
    assert np.asarray(metrics.committed).tolist() == [True, False, True]
    assert (scanned.steps, scanned.skipped_steps) == (3, 1)
    stepped = fusedpc.FusedPipeline(tree())
    stepped.step(xs[0], targets[0])
    stepped.step(xs[2], targets[2])
    assert _bytes(scanned.state) == _bytes(stepped.state)


def test_checkpoint_round_trip_is_bit_identical(tmp_path):
    xs, ys = _batches(3)
    pipeline = fusedpc.FusedPipeline(_tree())
    pipeline.run(xs, ys)
    pipeline.save(str(tmp_path / "a.ckpt"), {"note": "smoke"})
    other = fusedpc.FusedPipeline(_tree(seed=7))
    assert _bytes(other.state) != _bytes(pipeline.state)
    assert other.load(str(tmp_path / "a.ckpt")) == {"note": "smoke"}
    assert _bytes(other.state) == _bytes(pipeline.state) and other.steps == 3
    manifest = fusedpc.read_checkpoint_manifest(str(tmp_path / "a.ckpt"), verify=True)
    assert manifest["jax_version"] == jax.__version__


@pytest.mark.slow
def test_gpt_steps_and_resume_from_a_checkpoint(tmp_path):
    config = fusedpc.GPTConfig(vocab_size=11, width=16, n_heads=2, n_blocks=2, ff_width=32,
                               max_len=8)

    def pipeline(seed: int) -> fusedpc.FusedPipeline:
        part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(seed))
        return fusedpc.FusedPipeline(part, error_fn=config.error_fn)

    tokens = jax.random.randint(jax.random.key(3), (4, 2, 9), 0, 11)
    inputs, targets = tokens[:, :, :-1], tokens[:, :, 1:]
    gpt = pipeline(0)
    logits, _ = gpt.step(inputs[0], targets[0])
    assert logits.shape == (2, 8, 11) and np.isfinite(gpt.last_loss)
    gpt.save(str(tmp_path / "gpt.ckpt"))
    _, _, straight = gpt.run(inputs[1:], targets[1:], keep_outputs=False)

    resumed = pipeline(5)
    resumed.load(str(tmp_path / "gpt.ckpt"))
    _, _, again = resumed.run(inputs[1:], targets[1:], keep_outputs=False)
    assert np.asarray(again.loss).tobytes() == np.asarray(straight.loss).tobytes()
    assert _bytes(resumed.state) == _bytes(gpt.state)


_SHARDED = """
import json
import fusedpc.training
fusedpc.training.emulate_cpu_devices(2)
import jax, optax
import fusedpc
from fusedpc import frozen
import equinox as eqx
k1, k2 = jax.random.split(jax.random.key(0))
def tree():
    return fusedpc.Sequential([
        fusedpc.LearningNetwork(fusedpc.PCNetwork([4, 8, 4], "tanh", key=k1),
                                optimiser=optax.sgd(0.1)),
        frozen.linear(eqx.nn.Linear(4, 2, key=k2)),
    ])
x = jax.random.normal(jax.random.key(1), (8, 4))
y = x[:, :2] * 0.5
sharded = fusedpc.FusedPipeline(tree(), mesh=fusedpc.data_mesh(2))
single = fusedpc.FusedPipeline(tree())
for _ in range(2):
    sharded.step(x, y)
    single.step(x, y)
print(json.dumps({"devices": jax.device_count(), "close": bool(jax.tree_util.tree_all(
    jax.tree_util.tree_map(lambda a, b: bool(abs(a - b).max() <= 1e-5),
                           jax.device_get(sharded.state), jax.device_get(single.state))))}))
"""


@pytest.mark.slow
def test_data_parallel_step_on_two_emulated_cpu_devices():
    env_python = [sys.executable, "-c", _SHARDED]
    result = subprocess.run(env_python, capture_output=True, text=True, timeout=300, check=False,
                            env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"devices": 2, "close": True}
