"""μPC's depth multiplier in the GPT (`GPTConfig(parameterisation="mupc")`): every block's
two residual branches scaled by $1/\\sqrt{2L}$, in the part and in the reference GPT alike.
Checked against the reference's backprop twin (one SGD step, every weight learning), for the
frozen readout, the export round trip, the depth-stable stream, the flag of `fusedpc train`
and the errors."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import norm_rel_error

import fusedpc
from fusedpc.training import _settings
from fusedpc.transformer.reference import GPT, make_backprop_step

TINY = {"vocab_size": 11, "width": 16, "n_heads": 2, "n_blocks": 3, "ff_width": 32, "max_len": 8}


def _batch(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    ids, targets = jax.random.randint(jax.random.key(seed), (2, 4, 8), 0, TINY["vocab_size"],
                                      dtype=jnp.int32)
    return ids, targets


def _weights(model: GPT) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    return {jax.tree_util.keystr(p): np.asarray(v, np.float64) for p, v in leaves}


def test_mupc_sets_the_branch_multiplier_of_every_block():
    config = fusedpc.GPTConfig(**TINY, parameterisation="mupc", learn="all")
    assert config.branch_scale == pytest.approx(1 / math.sqrt(6))
    part, reference = fusedpc.build_gpt(config, optax.sgd(0.1), jax.random.key(0))
    assert all(block.branch_scale == config.branch_scale for block in reference.blocks)
    assert all(block.branch_scale == config.branch_scale
               for _, block in part.blocks.children())
    standard, _ = fusedpc.build_gpt(dataclasses.replace(config, parameterisation="standard"),
                                    None, jax.random.key(0))
    assert all(block.branch_scale == 1.0 for _, block in standard.blocks.children())
    # the same weights are drawn either way: only the junctions differ
    plain = _weights(GPT(**TINY, key=jax.random.key(0)))
    assert all(np.array_equal(v, plain[k]) for k, v in _weights(reference).items())


@pytest.mark.parametrize("scan", [True, False])
def test_frozen_mupc_gpt_reproduces_the_reference_logits(scan):
    reference = GPT(**TINY, key=jax.random.key(0), branch_scale=0.3)
    part = fusedpc.hybrid_from_gpt(reference, scan=scan)
    ids, _ = _batch()
    logits = jax.jit(lambda s, x: part.compile("").forward(s, x, fusedpc.core.StepContext())[0])(
        part.init_state(jax.random.key(0)), ids)
    np.testing.assert_allclose(logits, reference(ids), rtol=1e-5, atol=1e-6)
    plain = GPT(**TINY, key=jax.random.key(0))
    assert float(jnp.max(jnp.abs(reference(ids) - plain(ids)))) > 1e-3  # the scale matters


def test_one_sgd_step_of_the_mupc_gpt_equals_backprop():
    # The rate is large on purpose (as in test_options.py): one step's change is linear in
    # it, and the rounding of w + change to float32 drops out, leaving the gradients' own.
    rate = 100.0
    config = fusedpc.GPTConfig(**TINY, parameterisation="mupc", learn="all")
    part, reference = fusedpc.build_gpt(config, optax.sgd(rate), jax.random.key(0))
    ids, targets = _batch()
    pipeline = fusedpc.FusedPipeline(part, config.error_fn)
    pipeline.step(ids, targets)
    learned = fusedpc.to_reference(pipeline.merge(), reference)
    twin = jax.tree_util.tree_map(jnp.copy, reference)
    optimiser = optax.sgd(rate)
    twin, _, _ = make_backprop_step(optimiser)(
        twin, optimiser.init(eqx.filter(twin, eqx.is_array)), ids, targets)
    before, got, want = _weights(reference), _weights(learned), _weights(twin)
    errors = {}
    for path in before:
        if path.endswith("wk.bias"):  # its gradient is exactly zero (a softmax row's shift)
            continue
        assert np.linalg.norm(want[path] - before[path]) > 0, path
        errors[path] = norm_rel_error(got[path] - before[path], want[path] - before[path])
    assert max(errors.values()) <= 1e-5, errors  # float32 rounding (DESIGN.md's parity bound)


def test_the_mupc_stream_keeps_its_size_with_depth():
    def stream(n_blocks: int, scale: float) -> float:
        sizes = dict(TINY, width=64, ff_width=128, n_blocks=n_blocks)
        reference = GPT(**sizes, key=jax.random.key(0), branch_scale=scale)
        h = reference.tok_emb.weight[_batch()[0]] + reference.pos_emb.weight[:8]
        for block in reference.blocks:
            h = block(h)
        return float(jnp.sqrt(jnp.mean(jnp.square(h))))

    mupc = [stream(n, 1 / math.sqrt(2 * n)) for n in (2, 32)]
    standard = [stream(n, 1.0) for n in (2, 32)]
    # (measured: 1.456 and 1.452; 1.51 and 2.46)
    assert abs(mupc[1] / mupc[0] - 1) < 0.05, mupc    # of the same size at 16x the depth
    assert standard[1] / standard[0] > 1.5, standard  # grows with depth without it


def test_export_refuses_a_reference_of_another_branch_scale():
    config = fusedpc.GPTConfig(**TINY, parameterisation="mupc")
    part, reference = fusedpc.build_gpt(config, None, jax.random.key(0))
    assert bool(eqx.tree_equal(fusedpc.to_reference(part, reference), reference))
    with pytest.raises(ValueError, match=r"blocks\[0\] has branch_scale=0.40"):
        fusedpc.to_reference(part, GPT(**TINY, key=jax.random.key(0)))


def test_bad_parameterisations_and_scales_are_refused_by_name():
    with pytest.raises(ValueError, match="GPTConfig.parameterisation must be one of"):
        fusedpc.GPTConfig(**TINY, parameterisation="mup").validate()
    with pytest.raises(ValueError, match="branch_scale must be a finite number > 0, got 0"):
        GPT(**TINY, key=jax.random.key(0), branch_scale=0)
    block = fusedpc.hybrid_from_gpt(GPT(**TINY, key=jax.random.key(0)),
                                    scan=False).blocks.children()[0][1]
    with pytest.raises(ValueError, match="TransformerBlock: branch_scale must be"):
        fusedpc.transformer.TransformerBlock(*(c for _, c in block.children()),
                                             branch_scale=float("nan"))


def test_the_flag_and_the_config_file_key_reach_the_model():
    from fusedpc.cli._parser import build_parser

    assert build_parser().parse_args(
        ["train", "--parameterisation", "mupc"]).parameterisation == "mupc"
    config = _settings.config_from_settings({"parameterisation": "mupc", "n_blocks": 8})
    assert config.model.parameterisation == "mupc"
    assert config.model.branch_scale == pytest.approx(0.25)
    assert _settings.config_settings(config)["parameterisation"] == "mupc"  # in config.toml
    with pytest.raises(ValueError, match="GPTConfig.parameterisation"):
        _settings.config_from_settings({"parameterisation": "depth"}).model.validate()
