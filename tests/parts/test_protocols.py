"""The open protocols of the part contract: a part's own metrics class reaches the report,
composites list their children, parts export their arrays as standard records, and frozen
parameters are named records (with the old dict spelling kept one release)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc import frozen
from fusedpc.core import AbstractMetrics, LayerNormParams, LinearParams, TableParams, report_rows
from fusedpc.execution import UnfusedPipeline
from fusedpc.execution._unfused import JitLeaf, unfused

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand


# --------------------------------------------------------------------------- metrics
class EnergyMetrics(AbstractMetrics):
    """A user metrics class: the squared error energy at the part's output."""

    energy: jax.Array
    finite: jax.Array


class EnergyProbe(fusedpc.AbstractPart):
    """Identity forward; backward passes the error on and reports $\\tfrac12 \\lVert E\\rVert^2$."""

    def init_state(self, key):
        del key
        return None

    def compile(self, path):
        def forward(state, x, ctx):
            return x, None

        def backward(state, cache, error, ctx):
            energy = 0.5 * jnp.sum(error * error)
            return error, state, EnergyMetrics(energy, jnp.isfinite(energy))

        return fusedpc.Core(forward, backward, lambda state: self)


def test_a_parts_own_metrics_class_reaches_the_report():
    network = fusedpc.PCNetwork([3, 2], key=jax.random.key(0))
    tree = fusedpc.Sequential(
        [fusedpc.LearningNetwork(network, optax.sgd(0.1)), frozen.tanh(), EnergyProbe()]
    )
    pipeline = fusedpc.FusedPipeline(tree)
    x = jax.random.normal(jax.random.key(1), (4, 3))
    target = jnp.zeros((4, 2))
    y, _ = pipeline.step(x, target)
    rows = pipeline.report()
    assert [row["part"] for row in rows] == ["parts[0]", "parts[2]"]
    learning, probe = rows
    assert set(learning) == {
        "part", "layer_sizes", "update_norm", "error_norm", "weight_norm", "update_ratio",
        "finite",
    }
    assert set(probe) == {"part", "energy", "finite"}
    assert isinstance(probe["energy"], float) and probe["finite"] is True
    # the squared-error descent error at the output, E = y - t (every row active)
    error = np.asarray(y) - 0.0
    np.testing.assert_allclose(probe["energy"], 0.5 * np.sum(error * error), rtol=1e-5)


def test_a_metrics_class_may_write_its_own_rows_and_containers_walk_generically():
    class TwoRows(AbstractMetrics):
        finite: jax.Array

        def rows(self, path):
            return [{"part": path, "k": 0}, {"part": path, "k": 1}]

    flag = fusedpc.core.FiniteFlag(jnp.array(True))
    tree = fusedpc.core.named(a=TwoRows(jnp.array(True)), b=flag)
    stacked = fusedpc.core.Stacked(tree)
    stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), stacked)
    rows = report_rows(fusedpc.core.named(blocks=stacked))
    assert [(r["part"], r["k"]) for r in rows] == [
        ("blocks[0].a", 0), ("blocks[0].a", 1), ("blocks[1].a", 0), ("blocks[1].a", 1)
    ]
    assert bool(tree.finite) and bool(stacked.finite)
    bad = fusedpc.core.named(a=flag, b=fusedpc.core.FiniteFlag(jnp.array(False)))
    assert not bool(bad.finite)


# --------------------------------------------------------------------------- children
def test_children_name_the_paths_that_compile_uses():
    seq = fusedpc.Sequential([frozen.tanh(), fusedpc.Residual(frozen.relu())])
    assert [name for name, _ in seq.children()] == ["parts[0]", "parts[1]"]
    assert [name for name, _ in seq.parts[1].children()] == ["branch"]
    assert frozen.tanh().children() == ()
    repeat = fusedpc.Repeat([frozen.tanh(), frozen.tanh()])
    assert [name for name, _ in repeat.children()] == ["[0]", "[1]"]
    assert repeat.unrolled().unroll and not repeat.unroll
    swapped = seq.replace_children([frozen.relu(), seq.parts[1]])
    assert swapped.parts[0].name == "relu" and swapped.parts[1] is seq.parts[1]
    with pytest.raises(TypeError, match="declares no children"):
        frozen.tanh().replace_children([frozen.relu()])


