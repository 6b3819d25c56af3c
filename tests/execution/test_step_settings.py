"""`fusedpc.StepSettings`: the step's guards and compute dtype said once, for `make_step`,
`StepProgram`, `FusedPipeline` and the training app."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc import frozen


def _tree():
    network = fusedpc.PCNetwork([3, 4, 2], "tanh", key=jax.random.key(0))
    return fusedpc.Sequential([fusedpc.LearningNetwork(network, optax.sgd(0.1)), frozen.tanh()])


def test_the_settings_object_and_its_keywords_make_the_same_program():
    settings = fusedpc.StepSettings(max_update_ratio=0.5, clip_global_norm=1.0)
    by_object = fusedpc.make_step(_tree(), settings=settings)
    by_keywords = fusedpc.make_step(_tree(), max_update_ratio=0.5, clip_global_norm=1.0)
    assert by_object.settings == by_keywords.settings == settings
    assert by_object.max_update_ratio == 0.5 and by_object.loss_spike is None
    pipeline = fusedpc.FusedPipeline(_tree(), settings=settings)
    assert pipeline.settings == settings and pipeline.program.settings == settings
    x, target = jax.random.normal(jax.random.key(1), (4, 3)), jnp.zeros((4, 2))
    carry_a, _ = jax.jit(by_object.step)(by_object.init(jax.random.key(0)), x, target)
    carry_b, _ = jax.jit(by_keywords.step)(by_keywords.init(jax.random.key(0)), x, target)
    for a, b in zip(jax.tree_util.tree_leaves(carry_a), jax.tree_util.tree_leaves(carry_b),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_settings_name_their_field_and_both_forms_at_once_are_refused():
    with pytest.raises(ValueError, match=r"nonfinite: expected one of"):
        fusedpc.StepSettings(nonfinite="sometimes")
    with pytest.raises(ValueError, match=r"loss_spike: expected None or a finite number > 1"):
        fusedpc.StepSettings(loss_spike=0.5)
    with pytest.raises(TypeError, match=r"max_update_ratio: expected None or a number"):
        fusedpc.StepSettings(max_update_ratio="big")
    with pytest.raises(ValueError, match=r"compute_dtype"):
        fusedpc.StepSettings(compute_dtype="float16")
    with pytest.raises(ValueError, match=r"settings: given together with \['loss_spike'\]"):
        fusedpc.make_step(_tree(), settings=fusedpc.StepSettings(), loss_spike=2.0)
    with pytest.raises(TypeError, match="settings: expected a fusedpc.StepSettings"):
        fusedpc.FusedPipeline(_tree(), settings={"loss_spike": 2.0})
    assert fusedpc.StepSettings(compute_dtype="float32").compute_dtype is None
    assert fusedpc.StepSettings().replace(loss_spike=3).loss_spike == 3.0


def test_the_training_config_gives_the_library_settings_with_none_for_off():
    config = fusedpc.training.TrainConfig(clip=1.0)
    assert config.step_settings == fusedpc.StepSettings(clip_global_norm=1.0)
    assert config.step_settings.max_update_ratio is None  # the file's 0 is None here


def test_a_step_program_built_the_0_3_way_still_runs_with_a_warning():
    tree = _tree()
    with pytest.warns(DeprecationWarning, match="pass one fusedpc.StepSettings"):
        program = fusedpc.StepProgram(tree, tree.compile(""), fusedpc.losses.resolve(None),
                                      "rows", "skip", 0.5)
    assert program.settings == fusedpc.StepSettings(max_update_ratio=0.5)


def test_the_removed_trace_time_helpers_name_the_context_field():
    for name, field in [("computing_in", "compute_dtype"), ("error_scale", "ctx.error_scale"),
                        ("measured_together", "measured"), ("measuring", "ctx.measured")]:
        with pytest.raises(AttributeError, match=rf"fusedpc.core.{name} was removed in 0.4.0"
                                                 rf".*{field}"):
            getattr(fusedpc.core, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        fusedpc.core.nothing_here  # noqa: B018
