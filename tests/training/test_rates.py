"""Rate multipliers in the optimiser state and calibration by probes (the library side;
`fusedpc train --calibrate` end to end: tests/cli/test_cli.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.training import (
    RateMultiplierState,
    choose_factors,
    make_optimiser,
    probe_rates,
    rate_multipliers,
    set_rate_multipliers,
    with_rate_multiplier,
)
from fusedpc.training import data as fdata

CONFIG = fusedpc.GPTConfig(vocab_size=32, width=16, n_heads=2, n_blocks=1, ff_width=32,
                           max_len=16)


def _pipeline(optimiser, slot_optimisers=None, seed=0):
    part, _ = fusedpc.build_gpt(CONFIG, optimiser, jax.random.key(seed),
                                slot_optimisers=slot_optimisers)
    return fusedpc.FusedPipeline(part, CONFIG.error_fn, key=jax.random.key(seed))


def _batches(n, seed=0):
    ids = np.random.default_rng(seed).integers(0, 32, 4000).astype(np.int32)
    ids[1::2] = (ids[::2] * 3 + 1) % 32  # something to learn
    return fdata.BatchIterator(ids, 8, 16, seed=seed).next_batches(n)


def _params(pipeline):
    """Every state leaf but the multipliers (weights and optimiser moments) as one float64
    vector."""
    leaves = jax.tree_util.tree_leaves(
        pipeline.state, is_leaf=lambda n: isinstance(n, RateMultiplierState))
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in leaves
                           if not isinstance(a, RateMultiplierState)])


# ------------------------------------------------------------------ the multiplier itself
@pytest.mark.slow
def test_multiplier_one_leaves_every_update_bit_for_bit():
    xs, ys = _batches(6)
    plain = _pipeline(make_optimiser("adam", 3e-3))
    scaled = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    _, _, a = plain.run(xs, ys, keep_outputs=False)
    _, _, b = scaled.run(xs, ys, keep_outputs=False)
    np.testing.assert_array_equal(np.asarray(a.loss), np.asarray(b.loss))
    np.testing.assert_array_equal(_params(plain), _params(scaled))


@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.slow
def test_a_multiplier_is_the_optimiser_at_that_multiple_of_its_rate(name):
    xs, ys = _batches(5)
    rate = 0.05 if name == "sgd" else 3e-3
    reference = _pipeline(make_optimiser(name, rate * 0.25))
    scaled = _pipeline(with_rate_multiplier(make_optimiser(name, rate)))
    scaled.set_state(set_rate_multipliers(scaled.state, dict.fromkeys(
        rate_multipliers(scaled.state), 0.25)))
    reference.run(xs, ys, keep_outputs=False)
    scaled.run(xs, ys, keep_outputs=False)
    # rtol 1e-5: (rate * u) * m against (rate * m) * u round differently in the last bits,
    # and five steps carry it on
    np.testing.assert_allclose(_params(scaled), _params(reference), rtol=1e-5, atol=1e-7)
    assert not np.allclose(_params(scaled), _params(_pipeline(make_optimiser(name, rate))))


def test_multipliers_read_and_set_by_slot_and_bad_input_is_refused_untouched():
    pipeline = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    state = pipeline.state
    assert rate_multipliers(state) == dict.fromkeys(
        ("token", "position", "norm", "attention", "feed_forward", "head"), 1.0)
    new = set_rate_multipliers(state, {"head": 0.5, "attention": 4.0})
    assert rate_multipliers(new)["head"] == 0.5 and rate_multipliers(new)["attention"] == 4.0
    assert rate_multipliers(state)["head"] == 1.0  # a new state; the old one unchanged
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
    with pytest.raises(ValueError, match=r"no rate multiplier belongs to \['heads'\]; the state "
                                         r"has \['attention'"):
        set_rate_multipliers(state, {"heads": 2.0})
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"multipliers\['head'\]: expected a positive "
                                             r"finite number, got"):
            set_rate_multipliers(state, {"head": bad})
    assert rate_multipliers(pipeline.state)["head"] == 1.0
    plain = _pipeline(make_optimiser("adam", 3e-3))
    assert rate_multipliers(plain.state) == {}
    with pytest.raises(ValueError, match="carry no rate multiplier; build them with"):
        probe_rates(plain, *_batches(2))


@pytest.mark.slow
def test_changing_multipliers_does_not_retrace_and_a_checkpoint_keeps_them(tmp_path):
    xs, ys = _batches(4)
    pipeline = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    pipeline.run(xs, ys, keep_outputs=False)
    traces = dict(pipeline.trace_counts)
    pipeline.set_state(set_rate_multipliers(pipeline.state, {"head": 0.125}),
                       counters=pipeline.counters)
    pipeline.run(xs, ys, keep_outputs=False)
    assert pipeline.trace_counts == traces
    pipeline.save(str(tmp_path / "c.fpc"))
    restored = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    restored.load(str(tmp_path / "c.fpc"))
    assert rate_multipliers(restored.state)["head"] == 0.125
    _, _, a = pipeline.run(xs, ys, keep_outputs=False)
    _, _, b = restored.run(xs, ys, keep_outputs=False)
    np.testing.assert_array_equal(np.asarray(a.loss), np.asarray(b.loss))
    for x, y in zip(jax.tree_util.tree_leaves(pipeline.state),
                    jax.tree_util.tree_leaves(restored.state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ the probe's rule
def test_choose_factors_keeps_the_lowest_score_and_never_a_non_finite_one():
    scores = {
        "attention": {0.5: 2.0, 2.0: 1.9},  # x2 lowest
        "head": {0.5: 1.8, 2.0: 2.5},  # x0.5 lowest
        "norm": {0.5: 2.2, 2.0: 2.1},  # both worse than the baseline: keeps 1
        "token": {0.5: math.nan, 2.0: math.inf},  # non-finite never wins
        "position": {0.5: 2.05, 2.0: 2.05},  # a tie with the baseline keeps 1
    }
    assert choose_factors(2.05, scores) == {"attention": 2.0, "head": 0.5}
    assert choose_factors(math.nan, {"head": {0.5: 3.0, 2.0: math.inf}}) == {"head": 0.5}
    assert choose_factors(1.0, {"head": {0.5: 1.0, 2.0: 1.0}}) == {}


def test_a_change_counts_only_when_lower_beyond_the_step_by_step_noise():
    from fusedpc.training._probe import lower_by_more_than_noise

    rng = np.random.default_rng(0)
    reference = 2.0 + rng.normal(0, 0.3, 40)  # the batches' own noise, shared by both
    steady = reference - 0.01 + rng.normal(0, 0.002, 40)  # lower on every step
    noisy = reference - 0.01 + rng.normal(0, 0.2, 40)  # lower on average, within its noise
    assert lower_by_more_than_noise(steady, reference, 2.0)
    assert not lower_by_more_than_noise(noisy, reference, 2.0)
    assert lower_by_more_than_noise(noisy, reference, 0.0) == bool(noisy.mean() < reference.mean())
    assert not lower_by_more_than_noise(reference + 0.01, reference, 0.0)
    assert not lower_by_more_than_noise(None, reference, 2.0)  # a failed trial never wins
    assert lower_by_more_than_noise(reference, None, 2.0)  # against a failed one, anything


@pytest.mark.slow
def test_probes_leave_the_pipeline_exactly_as_they_found_it():
    xs, ys = _batches(12)
    pipeline = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    pipeline.run(xs[:4], ys[:4], keep_outputs=False)
    before = [np.asarray(a).copy() for a in jax.tree_util.tree_leaves(pipeline.state)]
    steps = pipeline.steps
    result = probe_rates(pipeline, xs[4:], ys[4:], groups=("attention", "head"), per_call=4)
    labels = [t.label for t in result.trials]
    rungs = [label for label in labels[3:] if label.startswith("all x")]  # the ladder's
    assert rungs == [f"all x{f:g}" for f in (4, 8, 16, 32)][:len(rungs)] or rungs == [
        f"all x{f:g}" for f in (0.25, 0.125, 0.0625, 0.03125)][:len(rungs)]
    assert labels[:3] == ["baseline", "all x0.5", "all x2"]
    assert labels[3 + len(rungs):7 + len(rungs)] == [
        "attention x0.5", "attention x2", "head x0.5", "head x2"]
    assert result.steps == 8 * len(result.trials)
    assert pipeline.steps == steps
    for x, y in zip(before, jax.tree_util.tree_leaves(pipeline.state), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    # the score of a trial is its loss tail, recomputed here from its own run
    again = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    again.set_state(pipeline.state, counters=pipeline.counters)
    _, _, m = again.run(xs[4:], ys[4:], keep_outputs=False)
    assert result.baseline == pytest.approx(float(np.mean(np.asarray(m.loss)[4:])), rel=1e-6)
    assert result.score <= result.baseline and result.gain >= 0
    with pytest.raises(ValueError, match=r"groups: \['heads'\] carry no rate multiplier"):
        probe_rates(pipeline, xs, ys, groups=("heads",))
    with pytest.raises(ValueError, match="factors: expected positive numbers other than 1"):
        probe_rates(pipeline, xs, ys, factors=(1.0, 2.0))


@pytest.mark.slow
def test_trials_are_scored_on_held_out_batches_when_given():
    xs, ys = _batches(8)
    held_x, held_y = _batches(3, seed=5)
    pipeline = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))

    def held_out(p):
        return [float(p.error_fn.loss(p.predict(x), y)) for x, y in zip(held_x, held_y)]

    result = probe_rates(pipeline, xs, ys, groups=("head", "attention"), per_call=4,
                         score=held_out)
    # the baseline's score: the held-out loss after 8 steps at the current rates
    again = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    again.run(xs[:4], ys[:4], keep_outputs=False)
    again.run(xs[4:], ys[4:], keep_outputs=False)
    assert result.baseline == pytest.approx(float(np.mean(held_out(again))), rel=1e-6)
    assert all(math.isfinite(t.score) for t in result.trials)
    broken = probe_rates(pipeline, xs, ys, groups=("head", "attention"), per_call=4,
                         score=lambda p: [math.nan])
    assert all(t.score == math.inf for t in broken.trials)  # a NaN score never wins
    assert broken.changed == {}


def _distance_to(best):
    """A synthetic held-out score, lowest with the attention's and the head's rate at
    `best` (the same per-batch offsets in every trial, so differences are noise-free)."""

    def score(p):
        m = rate_multipliers(p.state)
        distance = sum(abs(math.log2(m[g] / best)) for g in ("attention", "head"))
        return [distance + 0.01 * i for i in range(4)]

    return score


@pytest.mark.parametrize(("best", "reach", "rate", "top", "final"), [
    (8.0, 32.0, 3e-3, 8.0, 8.0),  # climbs x2, x4, x8; x16 does not beat x8
    (8.0, 4.0, 3e-3, 4.0, 8.0),  # the reach stops it at x4; each group's own x2 then wins
    (0.25, 32.0, 1.0, 0.25, 0.25),  # downwards alike, from a rate far too high to learn at
])
@pytest.mark.slow
def test_the_global_ladder_climbs_while_each_rung_beats_the_last(best, reach, rate, top,
                                                                 final):
    # The global stage finds x2 (or x0.5), climbs x4, x8, ... while each rung beats the one
    # before, and stops at the first that does not or at `global_reach`; then the
    # per-group trials.
    xs, ys = _batches(2)
    pipeline = _pipeline(with_rate_multiplier(make_optimiser("adam", rate)))

    result = probe_rates(pipeline, xs, ys, groups=("attention", "head"), per_call=2,
                         score=_distance_to(best), global_reach=reach)
    step = 2.0 if top > 1 else 0.5
    rungs = [f"all x{step ** k:g}" for k in range(2, 6)]
    climbed = [t.label for t in result.trials if t.label in rungs]
    assert climbed == rungs[:len(climbed)]  # in order, none skipped
    # the last rung tried: one past the top, unless the reach stopped the climb there
    past = top * step
    assert climbed[-1] == (f"all x{top:g}" if max(past, 1 / past) > reach else
                           f"all x{past:g}")
    per_group = [t for t in result.trials if t.label.startswith(("attention", "head"))]
    assert {t.label.split()[1] for t in per_group} == {"x0.5", "x2"}
    assert all(top in (t.multipliers["attention"], t.multipliers["head"]) for t in per_group)
    assert result.changed == {"attention": final, "head": final}  # the others keep 1
    assert result.score == pytest.approx(0.015)  # the best of the synthetic scores
    with pytest.raises(ValueError, match=r"global_reach: expected a number >= 1, got 0.5"):
        probe_rates(pipeline, xs, ys, global_reach=0.5)


def test_a_lower_rate_counts_only_when_it_also_learns_more():
    # At a rate the model learns well at, a held-out score that favours slower rates (as a
    # small text's probe split did, ending worse at the budget) is not enough: a slower
    # trial must also lower its own step losses, so the rates stay.
    xs, ys = _batches(4)
    pipeline = _pipeline(with_rate_multiplier(make_optimiser("adam", 3e-3)))
    result = probe_rates(pipeline, xs, ys, groups=("attention", "head"), per_call=4,
                         score=_distance_to(0.25))
    labels = [t.label for t in result.trials]
    assert "all x0.5" in labels and "all x0.25" not in labels  # no rung below the first
    by_label = {t.label: t.score for t in result.trials}
    assert by_label["all x0.5"] < by_label["baseline"]  # the held-out score did favour it
    assert result.changed == {}
    # a faster trial needs the held-out score alone: towards x8 the ladder climbs
    up = probe_rates(pipeline, xs, ys, groups=("attention", "head"), per_call=4,
                     score=_distance_to(8.0))
    assert up.changed == {"attention": 8.0, "head": 8.0}


@pytest.mark.slow
def test_probing_brings_a_mis_scaled_part_down_and_ends_with_a_lower_loss():
    # The head at 100 times the others' rate: three rounds of probes, each from where the
    # run is, bring it down towards the others; the run ends lower than the uncalibrated one.
    xs, ys = _batches(160, seed=1)
    rate = 2e-2

    def run(calibrate: bool) -> tuple[float, float]:
        pipeline = _pipeline(
            with_rate_multiplier(optax.sgd(rate)),
            slot_optimisers={"head": with_rate_multiplier(optax.sgd(rate * 100))},
        )
        losses = []
        for round_ in range(4):
            start = 40 * round_
            if calibrate and round_ < 3:
                result = probe_rates(pipeline, xs[start:start + 20], ys[start:start + 20],
                                     groups=("head",), per_call=10)
                pipeline.set_state(set_rate_multipliers(pipeline.state, result.multipliers),
                                   counters=pipeline.counters)
            for k in range(start, start + 40, 10):
                _, _, m = pipeline.run(xs[k:k + 10], ys[k:k + 10], keep_outputs=False)
                losses.extend(np.asarray(m.loss).tolist())
        return rate_multipliers(pipeline.state)["head"], float(np.mean(losses[-20:]))

    head, calibrated = run(True)
    _, uncalibrated = run(False)
    assert head < 1.0  # lowered at least once of three rounds (each x0.5 at most)
    assert calibrated < uncalibrated


# ------------------------------------------------------------------ synaptic_uncertainty
SYNAPTIC_SLOTS = ("token", "position", "attention", "feed_forward", "head")


def _synaptic_pipeline(optimiser, learning_rate=1.0):
    config = fusedpc.GPTConfig(vocab_size=32, width=16, n_heads=2, n_blocks=1, ff_width=32,
                               max_len=16, learn=SYNAPTIC_SLOTS,
                               learning_kind="synaptic_uncertainty",
                               learning_kwargs={"window": 20, "learning_rate": learning_rate})
    part, _ = fusedpc.build_gpt(config, optimiser, jax.random.key(0))
    return fusedpc.FusedPipeline(part, config.error_fn, key=jax.random.key(0))


def _synaptic_states(pipeline):
    kinds = (fusedpc.LearningNetworkState, fusedpc.EmbeddingState)
    states = jax.tree_util.tree_leaves(pipeline.state, is_leaf=lambda n: isinstance(n, kinds))
    return [n for n in states if isinstance(n, kinds)]


def _weights(state):
    return state.table if isinstance(state, fusedpc.EmbeddingState) else state.params


@pytest.mark.slow
def test_a_bare_multiplier_runs_the_synaptic_rule_at_the_multiplied_rate():
    from fusedpc.training import scale_by_rate_multiplier

    xs, ys = _batches(2)
    start = _synaptic_pipeline(None)
    plain = _synaptic_pipeline(None)
    at_half_rate = _synaptic_pipeline(None, learning_rate=0.5)
    scaled = _synaptic_pipeline(scale_by_rate_multiplier())
    assert set(rate_multipliers(scaled.state)) == set(SYNAPTIC_SLOTS)
    scaled.set_state(set_rate_multipliers(scaled.state, dict.fromkeys(SYNAPTIC_SLOTS, 0.5)))
    for pipeline in (plain, at_half_rate, scaled):
        for x, y in zip(xs, ys, strict=True):
            pipeline.step(x, y)
    quadruples = list(zip(_synaptic_states(start), _synaptic_states(plain),
                          _synaptic_states(at_half_rate), _synaptic_states(scaled), strict=True))
    assert len(quadruples) >= 5  # token, position, attention, feed-forward, head
    for old, new, half_rate, half in quadruples:
        leaves = [jax.tree_util.tree_leaves(_weights(s)) for s in (old, new, half_rate, half)]
        for o, n, r, h in zip(*leaves, strict=True):
            assert np.abs(np.asarray(n) - np.asarray(o)).max() > 0
            # the multiplier is the rule's own rate: m * alpha, bit for bit (x0.5 is exact)
            np.testing.assert_array_equal(np.asarray(h), np.asarray(r))
        # and not the whole step scaled: the reversion to the prior is not halved
        o, n, h = (np.concatenate([np.ravel(a) for a in leaf]) for leaf in
                   (leaves[0], leaves[1], leaves[3]))
        assert not np.allclose(h - o, 0.5 * (n - o), rtol=1e-3, atol=1e-7)
        # the per-weight precisions are the rule's at that rate too (not scaled themselves)
        for r, h in zip(jax.tree_util.tree_leaves(half_rate.weight_precision),
                        jax.tree_util.tree_leaves(half.weight_precision), strict=True):
            np.testing.assert_array_equal(np.asarray(h), np.asarray(r))
    # the part itself takes a bare multiplier and nothing else (build_gpt gives the
    # synaptic parts none of the optimiser it is given: it is the LayerNorms')
    network = fusedpc.PCNetwork([3, 2], ())
    fusedpc.LearningNetwork(network, scale_by_rate_multiplier(), "synaptic_uncertainty",
                            {"window": 4})
    with pytest.raises(ValueError, match="takes no optimiser; pass optimiser=None .*"
                                         "scale_by_rate_multiplier"):
        fusedpc.LearningNetwork(network, with_rate_multiplier(optax.sgd(0.1)),
                                "synaptic_uncertainty", {"window": 4})


# ------------------------------------------------------------------ fusedpc report's suggestion
def _evidence(probe_mean: float, probe_std: float = 0.01) -> dict:
    def line(method, mean, std, kind="standard", learn="all", optimiser="adam"):
        return {"text": "hamlet", "learning_kind": kind, "learn": learn,
                "optimiser": optimiser, "method": method, "seeds": 3,
                "val_loss_mean": mean, "val_loss_std": std}

    return {
        "study": {"steps": 1200, "seeds": [0, 1, 2], "texts": ["hamlet"]},
        "cells": [line("none", 2.20, 0.01), line("probe", probe_mean, probe_std),
                  line("backprop_twin", 2.15, 0.01, "backprop")],
    }


def test_the_suggestion_cites_its_study_cell_or_says_no_change_helps():
    from fusedpc.training import TrainConfig
    from fusedpc.training._evidence import cell_evidence, suggest

    config = TrainConfig(model=fusedpc.GPTConfig(learning_kind="standard"))
    found, note = cell_evidence(config, evidence=_evidence(2.10))
    assert note == "" and found is not None
    assert found.cell == "hamlet / standard / learn=all / adam" and found.twin_mean == 2.15
    assert found.gain == pytest.approx(0.10) and found.helps
    (first, figures, *paste) = suggest(config, [], _evidence(2.10))
    assert first.startswith("expected to help: --calibrate auto") and "1200 steps, 3 seeds" in first
    assert figures == ("  hamlet / standard / learn=all / adam: 2.200 without, 2.100 with "
                       "--calibrate auto (lower by 0.100; seed spread 0.010)")
    assert paste == ["  train with: --calibrate auto",
                     '  or in the config file: [optimiser] calibrate = "auto"']
    # within the spread: said plainly
    first, _, last = suggest(config, [], _evidence(2.195, 0.02))
    assert first.startswith("no change is expected to help: --calibrate auto did not beat")
    assert last == "  keep the rates as they are"
    # every text counts: helping on one and hurting on another is no suggestion to use it
    two = _evidence(2.10)
    two["study"]["texts"] = ["hamlet", "other"]
    two["cells"] += [{**c, "text": "other"} for c in _evidence(2.30)["cells"]]
    lines = suggest(config, [], two)
    assert lines[0].startswith("no change is expected to help, and --calibrate auto may hurt")
    assert lines[2].startswith("  other / standard / learn=all / adam: 2.200 without, 2.300")
    # no such cell
    other = TrainConfig(optimiser="sgd", model=fusedpc.GPTConfig(learning_kind="standard"))
    assert suggest(other, [], _evidence(2.1)) == [
        "no suggestion: the study has no cell standard/all/sgd."]
    # a custom set of slots is compared with the nearest preset, and says so
    custom = TrainConfig(model=fusedpc.GPTConfig(learning_kind="standard", learn="head,norm"))
    assert suggest(custom, [], _evidence(2.1))[0].startswith(
        "(no study cell learns exactly the slots of learn='head,norm'")
    # a run that calibrated itself: its own choice, and the flag to start there
    record = {"kind": "calibration", "step": 150, "probe_steps": 800, "baseline": 2.5,
              "score": 2.4, "changed": {"head": 0.5}, "multipliers": {"head": 0.5, "norm": 1.0}}
    lines = suggest(config, [record], _evidence(2.1))
    assert lines[0] == ("this run calibrated its rates by probes at step 150 (800 trial "
                        "steps): trial loss 2.5000 -> 2.4000")
    assert "  --slot-lr-scales head=0.5,norm=1" in lines


def test_the_bundled_evidence_has_every_cell_the_report_looks_up():
    from fusedpc.training._evidence import load_evidence

    evidence = load_evidence()
    methods = {(c["learning_kind"], c["learn"], c["method"]) for c in evidence["cells"]}
    for kind in ("precision_weighted", "standard", "synaptic_uncertainty"):
        assert (kind, "all", "none") in methods and (kind, "all", "probe") in methods
    assert ("backprop", "all", "backprop_twin") in methods


def test_the_suggestion_warns_where_the_study_found_the_calibration_worse():
    from fusedpc.training import TrainConfig
    from fusedpc.training._evidence import suggest

    config = TrainConfig(model=fusedpc.GPTConfig(learning_kind="standard"))
    first, figures, last = suggest(config, [], _evidence(2.30))  # 0.10 worse, spread 0.01
    assert first.startswith("no change is expected to help, and --calibrate auto may hurt")
    assert "2.200 without, 2.300 with --calibrate auto (higher by 0.100" in figures
    assert last == "  keep the rates as they are"
