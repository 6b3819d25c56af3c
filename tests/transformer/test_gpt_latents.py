"""A GPT whose boundaries are latents (`GPTConfig(latents=...)`, `with_latents`): the
structure, the unchanged feed-forward readout, and the exact regimes against the autodiff
twin (`make_backprop_step` on the reference GPT)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.transformer import with_latents
from fusedpc.transformer.reference import make_backprop_step

TINY = {"vocab_size": 11, "width": 16, "n_heads": 4, "n_blocks": 2, "ff_width": 32, "max_len": 8}
LR = 0.5
# the longest chain of latents in a 2-block GPT with latents="all": the final norm's, then
# per block feed-forward, second norm, attention, first norm, then the embedding's
CHAIN_ALL = 1 + 4 * TINY["n_blocks"] + 1


def _ids(seed, shape=(3, 8)):
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY["vocab_size"],
                              dtype=jnp.int32)


def _latents(part) -> int:
    if isinstance(part, fusedpc.Latent):
        return 1
    return sum(_latents(child) for _, child in part.children())


def _arrays(model):
    return [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(
        eqx.filter(model, eqx.is_array))]


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("at, count", [("blocks", 1 + TINY["n_blocks"]),
                                       ("all", 1 + 4 * TINY["n_blocks"] + 1)])
@pytest.mark.parametrize("scan", [True, False])
def test_latents_sit_where_asked_and_leave_the_readout_unchanged(at, count, scan):
    part, _ = fusedpc.build_gpt(fusedpc.GPTConfig(**TINY, scan=scan), optax.sgd(LR),
                                jax.random.key(0))
    latent = with_latents(part, at)
    assert _latents(latent) == count
    assert _latents(part) == 0
    ids = _ids(1)
    plain, relaxed = fusedpc.make_step(part), fusedpc.make_step(latent)
    np.testing.assert_array_equal(
        relaxed.predict(relaxed.init(jax.random.key(0)).state, ids),
        plain.predict(plain.init(jax.random.key(0)).state, ids))


def test_bad_latent_places_are_refused():
    part, _ = fusedpc.build_gpt(fusedpc.GPTConfig(**TINY), None, jax.random.key(0))
    with pytest.raises(ValueError, match="with_latents: at must be one of"):
        with_latents(part, "every")
    with pytest.raises(ValueError, match="GPTConfig.latents must be one of"):
        fusedpc.GPTConfig(**TINY, latents="every").validate()


def _deltas(config, relaxation, ids, targets):
    part, reference = fusedpc.build_gpt(config, optax.sgd(LR), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(part, config.error_fn, relaxation=relaxation)
    pipeline.step(ids, targets)
    assert pipeline.skipped_steps == 0
    new = fusedpc.to_reference(pipeline.merge(), reference)
    return [n - o for n, o in zip(_arrays(new), _arrays(reference))], reference


def _twin_deltas(reference, ids, targets):
    step = make_backprop_step(optax.sgd(LR))
    opt = optax.sgd(LR)
    old = _arrays(reference)
    model, _, _ = step(reference, opt.init(eqx.filter(reference, eqx.is_array)), ids, targets)
    return [n - o for n, o in zip(_arrays(model), old)]


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_every_boundary_a_latent_at_the_z_il_rate_is_the_backprop_step(scan):
    """Fixed prediction at rate 1/Pi after as many sweeps as the longest chain of latents:
    the step of the fully-PC GPT is the backprop step, no further from the autodiff twin
    than the exact single sweep is."""
    ids, targets = _ids(1), _ids(2)
    config = fusedpc.GPTConfig(**TINY, scan=scan, latents="all")
    relaxation = fusedpc.Relaxation(steps=CHAIN_ALL, rate=1.0, fixed_prediction=True)
    pc, reference = _deltas(config, relaxation, ids, targets)
    exact, _ = _deltas(fusedpc.GPTConfig(**TINY, scan=scan), None, ids, targets)
    twin = _twin_deltas(reference, ids, targets)
    pc_gap = _rel(np.concatenate([d.ravel() for d in pc]),
                  np.concatenate([d.ravel() for d in twin]))
    exact_gap = _rel(np.concatenate([d.ravel() for d in exact]),
                     np.concatenate([d.ravel() for d in twin]))
    assert pc_gap <= max(2 * exact_gap, 1e-5), (pc_gap, exact_gap)
    if not scan:
        return  # the control below once is enough (one compile less in the suite)
    # after two sweeps only the paths of at most two latents have carried the error
    short = fusedpc.Relaxation(steps=2, rate=1.0, fixed_prediction=True)
    early, _ = _deltas(config, short, ids, targets)
    assert _rel(np.concatenate([d.ravel() for d in early]),
                np.concatenate([d.ravel() for d in twin])) > 1e-2


@pytest.mark.slow
def test_fixed_prediction_on_a_gpt_converges_to_the_backprop_step_as_the_sweeps_grow():
    ids, targets = _ids(3), _ids(4)
    config = fusedpc.GPTConfig(**TINY, latents="all")
    gaps = []
    twin = None
    for steps in (8, 64):
        pc, reference = _deltas(config, fusedpc.Relaxation(steps=steps, rate=0.5,
                                                           fixed_prediction=True), ids, targets)
        twin = _twin_deltas(reference, ids, targets) if twin is None else twin
        gaps.append(_rel(np.concatenate([d.ravel() for d in pc]),
                         np.concatenate([d.ravel() for d in twin])))
    assert gaps[0] > 10 * gaps[1], gaps
    assert gaps[1] < 1e-4, gaps


@pytest.mark.slow
def test_the_fully_pc_gpt_relaxes_and_learns():
    """Standard relaxation on every boundary: the energy falls over the sweeps, each latent
    reports its energy, and a few steps lower the loss."""
    ids, targets = _ids(5, (4, 8)), _ids(6, (4, 8))
    config = fusedpc.GPTConfig(**TINY, latents="all")
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-2), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(
        part, config.error_fn, relaxation=fusedpc.Relaxation(steps=6, rate=0.2,
                                                             record_energy=True))
    losses = []
    for _ in range(15):
        pipeline.step(ids, targets)
        losses.append(pipeline.last_loss)
    rows = pipeline.report()
    relaxation = rows[-1]
    assert relaxation["part"] == "<relaxation>"
    assert relaxation["energy_after"] < relaxation["energy_before"]
    trajectory = relaxation["energy_trajectory"]
    assert len(trajectory) == 7 and trajectory[-1] < trajectory[0]
    latent_rows = [r for r in rows if "energy" in r]
    assert len(latent_rows) >= 3 and all(np.all(np.isfinite(r["energy"])) for r in latent_rows)
    assert losses[-1] < losses[0] - 0.2
