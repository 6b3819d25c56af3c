"""The learning part: a predictive-coding network that learns locally, with exact parity.

Notation (see `docs/learning.md`): rows $r = 1 \\dots R$ (every leading axis flattened),
$a_l = g_l(\\hat z_l)$ the activation of layer $l$, $E$ the descent error at the output.

**Learning step.** The output is clamped to the observation $\\hat y - E$, so the output's
precision-weighted error is $e_L = \\pi_L E$ (gaussian head; $e_L = E$ at the logits of a
categorical or binary head). One sweep towards the input with fixed predictions gives at each
hidden layer $l$ the *routed error* and the *evidence*

$$R_l = g_l'(\\hat z_l) \\odot (e_{l+1} W_l), \\qquad
\\xi_l = g_l'(\\hat z_l)^2 \\odot (\\kappa_{l+1} (W_l \\odot W_l)),$$

a posterior precision $\\pi^+_l = \\max(\\pi_l + \\xi_l + g_l''(\\hat z_l) \\odot (e_{l+1} W_l),
\\pi_l)$ and a belief shift $\\delta_l = R_l / \\pi^+_l$. The message that layer $l$ sends on is
its precision-weighted error $e_l = \\pi^+_l \\delta_l = R_l$, carried directly (never recovered
as a difference of two nearly equal means: that is what keeps parity float32-exact). The child
precision passed on is $\\kappa_l = \\pi_l \\xi_l / (\\pi_l + \\xi_l)$, with $\\kappa_L = \\pi_L$
(gaussian) or $\\hat y(1 - \\hat y)$ (categorical, binary).

**Weight gradient.** $\\bar G_l = k \\cdot \\mathrm{mean}_r\\, u_{l+1} \\otimes a_l$ and
$\\bar g_l = k \\cdot \\mathrm{mean}_r\\, u_{l+1}$ (bias), with $k$ = `weight_reuse` and the child
factor $u$ chosen by `learning_kind`: `precision_weighted` $u_l = e_l$ (exactly the backprop
gradient); `standard` $u_l = \\delta_l$ (the belief shift; $u_L = E$);
`synaptic_uncertainty` $u_l = e_l$ applied through `synaptic_step`.

**Input error** (per row, not divided by $R$): $e_0 = g_0'(x) \\odot (e_1 W_0)$.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._checks import expect_last_axis
from fusedpc.core._metrics import learning_metrics
from fusedpc.core._part import AbstractPart, Core, LinearParams, PyTree, replace_fields
from fusedpc.core._precision import matmul, to_compute, weight_gradient, widened
from fusedpc.parts.learning._local_update import (
    SynapticSettings,
    optax_step,
    resolve_learning,
    scaled_synaptic_gradient,
    synaptic_step,
)
from fusedpc.parts.learning._network import PCNetwork


class NetworkParams(eqx.Module):
    """The learnable parameters, the pytree the optimiser sees: `weights[l]` `(out, in)`,
    `biases[l]` `(out,)` or None."""

    weights: tuple[jax.Array, ...]
    biases: tuple[jax.Array | None, ...]


class NetworkCache(eqx.Module):
    """What a `LearningNetwork`'s backward reads, per row: `x` (the input rows `(R, in)`, None
    for an identity input activation), `activations` $a_l$ (`(R, n_l)`, input first),
    `pre_activations` $\\hat z_l$ of the hidden layers and `output` (the head's output, None
    for a gaussian head)."""

    x: jax.Array | None
    activations: tuple[jax.Array, ...]
    pre_activations: tuple[jax.Array, ...]
    output: jax.Array | None


def prediction_sweep(
    net: PCNetwork, path: str
) -> Callable[[NetworkParams, Any], tuple[Any, NetworkCache]]:
    """The prediction sweep of `net` as a pure function `(params, x) -> (y, cache)`: every
    $\\hat z_{l+1} = g_l(\\hat z_l) W_l^\\top + b_l$ over the rows of `(..., in)` input, the head
    on the last; the cache holds what a learning step reads (`NetworkCache`). Shared by every
    part built on a `PCNetwork` (`LearningNetwork`, `IterativeNetwork`). Checks the input's
    width and dtype, naming `path`."""
    n_mats = net.n_matrices
    acts = [net.layer_activation(l) for l in range(n_mats)]
    input_is_identity = net.input_activation == "identity"

    def sweep(params: NetworkParams, x):
        expect_last_axis(path, x, net.sizes[0])
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{path or '<root>'}: expected a floating-point input, got dtype {x.dtype}."
            )
        lead = x.shape[:-1]
        rows = to_compute(x.reshape(-1, net.sizes[0]))
        a = rows if input_is_identity else acts[0].value(rows)
        activations, pre_activations = [a], []
        w, b = params.weights, params.biases
        for l in range(n_mats):
            z = matmul(a, w[l].T)
            bias = b[l]
            if bias is not None:
                z = z + to_compute(bias)
            if l < n_mats - 1:
                pre_activations.append(z)
                a = acts[l + 1].value(z)
                activations.append(a)
        out = net.apply_head(z if net.head == "gaussian" else widened(z))
        cache = NetworkCache(
            x=None if input_is_identity else rows,
            activations=tuple(activations),
            pre_activations=tuple(pre_activations),
            output=out if net.head != "gaussian" else None,
        )
        return out.reshape(*lead, net.sizes[-1]), cache

    return sweep


def network_records(owner: str, network: PCNetwork, path: str) -> tuple[LinearParams, ...]:
    """The network's weights and biases as `LinearParams` records, input side first; a
    `TypeError` naming `path` and the `owner` part type for a network whose weights are drawn
    at `init_state`."""
    if network.weights is None:
        raise TypeError(
            f"{path or '<root>'}: {owner} has no weights to export yet (they are "
            "drawn when the state is initialised); export pipeline.merge() instead."
        )
    biases = cast(tuple[jax.Array | None, ...], network.biases)  # set with the weights
    return tuple(LinearParams(w, b) for w, b in zip(network.weights, biases))


def network_params(network: PCNetwork, key: jax.Array) -> NetworkParams:
    """The network's weights and biases, drawn from `key` when it has none."""
    if network.weights is None:
        weights, biases = network.initial_arrays(key)
    else:
        # a network given its weights holds its biases too
        weights, biases = network.weights, cast(tuple[jax.Array | None, ...], network.biases)
    return NetworkParams(tuple(weights), tuple(biases))


