"""Predictive coding over the whole tree: `fusedpc.Latent` boundaries relaxed on one energy.

The references are written here with `jax.grad` of the energy over plain latents, in float64:
the library assembles the same updates from the parts' own forward and pullback walks. The
exact regimes (fixed prediction converging to backprop, the Z-IL rate) are checked against
an autodiff twin of the tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc import frozen
from fusedpc.core import StepContext
from fusedpc.core._metrics import report_rows

R, D_IN, D, D_OUT = 6, 4, 8, 3
LR = 0.05
LEARNED = ("W1", "b1", "V0", "c0", "V1", "c1")


def _arrays(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 10)
    n = jax.random.normal
    return {
        "W1": 0.5 * n(k[0], (D, D_IN)), "b1": 0.1 * n(k[1], (D,)),
        "W2": 0.4 * n(k[2], (D, D)), "b2": 0.1 * n(k[3], (D,)),
        "V0": 0.4 * n(k[4], (6, D)), "c0": 0.1 * n(k[5], (6,)),
        "V1": 0.4 * n(k[6], (D_OUT, 6)), "c1": 0.1 * n(k[7], (D_OUT,)),
        "x": n(k[8], (R, D_IN)), "t": n(k[9], (R, D_OUT)),
    }


def _hybrid(a, head: str = "gaussian", precisions=(1.0, 2.0), optimiser=None):
    """a learning linear, tanh, latent, a residual frozen MLP, latent, a learning 8-6-3
    network."""
    net = fusedpc.PCNetwork([D, 6, D_OUT], "tanh", head, weights=[a["V0"], a["V1"]],
                            biases=[a["c0"], a["c1"]])
    first = fusedpc.PCNetwork([D_IN, D], weights=[a["W1"]], biases=[a["b1"]])
    return fusedpc.Sequential([
        fusedpc.LearningNetwork(first, optax.sgd(LR)), frozen.tanh(),
        fusedpc.Latent(precisions[0]),
        fusedpc.Residual(fusedpc.Sequential([frozen.linear(a["W2"], a["b2"]), frozen.tanh()])),
        fusedpc.Latent(precisions[1]),
        fusedpc.LearningNetwork(net, optax.sgd(LR) if optimiser is None else optimiser),
    ])


HEADS = {
    "gaussian": ("squared", lambda y, t: 0.5 * jnp.sum((y - t) ** 2, -1), lambda z: z),
    "categorical": ("cross_entropy",
                    lambda y, t: -jnp.sum(t * jnp.log(y), -1), lambda z: jax.nn.softmax(z, -1)),
    "binary": ("sigmoid_cross_entropy",
               lambda y, t: -jnp.sum(t * jnp.log(y) + (1 - t) * jnp.log1p(-y), -1),
               jax.nn.sigmoid),
}


def _target(a, head: str):
    if head == "gaussian":
        return a["t"]
    if head == "categorical":
        return jax.nn.one_hot(jnp.arange(R) % D_OUT, D_OUT)
    return (a["t"] > 0).astype(jnp.float32)


def _reference(a, head, steps, rate, precisions=(1.0, 2.0), latent_optimiser=None,
               incremental=False):
    """Float64: the energy's gradient by `jax.grad`, `steps` descent steps on the latents
    from their feed-forward values, then the SGD step of the learning network from the
    energy's gradient at the relaxed latents. Returns the energy before each step and after
    the last, the new learned arrays (`LEARNED`), and the input error R dF/dx."""
    _, row_loss, squash = HEADS[head]
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):  # optax's counts
        p = {k: jnp.asarray(v, jnp.float64) for k, v in a.items()}
        t = jnp.asarray(_target(a, head), jnp.float64)

        def mu1(p, x):
            return jnp.tanh(x @ p["W1"].T + p["b1"])

        def mu2(p, z1):
            return z1 + jnp.tanh(z1 @ p["W2"].T + p["b2"])

        def out(p, z2):
            return squash(jnp.tanh(z2 @ p["V0"].T + p["c0"]) @ p["V1"].T + p["c1"])

        def energy(z, p, x):
            z1, z2 = z
            e1 = 0.5 * precisions[0] * jnp.sum((z1 - mu1(p, x)) ** 2)
            e2 = 0.5 * precisions[1] * jnp.sum((z2 - mu2(p, z1)) ** 2)
            return (e1 + e2 + jnp.sum(row_loss(out(p, z2), t))) / R

        z1 = mu1(p, p["x"])
        z = (z1, mu2(p, z1))
        opt = latent_optimiser
        opt_state = None if opt is None else opt.init(z)
        trajectory = []
        for sweep in range(steps):
            trajectory.append(float(energy(z, p, p["x"])))
            g = jax.tree_util.tree_map(lambda v: R * v, jax.grad(energy)(z, p, p["x"]))
            if incremental and sweep > 0:  # the weights step too, from the same point
                step = jax.grad(energy, argnums=1)(z, p, p["x"])
                p = {k: v - LR * step[k] if k in LEARNED else v for k, v in p.items()}
            if opt is None:
                z = jax.tree_util.tree_map(lambda v, d: v - rate * d, z, g)
            else:
                updates, opt_state = opt.update(g, opt_state, z)
                z = optax.apply_updates(z, updates)
        trajectory.append(float(energy(z, p, p["x"])))
        grads = jax.grad(energy, argnums=1)(z, p, p["x"])
        new = [np.asarray(p[k] - LR * grads[k]) for k in LEARNED]
        input_error = np.asarray(R * jax.grad(energy, argnums=2)(z, p, p["x"]))
    return np.asarray(trajectory), new, input_error


def _run(a, head, relaxation, **tree_options):
    tree = _hybrid(a, head, **tree_options)
    program = fusedpc.make_step(tree, HEADS[head][0], relaxation=relaxation)
    carry = program.init(jax.random.key(0))
    return jax.jit(program.step)(carry, a["x"], _target(a, head))


def _network_state(carry):
    first, last = carry.state.parts[0].params, carry.state.parts[5].params
    return [first.weights[0], first.biases[0], last.weights[0], last.biases[0],
            last.weights[1], last.biases[1]]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("head", ["gaussian", "categorical", "binary"])
def test_the_relaxation_and_the_learning_step_match_jax_grad_of_the_energy(head):
    a = _arrays()
    relaxation = fusedpc.Relaxation(steps=6, rate=0.2, record_energy=True)
    carry, out = _run(a, head, relaxation)
    trajectory, new, input_error = _reference(a, head, 6, 0.2)
    report = out.metrics.relaxation
    assert bool(out.metrics.committed)
    np.testing.assert_allclose(report.energy_trajectory, trajectory, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(report.energy_before, trajectory[0], rtol=2e-5)
    np.testing.assert_allclose(report.energy_after, trajectory[-1], rtol=2e-5)
    assert trajectory[-1] < trajectory[0]  # the relaxation lowers the energy
    for got, want in zip(_network_state(carry), new):
        assert _rel(got, want) < 1e-5
    assert _rel(out.input_error, input_error) < 1e-5


def test_per_latent_energies_and_trajectories_are_reported():
    a = _arrays()
    carry, out = _run(a, "gaussian", fusedpc.Relaxation(steps=4, rate=0.2, record_energy=True))
    rows = {r["part"]: r for r in report_rows(out.metrics.parts)}
    latents = [rows["parts[2]"], rows["parts[4]"]]
    for row in latents:
        assert row["energy_trajectory"][0] == 0.0  # the latents start at their predictions
        assert len(row["energy_trajectory"]) == 5
        assert row["energy"] == pytest.approx(row["energy_trajectory"][-1])
    total = sum(r["energy"] for r in latents)
    report = out.metrics.relaxation
    loss_after = float(report.energy_after) - total
    assert loss_after < float(report.energy_before)  # the output's loss came down


@pytest.mark.slow
def test_an_optax_optimiser_over_the_latents_matches_its_reference():
    a = _arrays(1)
    opt = optax.adam(0.05)
    relaxation = fusedpc.Relaxation(steps=5, optimiser=opt, record_energy=True)
    carry, out = _run(a, "gaussian", relaxation)
    trajectory, new, _ = _reference(a, "gaussian", 5, None, latent_optimiser=opt)
    np.testing.assert_allclose(out.metrics.relaxation.energy_trajectory, trajectory,
                               rtol=2e-5, atol=1e-6)
    for got, want in zip(_network_state(carry), new):
        assert _rel(got, want) < 1e-5


def test_precisions_weigh_each_latent():
    a = _arrays(2)
    relaxation = fusedpc.Relaxation(steps=4, rate=0.1, record_energy=True)
    carry, out = _run(a, "gaussian", relaxation, precisions=(0.5, 3.0))
    trajectory, new, _ = _reference(a, "gaussian", 4, 0.1, precisions=(0.5, 3.0))
    np.testing.assert_allclose(out.metrics.relaxation.energy_trajectory, trajectory,
                               rtol=2e-5, atol=1e-6)
    _, other = _run(a, "gaussian", relaxation)
    assert not np.allclose(other.metrics.relaxation.energy_trajectory, trajectory)


def _backprop_twin(a):
    """Float32 and float64 SGD steps of the same network by `jax.grad` of the loss."""
    def loss(p, x, t):
        h = jnp.tanh(x @ p["W1"].T + p["b1"])
        h = h + jnp.tanh(h @ p["W2"].T + p["b2"])
        y = jnp.tanh(h @ p["V0"].T + p["c0"]) @ p["V1"].T + p["c1"]
        return jnp.mean(0.5 * jnp.sum((y - t) ** 2, -1))

    out = {}
    for name, dtype in (("float32", jnp.float32), ("float64", jnp.float64)):
        with jax.enable_x64(dtype == jnp.float64):
            p = {k: jnp.asarray(v, dtype) for k, v in a.items()}
            g = jax.grad(loss)(p, p["x"], p["t"])
            out[name] = [np.asarray(p[k] - LR * g[k]) for k in LEARNED]
    return out


@pytest.mark.slow
def test_fixed_prediction_converges_to_the_backprop_step_as_the_sweeps_grow():
    a = _arrays(3)
    twin = _backprop_twin(a)["float64"]
    gaps = []
    for steps in (2, 16, 96):
        carry, _ = _run(a, "gaussian",
                        fusedpc.Relaxation(steps=steps, rate=0.3, fixed_prediction=True))
        gaps.append(max(_rel(g, w) for g, w in zip(_network_state(carry), twin)))
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 1e-5, gaps


@pytest.mark.slow
def test_the_z_il_rate_gives_the_backprop_step_to_the_float32_floor():
    """Fixed prediction at rate 1/Pi: exact after as many sweeps as latents (here 2), so
    one step is the backprop step, no further from the float64 twin than float32 backprop."""
    a = _arrays(4)
    twins = _backprop_twin(a)
    carry, out = _run(a, "gaussian", fusedpc.Relaxation(steps=2, rate=1.0, fixed_prediction=True),
                      precisions=(1.0, 1.0))
    for got, f32, f64 in zip(_network_state(carry), twins["float32"], twins["float64"]):
        assert _rel(got, f64) <= max(2 * _rel(f32, f64), 1e-6)


def test_the_backprop_distance_is_reported_and_shrinks_under_fixed_prediction():
    a = _arrays(5)
    far = _run(a, "gaussian", fusedpc.Relaxation(steps=1, rate=0.3, fixed_prediction=True,
                                                  backprop_distance=True))[1]
    near = _run(a, "gaussian", fusedpc.Relaxation(steps=64, rate=0.3, fixed_prediction=True,
                                                   backprop_distance=True))[1]
    far_d = float(far.metrics.relaxation.backprop_distance)
    near_d = float(near.metrics.relaxation.backprop_distance)
    assert near_d < 1e-4 < far_d


@pytest.mark.slow
def test_a_mask_relaxes_each_row_on_its_own_and_learns_from_the_real_rows():
    a = _arrays(6)
    relaxation = fusedpc.Relaxation(steps=5, rate=0.2)
    tree = _hybrid(a)
    program = fusedpc.make_step(tree, "squared", relaxation=relaxation)
    mask = jnp.array([1, 1, 1, 1, 0, 0], jnp.float32)
    garbage_x = a["x"].at[4:].set(7.0)
    carry, out = jax.jit(program.step)(program.init(jax.random.key(0)), garbage_x, a["t"], mask)
    real = {**a, "x": a["x"][:4], "t": a["t"][:4]}
    program4 = fusedpc.make_step(_hybrid(a), "squared", relaxation=relaxation)
    carry4, _ = jax.jit(program4.step)(program4.init(jax.random.key(0)), real["x"], real["t"])
    for got, want in zip(_network_state(carry), _network_state(carry4)):
        assert _rel(got, want) < 1e-5


@pytest.mark.slow
def test_run_equals_k_steps():
    a = _arrays(7)
    program = fusedpc.make_step(_hybrid(a), "squared", relaxation=fusedpc.Relaxation(steps=3))
    xs = jnp.stack([a["x"], -a["x"], 0.5 * a["x"]])
    ts = jnp.stack([a["t"], a["t"], -a["t"]])
    carry = program.init(jax.random.key(0))
    ran, _ = jax.jit(program.run)(carry, xs, ts)
    stepped = program.init(jax.random.key(0))
    for x, t in zip(xs, ts):
        stepped, _ = jax.jit(program.step)(stepped, x, t)
    for got, want in zip(_network_state(ran), _network_state(stepped)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_the_guard_keeps_the_state_when_a_latent_goes_non_finite():
    a = _arrays(8)
    pipeline = fusedpc.FusedPipeline(_hybrid(a), "squared",
                                     relaxation=fusedpc.Relaxation(steps=3, rate=1e30))
    before = [np.array(v) for v in _network_state(pipeline.carry)]
    pipeline.step(a["x"], a["t"])
    assert pipeline.skipped_steps == 1
    # the learning network fed the overflowing latent is the first part, backward
    assert pipeline.nonfinite_part() == "parts[5]"
    for got, want in zip(_network_state(pipeline.carry), before):
        np.testing.assert_array_equal(got, want)


def test_without_relaxation_a_latent_is_the_identity():
    a = _arrays()
    tree = _hybrid(a)
    plain = fusedpc.Sequential([p for p in tree.parts if not isinstance(p, fusedpc.Latent)])
    program = fusedpc.make_step(tree, "squared")
    assert program.relaxation == fusedpc.Relaxation()  # a tree with latents relaxes
    np.testing.assert_array_equal(program.predict(program.init(jax.random.key(0)).state, a["x"]),
                                  fusedpc.make_step(plain).predict(
                                      fusedpc.make_step(plain).init(jax.random.key(0)).state,
                                      a["x"]))


def test_a_pullback_that_does_not_learn_steps_no_optimiser():
    ctx = StepContext(learning=False)
    params = {"w": jnp.ones(3)}
    opt = optax.sgd(1.0)
    new, state = ctx.optimiser_step(opt, params, {"w": jnp.ones(3)}, opt.init(params))
    np.testing.assert_array_equal(new["w"], params["w"])


@pytest.mark.parametrize("bad, message", [
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"steps": 2.5}, "steps must be an integer >= 1"),
    ({"rate": 0.0}, "rate must be a finite number > 0"),
    ({"rate": float("nan")}, "rate must be a finite number > 0"),
    ({"optimiser": "adam"}, "optimiser must be an optax GradientTransformation"),
])
def test_bad_relaxation_settings_name_the_field(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        fusedpc.Relaxation(**bad)


def test_bad_uses_are_refused_with_the_argument_named():
    a = _arrays()
    plain = fusedpc.Sequential([frozen.linear(a["W1"], a["b1"])])
    with pytest.raises(ValueError, match="relaxation: the tree has no fusedpc.Latent"):
        fusedpc.make_step(plain, relaxation=fusedpc.Relaxation())
    with pytest.raises(TypeError, match="relaxation: expected a fusedpc.Relaxation"):
        fusedpc.make_step(_hybrid(a), relaxation={"steps": 3})
    with pytest.raises(ValueError, match="error_normalisation: 'active'"):
        fusedpc.make_step(_hybrid(a), error_normalisation="active")
    with pytest.raises(ValueError, match="Latent: precision must be a finite number > 0"):
        fusedpc.Latent(0.0)


def test_a_checkpoint_of_a_relaxing_tree_resumes_bit_for_bit(tmp_path):
    a = _arrays(9)
    relaxation = fusedpc.Relaxation(steps=3, rate=0.2)
    xs = [a["x"], -a["x"], 0.5 * a["x"], a["x"] + 1.0]

    def pipeline():
        return fusedpc.FusedPipeline(_hybrid(a, optimiser=optax.adam(1e-2)), "squared",
                                     relaxation=relaxation)

    straight = pipeline()
    for x in xs:
        straight.step(x, a["t"])
    first = pipeline()
    for x in xs[:2]:
        first.step(x, a["t"])
    first.save(str(tmp_path / "run.fpc"))
    resumed = pipeline()
    resumed.load(str(tmp_path / "run.fpc"))
    for x in xs[2:]:
        resumed.step(x, a["t"])
    for got, want in zip(jax.tree_util.tree_leaves(resumed.state),
                         jax.tree_util.tree_leaves(straight.state), strict=True):
        np.testing.assert_array_equal(got, want)
    assert resumed.steps == straight.steps == 4


def test_the_docs_example_runs_and_its_relaxation_lowers_the_energy(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "tree-pc.md").read_text()
    match = re.search(r"<!-- example: tree-pc -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/tree-pc.md lost its `<!-- example: tree-pc -->` code block"
    namespace: dict = {}
    exec(compile(match.group(1), "docs/tree-pc.md", "exec"), namespace)  # noqa: S102
    relaxation = namespace["relaxation"]
    assert relaxation["part"] == "<relaxation>"
    assert relaxation["energy_after"] < relaxation["energy_before"]
    assert sum("energy" in row for row in namespace["parts"]) == 2  # the two latents
    assert "energy" in capsys.readouterr().out


@pytest.mark.slow
def test_adaptive_inference_stops_when_the_energy_settles_and_equals_that_many_sweeps():
    a = _arrays(10)
    settled = fusedpc.Relaxation(steps=40, rate=0.05, tolerance=0.0095, record_energy=True)
    carry, out = _run(a, "gaussian", settled)
    taken = int(out.metrics.relaxation.steps)
    assert 1 < taken < 40
    trajectory = np.asarray(out.metrics.relaxation.energy_trajectory)
    assert np.all(np.isnan(trajectory[taken:-1])) and np.all(np.isfinite(trajectory[:taken]))
    change = abs(trajectory[taken - 1] - trajectory[taken - 2]) / abs(trajectory[taken - 2])
    assert change < 0.0095  # it stopped after the first sweep that settled ...
    earlier = np.abs(np.diff(trajectory[:taken - 1])) / np.abs(trajectory[:taken - 2])
    assert np.all(earlier >= 0.0095)  # ... and not before
    fixed_carry, fixed_out = _run(a, "gaussian", fusedpc.Relaxation(steps=taken, rate=0.05))
    for got, want in zip(_network_state(carry), _network_state(fixed_carry)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert int(fixed_out.metrics.relaxation.steps) == taken


@pytest.mark.slow
def test_adaptive_inference_at_its_maximum_is_the_fixed_sweeps():
    a = _arrays(11)
    carry, out = _run(a, "gaussian", fusedpc.Relaxation(steps=5, rate=0.2, tolerance=1e-30))
    fixed, _ = _run(a, "gaussian", fusedpc.Relaxation(steps=5, rate=0.2))
    assert int(out.metrics.relaxation.steps) == 5
    for got, want in zip(_network_state(carry), _network_state(fixed)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_adaptive_inference_needs_a_loss_and_a_positive_tolerance():
    a = _arrays()
    with pytest.raises(ValueError, match="a tolerance stops on the energy, which needs the loss"):
        fusedpc.make_step(_hybrid(a), lambda y, t: y - t,
                          relaxation=fusedpc.Relaxation(tolerance=1e-3))
    with pytest.raises(ValueError, match="tolerance must be None or a finite number > 0"):
        fusedpc.Relaxation(tolerance=0.0)


@pytest.mark.slow
def test_incremental_relaxation_steps_the_weights_at_every_sweep_as_its_reference():
    a = _arrays(12)
    relaxation = fusedpc.Relaxation(steps=5, rate=0.2, incremental=True, record_energy=True)
    carry, out = _run(a, "gaussian", relaxation)
    trajectory, new, _ = _reference(a, "gaussian", 5, 0.2, incremental=True)
    np.testing.assert_allclose(out.metrics.relaxation.energy_trajectory, trajectory,
                               rtol=2e-5, atol=1e-6)
    for got, want in zip(_network_state(carry), new):
        assert _rel(got, want) < 1e-5
    standard, _ = _run(a, "gaussian", fusedpc.Relaxation(steps=5, rate=0.2))
    assert max(_rel(g, w) for g, w in zip(_network_state(carry), _network_state(standard))) > 1e-3


def test_incremental_relaxation_of_one_sweep_is_the_standard_one():
    a = _arrays(13)
    carry, _ = _run(a, "gaussian", fusedpc.Relaxation(steps=1, incremental=True))
    standard, _ = _run(a, "gaussian", fusedpc.Relaxation(steps=1))
    for got, want in zip(_network_state(carry), _network_state(standard)):
        np.testing.assert_array_equal(got, want)


def test_incremental_relaxation_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="incremental learns at every sweep"):
        fusedpc.Relaxation(incremental=True, fixed_prediction=True)
    with pytest.raises(ValueError, match="incremental learns at every sweep"):
        fusedpc.Relaxation(incremental=True, tolerance=1e-3)
    a = _arrays()
    program = fusedpc.make_step(_hybrid(a), "squared",
                                relaxation=fusedpc.Relaxation(steps=2, incremental=True))
    with pytest.raises(ValueError, match="mask: an incremental relaxation"):
        program.step(program.init(jax.random.key(0)), a["x"], a["t"], jnp.ones(R))
