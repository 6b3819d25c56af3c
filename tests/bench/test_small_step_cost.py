"""scripts/small_step_cost.py at one round: every variant of the MLP is timed and counted."""

import json

import pytest
from helpers import load_script


@pytest.mark.slow
def test_every_variant_is_timed_and_its_kernels_counted(capsys):
    script = load_script("small_step_cost")
    script.main(["--models", "mlp", "--rounds", "1", "--calls", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    assert [r["variant"] for r in rows] == ["fused", "fused_no_reports", "fused_no_guard",
                                            "fused_bare", "fused_flat_moments", "twin"]
    by = {r["variant"]: r for r in rows}
    assert by["twin"]["vs_twin"] == 1.0
    for row in rows:
        assert row["step_ms"] > 0 and 0 < row["distinct_fusions"] <= row["fusions"]
    # switching a piece off removes its kernels from the program
    assert by["fused_bare"]["fusions"] < by["fused_no_reports"]["fusions"] < by["fused"]["fusions"]
    assert by["fused_no_guard"]["fusions"] < by["fused"]["fusions"]
    assert by["fused_flat_moments"]["fusions"] < by["fused"]["fusions"]


def test_flat_moments_train_as_adam_does_to_float32_rounding():
    # optax.flatten(adam): the same elementwise update over one vector per moment; XLA fuses
    # it otherwise, so the weights agree to rounding, not bit for bit
    import jax
    import numpy as np

    import fusedpc

    script = load_script("small_step_cost")
    x = jax.random.normal(jax.random.key(0), (64, 64))
    y = jax.nn.one_hot(jax.random.randint(jax.random.key(1), (64,), 0, 10), 10)
    network = fusedpc.PCNetwork(script.MLP_SIZES, "tanh", key=jax.random.key(2))
    weights = []
    for optimiser in (script.ADAM, script.FLAT_ADAM):
        pipeline = fusedpc.FusedPipeline(fusedpc.LearningNetwork(network, optimiser))
        for _ in range(5):
            pipeline.step(x, y)
        weights.append([np.asarray(w) for w in pipeline.merge().network.weights])
    moved = max(float(np.max(np.abs(w - np.asarray(w0))))
                for w, w0 in zip(weights[0], network.weights))
    assert moved > 1e-3
    for a, b in zip(*weights):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