class LearningNetworkState(eqx.Module):
    """State of a `LearningNetwork`.

    `params` (weights and biases), `precisions` (one `(n_l,)` array per non-input layer, the
    output's last), `opt_state` (optax state, None without an optimiser), `weight_precision`
    (per-weight precision above the prior, `NetworkParams`-shaped; synaptic kind only).
    """

    params: NetworkParams
    precisions: tuple[jax.Array, ...]
    opt_state: PyTree
    weight_precision: NetworkParams | None


class LearningNetwork(AbstractPart):
    """A `PCNetwork` that learns locally from the error at its output.

    Args:
        network: the `PCNetwork` (architecture, weights, precisions).
        optimiser: any optax transformation, fed the row-mean descent gradient; `None` freezes
            the weights (beliefs and precisions still run).
        learning_kind: `"precision_weighted"` (default; the backprop gradient),
            `"standard"` (confidence-scaled steps) or `"synaptic_uncertainty"` (per-weight
            beliefs; needs `learning_kwargs={"window": N, ...}` and no optimiser).
        learning_kwargs: synaptic settings `window` (required, >= 1), `prior_variance` (1.0),
            `prior_mean` (0.0), `learning_rate` (1.0), `increment_scale` (1.0).
        update_precisions: False (default; precisions fixed, the parity setting) or True:
            each hidden layer's precision gains its batch-mean evidence
            $\\mathrm{mean}_r(\\pi^+_l - \\pi_l)$ and then leaks,
            $\\pi_l \\leftarrow (1/\\pi_l + \\Delta t\\, e^{\\omega})^{-1}$.
        time_step: $\\Delta t$ of the leak. tonic_volatility: $\\omega$ of the leak.
        weight_reuse: $k$, for a weight applied $k$ times per sample: gradient and importance
            are multiplied by $k$.
    """

    network: PCNetwork
    optimiser: Any = eqx.field(static=True)
    learning_kind: str = eqx.field(static=True)
    learning_kwargs: tuple = eqx.field(static=True)
    update_precisions: bool = eqx.field(static=True)
    time_step: float = eqx.field(static=True)
    tonic_volatility: float = eqx.field(static=True)
    weight_reuse: float = eqx.field(static=True)
    synaptic: SynapticSettings | None = eqx.field(static=True)
    opt_state: PyTree
    weight_precision: NetworkParams | None

    def __init__(
        self,
        network: PCNetwork,
        optimiser: optax.GradientTransformation | None = None,
        learning_kind: str = "precision_weighted",
        learning_kwargs: dict | None = None,
        *,
        update_precisions: bool = False,
        time_step: float = 1.0,
        tonic_volatility: float = -4.0,
        weight_reuse: float = 1.0,
        opt_state: PyTree = None,
        weight_precision: NetworkParams | None = None,
    ):
        if not isinstance(network, PCNetwork):
            raise TypeError(
                f"LearningNetwork: network must be a PCNetwork, got {type(network).__name__}."
            )
        # Validated once, here (the errors name the bad setting); compile reads the result.
        self.synaptic = resolve_learning(
            "LearningNetwork", optimiser, learning_kind, learning_kwargs, weight_reuse
        )
        if not time_step > 0:
            raise ValueError(f"LearningNetwork: time_step must be > 0, got {time_step!r}.")
        self.network = network
        self.optimiser = optimiser
        self.learning_kind = learning_kind
        self.learning_kwargs = tuple(sorted((learning_kwargs or {}).items()))
        self.update_precisions = bool(update_precisions)
        self.time_step = float(time_step)
        self.tonic_volatility = float(tonic_volatility)
        self.weight_reuse = float(weight_reuse)
        self.opt_state = opt_state
        self.weight_precision = weight_precision

    def export_arrays(self, path: str = "") -> tuple[LinearParams, ...]:
        """One `LinearParams(weights[l], biases[l])` per matrix, input side first (the
        network's given arrays; a network drawn at `init_state` has none to export)."""
        return network_records("LearningNetwork", self.network, path)

    def init_state(self, key: jax.Array) -> LearningNetworkState:
        net = self.network
        params = network_params(net, key)
        opt_state = self.opt_state
        if opt_state is None and self.optimiser is not None:
            opt_state = self.optimiser.init(params)
        weight_precision = self.weight_precision
        if weight_precision is None and self.learning_kind == "synaptic_uncertainty":
            weight_precision = jax.tree_util.tree_map(jnp.zeros_like, params)
        return LearningNetworkState(params, tuple(net.precisions), opt_state, weight_precision)

    def compile(self, path: str) -> Core:
        net = self.network
        n_mats = net.n_matrices
        acts = [net.layer_activation(l) for l in range(n_mats)]
        input_is_identity = net.input_activation == "identity"
        synaptic = self.synaptic
        kind = self.learning_kind
        k = self.weight_reuse

        sweep = prediction_sweep(net, path)

        def forward(state: LearningNetworkState, x):
            return sweep(state.params, x)

        def backward(state: LearningNetworkState, cache: NetworkCache, error):
            lead = error.shape[:-1]
            err = widened(error.reshape(-1, net.sizes[-1]))  # the recursion runs in float32
            n_rows = err.shape[0]
            w, b = state.params.weights, state.params.biases
            precisions = state.precisions
            if net.head == "gaussian":
                message = precisions[-1] * err
                curvature = jnp.broadcast_to(precisions[-1], err.shape)
            else:
                message = err
                out = cast(jax.Array, cache.output)  # cached by every head but the gaussian
                curvature = out * (1.0 - out)
            child_factor = err if kind == "standard" else message
            importance = curvature  # Gauss-Newton diagonal, seeds the synaptic importance
            kappa = curvature
            # filled in by the loop below (a bias's slots only where the matrix has a bias)
            grads_w: list[Any] = [None] * n_mats
            grads_b: list[Any] = [None] * n_mats
            increments_w: list[Any] = [None] * n_mats
            increments_b: list[Any] = [None] * n_mats
            new_precisions = list(precisions)
            for l in reversed(range(n_mats)):
                a = cache.activations[l]
                grads_w[l] = (k / n_rows) * weight_gradient(child_factor, a)
                if b[l] is not None:
                    grads_b[l] = (k / n_rows) * jnp.sum(widened(child_factor), axis=0)
                if synaptic is not None:
                    mean_importance = k * jnp.mean(importance, axis=0)
                    a_wide = widened(a)
                    increments_w[l] = (
                        mean_importance[:, None] * jnp.mean(a_wide * a_wide, axis=0)[None, :]
                    )
                    if b[l] is not None:
                        increments_b[l] = mean_importance
                back = matmul(message, w[l])
                if l == 0:
                    if input_is_identity:
                        input_error = back
                    else:
                        x_rows = cast(jax.Array, cache.x)  # cached for a non-identity input
                        input_error = acts[0].first(x_rows) * back
                    break
                back = widened(back)
                z = widened(cache.pre_activations[l - 1])
                first = acts[l].first(z)
                pi = precisions[l - 1]
                routed = first * back
                w_squared = w[l] * w[l]
                evidence = first * first * (kappa @ w_squared)
                if kind == "standard" or self.update_precisions:
                    posterior = jnp.maximum(pi + evidence + acts[l].second(z) * back, pi)
                if self.update_precisions:
                    gained = pi + jnp.mean(posterior - pi, axis=0)
                    leak = self.time_step * math.exp(self.tonic_volatility)
                    new_precisions[l - 1] = 1.0 / (1.0 / gained + leak)
                if synaptic is not None:
                    importance = jnp.maximum(first * first * (importance @ w_squared), 0.0)
                kappa = pi * evidence / (pi + evidence)
                message = routed
                child_factor = routed / posterior if kind == "standard" else routed
            gradients = NetworkParams(tuple(grads_w), tuple(grads_b))
            params, opt_state, weight_precision = state.params, state.opt_state, None
            if synaptic is not None:
                extra = cast(NetworkParams, state.weight_precision)  # kept by the synaptic kind
                scaled, opt_state = scaled_synaptic_gradient(self.optimiser, gradients, opt_state)
                grads_w, grads_b = list(scaled.weights), list(scaled.biases)
                pairs_w = [
                    synaptic_step(synaptic, w[l], grads_w[l], extra.weights[l],
                                  increments_w[l])
                    for l in range(n_mats)
                ]
                pairs_b = [
                    None if b[l] is None else synaptic_step(
                        # where b[l] is an array, so is its precision
                        synaptic, b[l], grads_b[l], extra.biases[l],  # type: ignore[arg-type]
                        increments_b[l])
                    for l in range(n_mats)
                ]
                params = NetworkParams(
                    tuple(p[0] for p in pairs_w),
                    tuple(None if p is None else p[0] for p in pairs_b),
                )
                weight_precision = NetworkParams(
                    tuple(p[1] for p in pairs_w),
                    tuple(None if p is None else p[1] for p in pairs_b),
                )
            elif self.optimiser is not None:
                params, opt_state = optax_step(self.optimiser, params, gradients, opt_state)
            new_state = LearningNetworkState(
                params, tuple(new_precisions), opt_state, weight_precision
            )
            input_error = input_error.reshape(*lead, net.sizes[0])
            metrics = learning_metrics(
                state.params, params, error, input_error, net.sizes, measure_later=True)
            return input_error, new_state, metrics

        def write_back(state: LearningNetworkState) -> LearningNetwork:
            network = replace_fields(
                net,
                weights=state.params.weights,
                biases=state.params.biases,
                precisions=state.precisions,
            )
            return replace_fields(
                self,
                network=network,
                opt_state=state.opt_state,
                weight_precision=state.weight_precision,
            )

        return Core(forward, backward, write_back)


__all__ = [
    "LearningNetwork",
    "LearningNetworkState",
    "NetworkCache",
    "NetworkParams",
    "network_params",
    "network_records",
    "prediction_sweep",
]
