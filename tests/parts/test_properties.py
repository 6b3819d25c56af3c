"""Property tests over random trees (hypothesis): frozen parts, learning networks, sequential
and residual composition, multi-head attention, all over `(batch, seq, features)` inputs.

(a) every all-frozen tree's backward equals `jax.vjp` of its forward;
(b) every learning tree (`precision_weighted`, fixed precisions, SGD) takes the same step as
    its backprop twin: `jax.grad` of the row-mean loss through the tree's own forward;
(c) no tree's step (any optimiser, learning kind, head) changes the state's structure, shapes
    or dtypes, and writing the state back and initialising again gives the same state.

Speed: widths come from a small set and every input is `(2, 3, D)`, so the few primitive
shapes compile once; the step runs eagerly (`jax.disable_jit`), one primitive at a time, instead
of compiling a whole XLA program per random tree (seconds each). The compiled path is the same
Python code; jit versus no-jit agreement is checked for every part type by
`tests/test_conformance.py`, and exactness of the compiled GPT by `tests/test_gpt.py`.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import shapes_and_dtypes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fusedpc
from fusedpc import frozen
from fusedpc.parts._activations import ACTIVATIONS

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

WIDTHS = (3, 4)  # few shapes: each new one compiles its primitives once
BATCH, SEQ = 2, 3
ROWS = BATCH * SEQ
RATE = 0.1
FLOAT32_EPS = float(np.finfo(np.float32).eps)
SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # the same 50 trees on every run: a failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

Spec = tuple  # a hashable description of a tree, built into parts by `build`


# --------------------------------------------------------------------------- strategies
seeds = st.integers(0, 10_000)
widths = st.sampled_from(WIDTHS)


@st.composite
def learning_spec(draw, width: int, out: int | None = None, *, variety: bool = False) -> Spec:
    """A learning network `width -> [hidden] -> out` (gaussian head, SGD unless `variety`)."""
    out = draw(widths) if out is None else out
    hidden = tuple(draw(st.lists(widths, max_size=2)))
    acts = tuple(draw(st.sampled_from(sorted(ACTIVATIONS))) for _ in hidden)
    options = {
        "input_activation": draw(st.sampled_from(("identity", "tanh", "gelu"))),
        "bias": draw(st.booleans()),
        "hidden_precision": draw(st.sampled_from((0.5, 1.0, 2.0))),
    }
    if variety:
        options["optimiser"] = draw(st.sampled_from(("sgd", "adam", "none")))
        options["kind"] = draw(
            st.sampled_from(("precision_weighted", "standard", "synaptic_uncertainty"))
        )
        options["update_precisions"] = draw(st.booleans())
        options["head"] = draw(st.sampled_from(("gaussian", "categorical", "binary")))
    return ("learn", width, hidden, out, acts, tuple(sorted(options.items())), draw(seeds))


@st.composite
def frozen_leaf_spec(draw, width: int) -> tuple[Spec, int]:
    kind = draw(st.sampled_from(("linear", "activation", "tanh", "softmax", "layer_norm")))
    if kind == "linear":
        out = draw(widths)
        return ("linear", width, out, draw(st.booleans()), draw(seeds)), out
    if kind == "activation":
        return ("activation", draw(st.sampled_from(sorted(ACTIVATIONS)))), width
    if kind == "layer_norm":
        return ("layer_norm", width, draw(st.one_of(st.none(), seeds))), width
    return (kind,), width


@st.composite
def tree_spec(
    draw, width: int, depth: int, learning: bool, variety: bool = False
) -> tuple[Spec, int]:
    """A random tree taking `(..., width)`; returns `(spec, output width)`."""
    kinds = ["frozen", "frozen"] + (["learn"] if learning else [])
    if depth > 0:
        kinds += ["sequential", "residual", "attention"]
    kind = draw(st.sampled_from(kinds))
    if kind == "frozen":
        return draw(frozen_leaf_spec(width))
    if kind == "learn":
        spec = draw(learning_spec(width, variety=variety))
        return spec, spec[3]
    if kind == "sequential":
        children, w = [], width
        for _ in range(draw(st.integers(1, 3))):
            child, w = draw(tree_spec(w, depth - 1, learning, variety))
            children.append(child)
        return ("sequential", tuple(children)), w
    if kind == "residual":
        branch, w = draw(tree_spec(width, depth - 1, learning, variety))
        if w != width:  # a branch must keep the width: close it with a projection
            branch = ("sequential", (branch, ("linear", w, width, True, draw(seeds))))
        return ("residual", branch), width
    # attention: Q/K/V slots `width -> qkv`, output slot `qkv -> out`, each frozen or learning
    heads = draw(st.sampled_from((1, 2)))
    qkv = draw(st.sampled_from((4,) if heads == 2 else WIDTHS))
    out = draw(widths)

    def slot(w_in: int, w_out: int) -> Spec:
        if learning and draw(st.booleans()):
            return draw(learning_spec(w_in, w_out, variety=variety))
        return ("linear", w_in, w_out, draw(st.booleans()), draw(seeds))

    slots = tuple(slot(width, qkv) for _ in range(3))
    return ("attention", heads, slots, slot(qkv, out)), out


def has_learning(spec: Spec) -> bool:
    if spec[0] == "learn":
        return True
    return any(isinstance(s, tuple) and has_learning(s) for s in spec[1:])


@st.composite
def learning_tree_spec(draw, variety: bool = False) -> tuple[Spec, int, int]:
    """`(spec, input width, output width)` of a tree holding at least one learning part."""
    width = draw(widths)
    spec, out = draw(tree_spec(width, 2, learning=True, variety=variety))
    if not has_learning(spec):
        head = draw(learning_spec(out, variety=variety))
        spec, out = ("sequential", (spec, head)), head[3]
    return spec, width, out


@st.composite
def frozen_tree_spec(draw) -> tuple[Spec, int]:
    width = draw(widths)
    spec, _ = draw(tree_spec(width, 2, learning=False))
    return spec, width


# --------------------------------------------------------------------------- building
def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float32 on the host (NumPy: no XLA compilation per new shape)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _optimiser(name: str):
    return {"sgd": optax.sgd(RATE), "adam": optax.adam(1e-2), "none": None}[name]


def build(spec: Spec) -> fusedpc.AbstractPart:
    kind = spec[0]
    if kind == "linear":
        _, w_in, w_out, bias, seed = spec
        weight = normal(seed, (w_out, w_in)) / np.float32(np.sqrt(w_in))
        bias = jnp.asarray(0.1 * normal(seed + 1, (w_out,))) if bias else None
        return frozen.linear(weight, bias)
    if kind == "activation":
        return frozen.activation(spec[1])
    if kind == "tanh":
        return frozen.tanh()
    if kind == "softmax":
        return frozen.softmax()
    if kind == "layer_norm":
        _, width, seed = spec
        if seed is None:
            return frozen.layer_norm(width=width)
        module = eqx.tree_at(
            lambda m: (m.weight, m.bias),
            eqx.nn.LayerNorm(width),
            (
                jnp.asarray(1.0 + 0.3 * normal(seed, (width,))),
                jnp.asarray(0.2 * normal(seed + 1, (width,))),
            ),
        )
        return frozen.layer_norm(module)
    if kind == "learn":
        _, w_in, hidden, w_out, acts, options, seed = spec
        options = dict(options)
        sizes = [w_in, *hidden, w_out]
        weights = [
            normal(seed + i, (o, n)) / np.float32(np.sqrt(n))
            for i, (n, o) in enumerate(zip(sizes[:-1], sizes[1:]))
        ]
        biases = [0.1 * normal(seed + 100 + i, (o,)) for i, o in enumerate(sizes[1:])]
        network = fusedpc.PCNetwork(
            sizes,
            acts,
            options.get("head", "gaussian"),
            bias=options["bias"],
            input_activation=options["input_activation"],
            hidden_precision=options["hidden_precision"],
            weights=weights,
            biases=biases if options["bias"] else None,
        )
        learning_kind = options.get("kind", "precision_weighted")
        optimiser = _optimiser(options.get("optimiser", "sgd"))
        kwargs = None
        if learning_kind == "synaptic_uncertainty":
            optimiser, kwargs = None, {"window": 4}
        return fusedpc.LearningNetwork(
            network,
            optimiser,
            learning_kind,
            kwargs,
            update_precisions=options.get("update_precisions", False),
        )
    if kind == "sequential":
        return fusedpc.Sequential([build(child) for child in spec[1]])
    if kind == "residual":
        return fusedpc.Residual(build(spec[1]))
    if kind == "attention":
        _, heads, (q, k, v), o = spec
        return fusedpc.MultiHeadAttention(
            wq=build(q), wk=build(k), wv=build(v), wo=build(o), n_heads=heads
        )
    raise AssertionError(f"unknown spec {spec!r}")


def _inputs(width: int, out: int, seed: int) -> tuple[jax.Array, jax.Array]:
    return normal(seed, (BATCH, SEQ, width)), normal(seed + 1, (BATCH, SEQ, out))


def _host(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: np.array(a, copy=True), tree)


def _eager_step(part: fusedpc.AbstractPart, x, target) -> tuple[fusedpc.FusedPipeline, Any]:
    """One pipeline step, run eagerly; returns the pipeline and its input error."""
    pipeline = fusedpc.FusedPipeline(part, error_normalisation="rows")
    with jax.disable_jit():
        _, input_error = pipeline.step(x, target)
    return pipeline, input_error


# --------------------------------------------------------------------------- (a) frozen: vjp
@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
@SETTINGS
@given(frozen_tree_spec(), seeds)
def test_frozen_backward_matches_vjp(tree, seed):
    spec, width = tree
    part = build(spec)
    x = normal(seed, (BATCH, SEQ, width))
    state = part.init_state(jax.random.key(0))
    out = jax.eval_shape(lambda s, x: part.compile("").forward(s, x, CTX)[0], state, x)
    worst = fusedpc.check_backward(part, x, error=normal(seed + 1, out.shape), state=state)
    # Softmax and layer norm over 2 to 4 features: the worst entry relative to the largest.
    assert worst <= 1e-5, (spec, worst)


# --------------------------------------------------------------------------- (b) backprop twin
def _learnable_mask(state: Any) -> Any:
    """True on the weights and biases of every learning network, False elsewhere."""

    def mark(node):
        if isinstance(node, fusedpc.LearningNetworkState):
            flags = jax.tree_util.tree_map(lambda _: False, node)
            return eqx.tree_at(
                lambda s: s.params, flags, jax.tree_util.tree_map(lambda _: True, node.params)
            )
        return False

    return jax.tree_util.tree_map(
        mark, state, is_leaf=lambda n: isinstance(n, fusedpc.LearningNetworkState)
    )


def _flat(tree: Any) -> np.ndarray:
    leaves = [np.asarray(a, np.float64).ravel() for a in jax.tree_util.tree_leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0)


@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
@SETTINGS
@given(learning_tree_spec(), seeds)
def test_learning_tree_matches_its_backprop_twin(tree, seed):
    spec, width, out = tree
    part = build(spec)
    x, target = _inputs(width, out, seed)
    state = part.init_state(jax.random.key(0))
    mask = _learnable_mask(state)
    params, rest = eqx.partition(state, mask)
    core = part.compile("")

    # The twin: the loss whose row-mean gradient every part takes, mean over the B*T rows of
    # 1/2 sum over features of (y - t)^2, differentiated through the tree's own forward.
    def loss(p, inputs):
        y = core.forward(eqx.combine(p, rest), inputs, CTX)[0]
        return 0.5 * jnp.mean(jnp.sum((y - target) ** 2, axis=-1))

    grads, x_grad = jax.grad(loss, argnums=(0, 1))(params, x)
    twin_update = jax.tree_util.tree_map(lambda g: -RATE * g, grads)
    twin_state = jax.tree_util.tree_map(lambda p, u: p + u, params, twin_update)

    kept = _host(state)
    pipeline, input_error = _eager_step(part, x, target)
    assert bool(pipeline.last_metrics.committed), spec
    new_params, new_rest = eqx.partition(pipeline.state, mask)

    # Weights and biases: the state after one step, norm-relative.
    got, want = _flat(new_params), _flat(twin_state)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), spec
    # The update itself (much smaller than the weights): equal up to 1e-5 of its size plus
    # the float32 rounding of storing `w + update`.
    fused_update = got - _flat(eqx.partition(kept, mask)[0])
    wanted_update = _flat(twin_update)
    slack = 1e-5 * np.linalg.norm(wanted_update) + 2 * FLOAT32_EPS * np.linalg.norm(got)
    assert np.linalg.norm(fused_update - wanted_update) <= slack, spec
    # Everything else (frozen parameters, fixed precisions, SGD's empty state): unchanged.
    for old, new in zip(
        jax.tree_util.tree_leaves(eqx.partition(kept, mask)[1]),
        jax.tree_util.tree_leaves(new_rest),
        strict=True,
    ):
        assert np.array_equal(old, np.asarray(new)), spec
    # The input error: the per-row gradient of the summed (not averaged) loss.
    got, want = _flat(input_error), _flat(ROWS * x_grad)
    output_error = _flat(core.forward(state, x, CTX)[0] - target)
    slack = 1e-5 * np.linalg.norm(want) + 1e-6 * np.linalg.norm(output_error)
    assert np.linalg.norm(got - want) <= slack, spec


# --------------------------------------------------------------------------- (c) structure
@pytest.mark.slow  # end to end: left out of the fast loop, -m 'not slow'
@SETTINGS
@given(st.one_of(learning_tree_spec(variety=True), frozen_tree_spec()), seeds)
def test_step_keeps_the_state_structure(tree, seed):
    spec, width = tree[0], tree[1]
    part = build(spec)
    state = part.init_state(jax.random.key(0))
    before = shapes_and_dtypes(state)
    structure = jax.tree_util.tree_structure(state)
    x = normal(seed, (BATCH, SEQ, width))
    out = jax.eval_shape(lambda s, x: part.compile("").forward(s, x, CTX)[0], state, x)
    target = normal(seed + 1, out.shape)

    pipeline, input_error = _eager_step(part, x, target)
    assert jax.tree_util.tree_structure(pipeline.state) == structure, spec
    assert shapes_and_dtypes(pipeline.state) == before, spec
    assert input_error.shape == x.shape and input_error.dtype == x.dtype
    assert pipeline.steps == 1
    # merge() writes the state back into a new tree; initialising that tree again gives the
    # very same state (structure and values).
    again = pipeline.merge().init_state(jax.random.key(1))
    assert jax.tree_util.tree_structure(again) == structure, spec
    for a, b in zip(
        jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(pipeline.state), strict=True
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b)), spec