class Twice(fusedpc.AbstractPart):
    """A user composite: `y = inner(inner(x))` with one shared child, listed by `children()`."""

    inner: fusedpc.AbstractPart

    def children(self):
        return (("inner", self.inner),)

    def replace_children(self, children):
        (inner,) = children
        return Twice(inner)

    def init_state(self, key):
        return self.inner.init_state(key)

    def compile(self, path):
        core = self.inner.compile(fusedpc.core.join_path(path, "inner"))

        def forward(state, x, ctx):
            h, c1 = core.forward(state, x, ctx)
            y, c2 = core.forward(state, h, ctx)
            return y, (c1, c2)

        def backward(state, cache, error, ctx):
            e, _, m2 = core.backward(state, cache[1], error, ctx)
            e, _, m1 = core.backward(state, cache[0], e, ctx)
            return e, state, fusedpc.core.named(second=m2, first=m1)

        return fusedpc.Core(forward, backward, lambda s: Twice(core.write_back(s)))


def test_unfused_walks_a_user_composite_through_its_children():
    tree = fusedpc.Sequential([Twice(frozen.tanh()), frozen.gelu()])
    wrapped = unfused(tree)
    assert isinstance(wrapped.parts[0], Twice) and isinstance(wrapped.parts[0].inner, JitLeaf)
    x = jax.random.normal(jax.random.key(0), (3, 2))
    fused = fusedpc.FusedPipeline(tree)
    plain = UnfusedPipeline(tree)
    (y_f, e_f), (y_u, e_u) = fused.step(x, x), plain.step(x, x)
    np.testing.assert_allclose(y_u, y_f, rtol=1e-6)
    np.testing.assert_allclose(e_u, e_f, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- export
def test_parts_export_standard_records():
    key = jax.random.key(0)
    lin = eqx.nn.Linear(3, 2, key=key)
    (record,) = frozen.linear(lin).export_arrays()
    assert isinstance(record, LinearParams) and record.weight is lin.weight
    assert frozen.gelu().export_arrays() == ()
    ln = eqx.nn.LayerNorm(4)
    (norm,) = frozen.layer_norm(ln).export_arrays()
    assert isinstance(norm, LayerNormParams) and norm.weight is ln.weight
    (table,) = frozen.embedding(jnp.ones((5, 2))).export_arrays()
    assert isinstance(table, TableParams) and table.table.shape == (5, 2)
    net = fusedpc.PCNetwork([3, 4, 2], key=key)
    records = fusedpc.LearningNetwork(net).export_arrays()
    assert [r.weight.shape for r in records] == [(4, 3), (2, 4)]
    chain = fusedpc.Sequential([frozen.linear(lin), frozen.gelu(), frozen.linear(lin)])
    assert len(chain.export_arrays()) == 2
    (learned,) = fusedpc.transplant.from_embedding(eqx.nn.Embedding(5, 2, key=key)).export_arrays()
    assert isinstance(learned, TableParams)


def test_a_part_that_cannot_export_names_its_path():
    with pytest.raises(TypeError, match=r"^blocks\[0\]\.feed_forward: EnergyProbe cannot export"):
        EnergyProbe().export_arrays("blocks[0].feed_forward")
    custom = fusedpc.Frozen(lambda p, x: (x * p["a"], None), lambda p, c, e: e * p["a"],
                            {"a": jnp.ones(())}, name="scale")
    with pytest.raises(TypeError, match=r"^head: frozen part 'scale' cannot export"):
        custom.export_arrays("head")
    config = fusedpc.GPTConfig(vocab_size=11, width=8, n_heads=2, n_blocks=1, ff_width=16,
                               max_len=4, learn="none")
    part, reference = fusedpc.build_gpt(config, None, jax.random.key(0))
    part = eqx.tree_at(lambda p: p.head, part, EnergyProbe())
    with pytest.raises(TypeError, match=r"^head: EnergyProbe cannot export its arrays"):
        fusedpc.to_reference(part, reference)


class ScaledHead(fusedpc.AbstractPart):
    """A user head $y = s \\cdot x W^\\top$ that exports itself as one `LinearParams`."""

    weight: jax.Array
    scale: float = eqx.field(static=True)

    def init_state(self, key):
        return None

    def compile(self, path):
        raise NotImplementedError  # only exported in this test

    def export_arrays(self, path=""):
        return (LinearParams(self.scale * self.weight, None),)


def test_to_reference_exports_a_user_part_through_its_method():
    config = fusedpc.GPTConfig(vocab_size=11, width=8, n_heads=2, n_blocks=2, ff_width=16,
                               max_len=4, learn="none", scan=False)
    part, reference = fusedpc.build_gpt(config, None, jax.random.key(0))
    head = ScaledHead(reference.head.weight, 2.0)
    model = fusedpc.to_reference(eqx.tree_at(lambda p: p.head, part, head), reference)
    np.testing.assert_array_equal(model.head.weight, 2.0 * reference.head.weight)
    np.testing.assert_array_equal(model.blocks[1].ff.fc1.weight, reference.blocks[1].ff.fc1.weight)


# --------------------------------------------------------------------------- layouts
def test_blocks_that_differ_keep_the_tuple_state_layout_of_older_checkpoints():
    config = fusedpc.GPTConfig(vocab_size=11, width=8, n_heads=2, n_blocks=2, ff_width=16,
                               max_len=4, learn="all", scan=False)
    part, _ = fusedpc.build_gpt(config, optax.sgd(0.1), jax.random.key(0))
    assert isinstance(part.blocks, fusedpc.transformer.Blocks)
    state = part.init_state(jax.random.key(0))
    assert isinstance(state.blocks, tuple) and len(state.blocks) == 2
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert ".blocks[1].feed_forward.params.weights[0]" in paths
    # a tuple of blocks handed to GPTPart is wrapped the same way
    again = fusedpc.GPTPart(part.token, part.position, tuple(part.blocks.blocks), part.norm_f,
                            part.head, vocab_size=11, max_len=4)
    assert isinstance(again.blocks, fusedpc.transformer.Blocks)


def test_frozen_parameters_are_named_records_and_eps_is_static():
    lin = frozen.linear(jnp.ones((2, 3)), jnp.zeros(2))
    assert isinstance(lin.init_state(jax.random.key(0)).params, LinearParams)
    # indexing, deprecated in 0.3, is refused naming the field to read
    with pytest.raises(TypeError, match=r"removed in 0.4.0. Read LinearParams.weight"):
        lin.params["weight"]
    ln = frozen.layer_norm(eqx.nn.LayerNorm(4, eps=1e-3))
    leaves = jax.tree_util.tree_leaves(ln.init_state(jax.random.key(0)))
    assert len(leaves) == 2  # weight and bias; eps is no leaf
    assert frozen.layer_norm(width=4).forward_fn is frozen.layer_norm(width=4).forward_fn
    assert frozen.layer_norm(width=4, eps=1e-3).forward_fn is not frozen.layer_norm(
        width=4).forward_fn
    x = jax.random.normal(jax.random.key(1), (3, 4))
    want = eqx.nn.LayerNorm(4, eps=1e-3)
    y, _ = ln.compile("").forward(ln.init_state(jax.random.key(0)), x, CTX)
    np.testing.assert_allclose(y, jax.vmap(want)(x), rtol=1e-5, atol=1e-6)
    assert all(
        f.metadata.get("static") for f in dataclasses.fields(fusedpc.LearningLayerNorm)
        if f.name == "eps"
    )


def test_synaptic_settings_are_resolved_once_at_construction():
    net = fusedpc.PCNetwork([3, 2], key=jax.random.key(0))
    part = fusedpc.LearningNetwork(net, None, "synaptic_uncertainty", {"window": 4})
    assert part.synaptic == fusedpc.parts.learning.SynapticSettings(4.0, 1.0, 0.0, 1.0, 1.0)
    assert fusedpc.LearningNetwork(net, optax.sgd(0.1)).synaptic is None
    with pytest.raises(ValueError, match=r"learning_kwargs\['window'\] must be >= 1"):
        fusedpc.LearningNetwork(net, None, "synaptic_uncertainty", {"window": 0})
    table = fusedpc.LearningEmbedding(jnp.ones((4, 2)), None, "synaptic_uncertainty",
                                      {"window": 2})
    assert table.synaptic.window == 2.0
