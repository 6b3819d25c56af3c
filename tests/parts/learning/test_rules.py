"""Learning rules as typed settings (`fusedpc.parts.learning.PrecisionWeighted`, `Standard`,
`SynapticUncertainty`): a part given the rule is the part given its name and keywords."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.parts.learning import (
    LearningEmbedding,
    LearningNetwork,
    PCNetwork,
    PrecisionWeighted,
    Standard,
    SynapticUncertainty,
    learning_rule,
)


def _network() -> PCNetwork:
    return PCNetwork([3, 5, 2], "tanh", key=jax.random.key(0))


@pytest.mark.parametrize(
    ("rule", "name", "keywords", "optimiser"),
    [
        (PrecisionWeighted(), "precision_weighted", None, optax.sgd(0.1)),
        (Standard(), "standard", None, optax.sgd(0.1)),
        (SynapticUncertainty(window=20, prior_variance=0.5), "synaptic_uncertainty",
         {"window": 20, "prior_variance": 0.5}, None),
    ],
)
def test_a_rule_object_is_its_name_and_keywords(rule, name, keywords, optimiser):
    typed = LearningNetwork(_network(), optimiser, rule)
    named = LearningNetwork(_network(), optimiser, name, keywords)
    assert typed.learning_kind == named.learning_kind == name
    assert typed.learning_kwargs == named.learning_kwargs  # one static configuration
    assert typed.rule == named.rule == rule
    x, target = jax.random.normal(jax.random.key(1), (6, 3)), jnp.zeros((6, 2))
    steps = []
    for part in (typed, named):
        pipeline = fusedpc.FusedPipeline(part)
        pipeline.step(x, target)
        steps.append(pipeline.state)
    for a, b in zip(jax.tree_util.tree_leaves(steps[0]), jax.tree_util.tree_leaves(steps[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_embedding_takes_a_rule_too():
    table = jnp.ones((4, 3))
    part = LearningEmbedding(table, None, SynapticUncertainty(window=8))
    assert part.rule == SynapticUncertainty(window=8)
    assert part.learning_kwargs == (("window", 8),)


def test_bad_rules_and_keywords_are_refused_by_name():
    with pytest.raises(ValueError, match="learning_kwargs given with a rule object"):
        LearningNetwork(_network(), None, SynapticUncertainty(window=8), {"window": 9})
    with pytest.raises(ValueError, match=r"unknown learning_kind 'nope'"):
        learning_rule("nope")
    with pytest.raises(ValueError, match=r"unknown learning_kwargs \['windw'\]"):
        learning_rule("synaptic_uncertainty", {"windw": 8})
    with pytest.raises(ValueError, match="apply only to learning_kind='synaptic_uncertainty'"):
        learning_rule("standard", {"window": 8})
    with pytest.raises(ValueError, match="needs learning_kwargs\\['window'\\]"):
        learning_rule("synaptic_uncertainty")
    with pytest.raises(ValueError, match="window'\\] must be >= 1"):
        LearningNetwork(_network(), None, SynapticUncertainty(window=0.5))
    with pytest.raises(ValueError, match="'prior_variance'\\] must be > 0"):
        learning_rule("synaptic_uncertainty", {"window": 8, "prior_variance": 0.0})
