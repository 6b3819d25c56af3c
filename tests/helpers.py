"""Shared test helpers: the one tolerance helper, tiny reference parts and the conformance
registry.

Tolerances: compare with `assert_tree_allclose(a, b, rtol=..., atol=...)`; every call whose
tolerance is looser than float32 rounding says why in a one-line comment.

`CONFORMANCE_CASES` maps a case name to a factory returning `(part, example_input)`;
`tests/test_conformance.py` runs every check on every case. When you add a part type, append
one or more cases here (a tiny instance and a tiny input, float32, a few rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import frozen
from fusedpc.parts._activations import ACTIVATIONS

PyTree = Any


# --------------------------------------------------------------------------- traces
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> Any:
    """`scripts/<name>.py` imported as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def count_equations(jaxpr) -> int:
    """Equations of a jaxpr, including those of its sub-jaxprs (scan bodies and so on)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # a ClosedJaxpr
                    total += count_equations(sub.jaxpr)
                elif hasattr(sub, "eqns"):  # a Jaxpr
                    total += count_equations(sub)
    return total


# --------------------------------------------------------------------------- processes
def run_at_default_level(*args: str, timeout: float = 300) -> Any:
    """Runs `python *args` in a fresh process at XLA's default optimisation level (without
    the suite's level-0 flag, tests/conftest.py: that is what users get), on the CPU, with
    tests/ on its path; asserts that it succeeded and returns its last stdout line as JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "xla_backend_optimization_level" not in f
    )
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- optimisers
def capture_gradients() -> optax.GradientTransformation:
    """An 'optimiser' that keeps the gradient it is fed as its state and updates nothing."""

    def init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        del state, params
        return jax.tree_util.tree_map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(init, update)



# --------------------------------------------------------------------------- tolerances
def _leaves_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
    return [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _mismatch(a: PyTree, b: PyTree, rtol: float, atol: float) -> str | None:
    """None when `a` and `b` agree; otherwise a message naming the first leaf that differs."""
    sa, sb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if sa != sb:
        return f"tree structures differ:\n  {sa}\n  {sb}"
    for (path, x), (_, y) in zip(_leaves_with_paths(a), _leaves_with_paths(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return f"leaf {path or '<root>'}: shapes differ, {x.shape} vs {y.shape}"
        if x.dtype != y.dtype:
            return f"leaf {path or '<root>'}: dtypes differ, {x.dtype} vs {y.dtype}"
        if x.dtype.kind in "biuU" or x.dtype == np.bool_:
            if not np.array_equal(x, y):
                return f"leaf {path or '<root>'}: values differ"
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        if not np.allclose(x64, y64, rtol=rtol, atol=atol, equal_nan=True):
            diff = np.abs(x64 - y64)
            worst = np.unravel_index(np.argmax(diff - rtol * np.abs(y64)), diff.shape)
            return (
                f"leaf {path or '<root>'}: max |a - b| = {diff.max():.3e}; worst entry "
                f"{tuple(int(i) for i in worst)}: a = {x64[worst]!r}, b = {y64[worst]!r} "
                f"(rtol={rtol}, atol={atol})"
            )
    return None


def tree_allclose(a: PyTree, b: PyTree, rtol: float = 1e-6, atol: float = 0.0) -> bool:
    """Same structure, shapes and dtypes, and every leaf `allclose` (integers: equal)."""
    return _mismatch(a, b, rtol, atol) is None


def assert_tree_allclose(a: PyTree, b: PyTree, rtol: float = 1e-6, atol: float = 0.0) -> None:
    """`tree_allclose`, failing with a message that names the first leaf that differs."""
    message = _mismatch(a, b, rtol, atol)
    assert message is None, message


def norm_rel_error(a: PyTree, b: PyTree) -> float:
    r"""$\lVert a - b \rVert / \lVert b \rVert$ over all leaves (float64; 0 when both are 0)."""
    la = [np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(a)]
    lb = [np.asarray(y, np.float64).ravel() for y in jax.tree_util.tree_leaves(b)]
    assert len(la) == len(lb), f"{len(la)} leaves vs {len(lb)}"
    va = np.concatenate(la) if la else np.zeros(0)
    vb = np.concatenate(lb) if lb else np.zeros(0)
    assert va.shape == vb.shape, f"sizes differ: {va.shape} vs {vb.shape}"
    num, den = np.linalg.norm(va - vb), np.linalg.norm(vb)
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(num / den)


def shapes_and_dtypes(tree: PyTree) -> PyTree:
    """The tree with every array leaf replaced by its `ShapeDtypeStruct` (structure kept)."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def host_leaves(tree: PyTree) -> list[np.ndarray]:
    """A host copy of every leaf (a real copy: the device buffers are donated next)."""
    return [np.array(leaf, copy=True) for leaf in jax.tree_util.tree_leaves(tree)]


def assert_bitwise_equal(kept: list[np.ndarray], tree: PyTree) -> None:
    """Every leaf of `tree` equals its host copy in `kept`: dtype, shape and bits."""
    leaves = jax.tree_util.tree_leaves(tree)
    assert len(kept) == len(leaves)
    for old, new in zip(kept, leaves, strict=True):
        new = np.asarray(new)
        assert old.dtype == new.dtype and old.shape == new.shape
        assert np.array_equal(old, new), "the state changed"


def normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """Standard normal float32 array from an integer seed."""
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# --------------------------------------------------------------------------- reference parts
class DeltaLinearState(eqx.Module):
    """State of `DeltaLinear`: its parameters and its optimiser's state."""

    params: dict[str, jax.Array]
    opt_state: PyTree


class DeltaLinear(fusedpc.AbstractPart):
    r"""A learning part written only in the tests: $y = x W^\top + b$, learning by the delta rule.

    Shapes: `weight` `(out, in)`, `bias` `(out,)`, input `(..., in)`, output `(..., out)`.
    Backward, with $E$ the descent error at the output and $R$ rows (leading axes flattened):
    $\partial L/\partial x = E W$ (per row, with the weight before the step);
    $g_W = \tfrac1R E^\top x$, $g_b = \tfrac1R \sum_r E_r$ (the mean over rows, the gradient
    of the loss averaged over rows); the update is `ctx.optimiser_step(...)`, the step
    context's optimiser step. Only public fusedpc names are used, as a user's own part would;
    it declares no `defers_updates` (the default, False), so a `Repeat` of it keeps each
    block's optimiser step its own.
    """

    weight: jax.Array
    bias: jax.Array
    optimiser: optax.GradientTransformation = eqx.field(static=True)

    def init_state(self, key: jax.Array) -> DeltaLinearState:
        del key
        params = {"weight": self.weight, "bias": self.bias}
        return DeltaLinearState(params=params, opt_state=self.optimiser.init(params))

    def compile(self, path: str) -> fusedpc.Core:
        out_width, in_width = self.weight.shape
        where = path or "<root>"

        def forward(state: DeltaLinearState, x, ctx):
            if x.shape[-1] != in_width:
                raise ValueError(
                    f"{where}: expected input of shape (..., {in_width}), got {x.shape}."
                )
            return ctx.matmul(x, state.params["weight"].T) + state.params["bias"], x

        def backward(state: DeltaLinearState, x, error, ctx):
            rows_x = x.reshape(-1, in_width)
            rows_e = error.reshape(-1, out_width)
            n = rows_x.shape[0]
            grads = {"weight": rows_e.T @ rows_x / n, "bias": jnp.sum(rows_e, axis=0) / n}
            input_error = ctx.matmul(error, state.params["weight"])
            params, opt_state = ctx.optimiser_step(self.optimiser, state.params, grads,
                                                   state.opt_state)
            metrics = ctx.learning_metrics(
                state.params, params, error, input_error, (in_width, out_width)
            )
            return input_error, DeltaLinearState(params, opt_state), metrics

        def write_back(state: DeltaLinearState) -> DeltaLinear:
            p = state.params
            return eqx.tree_at(lambda m: (m.weight, m.bias), self, (p["weight"], p["bias"]))

        return fusedpc.Core(forward, backward, write_back)


def delta_linear(
    seed: int, in_width: int, out_width: int, optimiser: optax.GradientTransformation | None = None
) -> DeltaLinear:
    """A `DeltaLinear` with small random weights (default optimiser: SGD, rate 0.1)."""
    weight, bias = linear_params(seed, in_width, out_width)
    return DeltaLinear(weight, bias, optax.sgd(0.1) if optimiser is None else optimiser)


class SpyState(eqx.Module):
    """The error that the spy saw at its output in the last step."""

    seen: jax.Array


class Spy(fusedpc.AbstractPart):
    """Identity part that stores the error it sees in its state (read it from the pipeline)."""

    shape: tuple[int, ...] = eqx.field(static=True)

    def init_state(self, key: jax.Array) -> SpyState:
        del key
        return SpyState(jnp.zeros(self.shape, jnp.float32))

    def compile(self, path: str) -> fusedpc.Core:
        def forward(state, x, ctx):
            return x, None

        def backward(state, cache, error, ctx):
            finite = fusedpc.core.FiniteFlag(jnp.all(jnp.isfinite(error)))
            return error, SpyState(error), finite

        return fusedpc.Core(forward, backward, lambda state: self)


def linear_params(seed: int, in_width: int, out_width: int) -> tuple[jax.Array, jax.Array]:
    """A weight `(out, in)` scaled by $1/\\sqrt{in}$ and a bias `(out,)`."""
    weight = normal(seed, (out_width, in_width)) / np.float32(np.sqrt(in_width))
    return weight, 0.1 * normal(seed + 1, (out_width,))


def mlp_reference(weights: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    """Plain JAX twin of `Sequential([linear, tanh, linear, tanh, ..., linear])`."""
    for i, (w, b) in enumerate(weights):
        x = x @ w.T + b
        if i < len(weights) - 1:
            x = jnp.tanh(x)
    return x


# --------------------------------------------------------------------------- user formulas
def _scaled_sine_forward(params, x):
    # y = a * sin(x) + c, per feature; the cache is cos(x).
    return params["a"] * jnp.sin(x) + params["c"], jnp.cos(x)


def _scaled_sine_backward(params, cos_x, error):
    return error * params["a"] * cos_x


def scaled_sine(width: int = 4) -> fusedpc.Frozen:
    """A `Frozen` part built from user formulas: $y = a \\odot \\sin x + c$."""
    params = {"a": 1.0 + 0.5 * normal(7, (width,)), "c": normal(8, (width,))}
    return fusedpc.Frozen(_scaled_sine_forward, _scaled_sine_backward, params, in_width=width)


# --------------------------------------------------------------------------- conformance
Case = Callable[[], tuple[fusedpc.AbstractPart, jax.Array]]


def _eqx_linear(use_bias: bool) -> eqx.nn.Linear:
    return eqx.nn.Linear(4, 3, use_bias=use_bias, key=jax.random.key(1))


def _eqx_layer_norm() -> eqx.nn.LayerNorm:
    ln = eqx.nn.LayerNorm(5)
    # Non-trivial affine, so that the weight really enters the backward.
    return eqx.tree_at(
        lambda m: (m.weight, m.bias), ln, (1.0 + 0.3 * normal(3, (5,)), 0.2 * normal(4, (5,)))
    )


def _hybrid_tree() -> fusedpc.AbstractPart:
    w, b = linear_params(11, 5, 5)
    return fusedpc.Sequential(
        [
            delta_linear(12, 4, 5, optax.adam(1e-2)),
            frozen.gelu(),
            fusedpc.Residual(fusedpc.Sequential([frozen.layer_norm(width=5), frozen.linear(w, b)])),
            delta_linear(13, 5, 3),
        ]
    )


CONFORMANCE_CASES: dict[str, Case] = {
    "linear": lambda: (frozen.linear(*linear_params(0, 4, 3)), normal(100, (6, 4))),
    "linear_no_bias": lambda: (frozen.linear(linear_params(0, 4, 3)[0]), normal(100, (6, 4))),
    "linear_from_eqx": lambda: (frozen.linear(_eqx_linear(True)), normal(100, (2, 3, 4))),
    "linear_from_eqx_no_bias": lambda: (frozen.linear(_eqx_linear(False)), normal(100, (6, 4))),
    "gelu": lambda: (frozen.gelu(), normal(101, (6, 4))),
    "relu": lambda: (frozen.relu(), normal(102, (2, 3, 4))),
    "tanh": lambda: (frozen.tanh(), normal(103, (6, 4))),
    "softmax": lambda: (frozen.softmax(), normal(104, (2, 3, 5))),
    "layer_norm_from_eqx": lambda: (frozen.layer_norm(_eqx_layer_norm()), normal(105, (6, 5))),
    "layer_norm_width": lambda: (frozen.layer_norm(width=5), normal(106, (2, 3, 5))),
    **{
        f"activation_{name}": (lambda name=name: (frozen.activation(name), normal(107, (6, 4))))
        for name in sorted(ACTIVATIONS)
        if name not in ("gelu", "relu")  # frozen.gelu() and frozen.relu() are these very parts
    },
    "frozen_user_formulas": lambda: (scaled_sine(4), normal(108, (6, 4))),
    "sequential": lambda: (
        fusedpc.Sequential(
            [
                frozen.linear(*linear_params(20, 4, 5)),
                frozen.gelu(),
                frozen.layer_norm(width=5),
                frozen.linear(*linear_params(21, 5, 3)),
            ]
        ),
        normal(109, (6, 4)),
    ),
    "residual": lambda: (
        fusedpc.Residual(
            fusedpc.Sequential([frozen.linear(*linear_params(22, 4, 4)), frozen.tanh()])
        ),
        normal(110, (2, 3, 4)),
    ),
    "user_learning_part": lambda: (delta_linear(30, 4, 3), normal(111, (6, 4))),
    "hybrid_tree": lambda: (_hybrid_tree(), normal(112, (6, 4))),
    # the identity wherever no relaxation runs (a check, `as_module`, `predict`)
    "latent": lambda: (fusedpc.Latent(2.0), normal(113, (2, 3, 4))),
}


# --------------------------------------------------------------------------- learning parts
# Appended by the learning part's tests (PCNetwork, LearningNetwork, LearningEmbedding,
# LearningLayerNorm). Gaussian heads of unit output precision only: there the input error is
# the vjp of the forward (a categorical or binary head takes its error at the logits, and
# pi_out != 1 weights the loss).
def _learning_network() -> fusedpc.AbstractPart:
    network = fusedpc.PCNetwork(
        [4, 6, 5, 3], ("tanh", "gelu"), hidden_precision=1e2, key=jax.random.key(40)
    )
    return fusedpc.LearningNetwork(network, optax.adam(1e-2))


def _learning_network_synaptic() -> fusedpc.AbstractPart:
    network = fusedpc.PCNetwork(
        [4, 5, 3], "silu", input_activation="tanh", bias=(True, False), key=jax.random.key(41)
    )
    return fusedpc.LearningNetwork(
        network, None, "synaptic_uncertainty", {"window": 4}, update_precisions=True
    )


CONFORMANCE_CASES.update(
    {
        "learning_network": lambda: (_learning_network(), normal(113, (2, 3, 4))),
        "learning_network_synaptic": lambda: (_learning_network_synaptic(), normal(114, (6, 4))),
        "learning_embedding": lambda: (
            fusedpc.LearningEmbedding(normal(115, (11, 4)), optax.adam(1e-2)),
            jnp.array([[0, 3, 10], [3, 3, 7]], jnp.int32),
        ),
        "learning_layer_norm": lambda: (
            fusedpc.LearningLayerNorm(
                1.0 + 0.3 * normal(116, (5,)), 0.2 * normal(117, (5,)), optax.sgd(0.1)
            ),
            normal(118, (2, 3, 5)),
        ),
    }
)


# --------------------------------------------------------------------------- composite parts
# Attention, Repeat, TransformerBlock and the whole GPT. Width D = 8 with 2 heads for the
# attention-bearing cases; every optimiser a Repeat's blocks share is created once (Repeat
# compares static settings by identity).
def _frozen_attention(seed: int, width: int = 8, n_heads: int = 2) -> fusedpc.MultiHeadAttention:
    wq, wk, wv, wo = (frozen.linear(*linear_params(seed + i, width, width)) for i in range(4))
    return fusedpc.MultiHeadAttention(wq, wk, wv, wo, n_heads=n_heads)


def _fused_learning_attention(width: int = 8) -> fusedpc.MultiHeadAttention:
    keys = jax.random.split(jax.random.key(50), 4)
    linears = [eqx.nn.Linear(width, width, key=k) for k in keys]
    optimiser = optax.sgd(0.1)
    return fusedpc.MultiHeadAttention(
        wo=fusedpc.transplant.from_linear(linears[3], optimiser=optimiser),
        n_heads=2,
        wqkv=fusedpc.transplant.from_linears(linears[:3], optimiser=optimiser),
    )


def _repeat(unroll: bool, width: int = 4) -> fusedpc.Repeat:
    optimiser = optax.adam(1e-2)  # one object for every block: compared by identity

    def block(key: jax.Array) -> fusedpc.AbstractPart:
        network = fusedpc.PCNetwork([width, 5, width], "tanh", key=key)
        return fusedpc.Residual(
            fusedpc.Sequential(
                [frozen.layer_norm(width=width), fusedpc.LearningNetwork(network, optimiser)]
            )
        )

    return fusedpc.Repeat.from_factory(block, 3, jax.random.key(51), unroll=unroll)


def _transformer_block(width: int = 8) -> fusedpc.TransformerBlock:
    k1, k2 = jax.random.split(jax.random.key(52))
    feed_forward = fusedpc.transplant.from_feedforward(
        eqx.nn.Linear(width, 16, key=k1), eqx.nn.Linear(16, width, key=k2),
        optimiser=optax.sgd(0.1),
    )
    return fusedpc.TransformerBlock(
        frozen.layer_norm(width=width), _frozen_attention(53),
        frozen.layer_norm(width=width), feed_forward,
    )


def _gpt() -> fusedpc.GPTPart:
    config = fusedpc.GPTConfig(
        vocab_size=11, width=8, n_heads=2, n_blocks=2, ff_width=16, max_len=4, learn="all"
    )
    return fusedpc.build_gpt(config, optax.sgd(0.1), jax.random.key(0))[0]


# Distinct ids: the error at the embedding output then equals, row by row, the vjp of the
# forward with respect to the token table (test_conformance checks it there).
GPT_IDS = ((0, 3, 10, 5), (7, 1, 9, 2))

CONFORMANCE_CASES.update(
    {
        "attention_frozen_slots": lambda: (_frozen_attention(54), normal(119, (2, 4, 8))),
        "attention_fused_learning_qkv": lambda: (
            _fused_learning_attention(), normal(120, (2, 4, 8))
        ),
        "repeat_scanned": lambda: (_repeat(unroll=False), normal(121, (2, 3, 4))),
        "repeat_unrolled": lambda: (_repeat(unroll=True), normal(121, (2, 3, 4))),
        "transformer_block": lambda: (_transformer_block(), normal(122, (2, 4, 8))),
        "gpt": lambda: (_gpt(), jnp.array(GPT_IDS, jnp.int32)),
    }
)
