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

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._checks import expect_last_axis
from fusedpc.core._context import StepContext
from fusedpc.core._metrics import PartMetrics
from fusedpc.core._part import AbstractPart, Core, LinearParams, PyTree, replace_fields
from fusedpc.core._precision import widened
from fusedpc.parts._activations import Activation
from fusedpc.parts.learning._local_update import (
    SynapticSettings,
    resolve_learning,
    scaled_synaptic_gradient,
    synaptic_step,
)
from fusedpc.parts.learning._network import PCNetwork, network_records
from fusedpc.parts.learning._rules import LearningRule, learning_rule, rule_spelling


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
) -> Callable[[NetworkParams, Any, StepContext], tuple[Any, NetworkCache]]:
    """The prediction sweep of `net` as a pure function `(params, x, ctx) -> (y, cache)`: every
    $\\hat z_{l+1} = g_l(\\hat z_l) W_l^\\top + b_l$ over the rows of `(..., in)` input, the head
    on the last; the cache holds what a learning step reads (`NetworkCache`). Shared by every
    part built on a `PCNetwork` (`LearningNetwork`, `IterativeNetwork`). Checks the input's
    width and dtype, naming `path`."""
    n_mats = net.n_matrices
    acts = [net.layer_activation(l) for l in range(n_mats)]
    input_is_identity = net.input_activation == "identity"

    def sweep(params: NetworkParams, x, ctx: StepContext):
        expect_last_axis(path, x, net.sizes[0])
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{path or '<root>'}: expected a floating-point input, got dtype {x.dtype}."
            )
        lead = x.shape[:-1]
        rows = ctx.to_compute(x.reshape(-1, net.sizes[0]))
        a = rows if input_is_identity else acts[0].value(rows)
        activations, pre_activations = [a], []
        w, b = params.weights, params.biases
        for l in range(n_mats):
            z = ctx.matmul(a, w[l].T)
            bias = b[l]
            if bias is not None:
                z = z + ctx.to_compute(bias)
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
        learning_kind: the rule (`fusedpc.parts.learning`): `PrecisionWeighted()` (default;
            the backprop gradient), `Standard()` (confidence-scaled steps) or
            `SynapticUncertainty(window=N, ...)` (per-weight beliefs, no optimiser); or its
            name with `learning_kwargs` (the CLI's and the file's spelling; `part.rule`).
        learning_kwargs: with a name: `SynapticUncertainty`'s fields (`window` required).
        update_precisions: False (default; precisions fixed, the parity setting) or True:
            each hidden layer's precision gains its batch-mean evidence
            $\\mathrm{mean}_r(\\pi^+_l - \\pi_l)$ and then leaks,
            $\\pi_l \\leftarrow (1/\\pi_l + \\Delta t\\, e^{\\omega})^{-1}$.
        time_step: $\\Delta t$ of the leak. tonic_volatility: $\\omega$ of the leak.
        weight_reuse: $k$, for a weight applied $k$ times per sample: gradient and importance
            are multiplied by $k$.
    """

    defers_updates: ClassVar[bool] = True

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
        learning_kind: str | LearningRule = "precision_weighted",
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
        learning_kind, learning_kwargs = rule_spelling("LearningNetwork", learning_kind,
                                                       learning_kwargs)
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

    @property
    def rule(self) -> LearningRule:
        """The learning rule as a typed object (`PrecisionWeighted()`, `Standard()`,
        `SynapticUncertainty(...)`)."""
        return learning_rule(self.learning_kind, dict(self.learning_kwargs))

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
        sweep = prediction_sweep(net, path)
        rule = _LocalRule.of(self)

        def forward(state: LearningNetworkState, x, ctx):
            return sweep(state.params, x, ctx)

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

        return Core(forward, rule.backward, write_back)


class _Sweep(NamedTuple):
    """What the sweep towards the input gives a `LearningNetwork`'s step: the row-mean
    descent `gradients` $\\bar G_l, \\bar g_l$, the synaptic importance `increments` $H_l$
    (`NetworkParams`-shaped; every entry None but for the synaptic kind), the `precisions`
    after the step (one per non-input layer) and the `input_error` $e_0$ `(R, in)`."""

    gradients: NetworkParams
    increments: NetworkParams
    precisions: tuple[jax.Array, ...]
    input_error: jax.Array


class _HiddenStep(NamedTuple):
    """The sweep's values at hidden layer $l$, handed on to layer $l - 1$: the message
    $e_l = R_l$, the child factor $u_l$ of the weight gradient, the child precision
    $\\kappa_l$, the synaptic importance and the layer's precision $\\pi_l$ after the step."""

    message: jax.Array
    child_factor: jax.Array
    kappa: jax.Array
    importance: jax.Array
    precision: jax.Array


@dataclasses.dataclass(frozen=True)
class _LocalRule:
    """The static configuration of a `LearningNetwork`'s step (no arrays: the state brings
    them) and its backward, in the notation of the module docstring.

    `sizes` and `head` of the network, `acts` $g_0 \\dots g_{L-1}$, `kind` (the learning
    kind), `reuse` $k$ (`weight_reuse`), `synaptic` (settings of the synaptic kind, else
    None), `update_precisions`, `leak` $\\Delta t\\, e^{\\omega}$ and the optax `optimiser`.
    """

    sizes: tuple[int, ...]
    head: str
    acts: tuple[Activation, ...]
    input_is_identity: bool
    kind: str
    reuse: float
    synaptic: SynapticSettings | None
    update_precisions: bool
    leak: float
    optimiser: Any

    @classmethod
    def of(cls, part: LearningNetwork) -> _LocalRule:
        """The configuration of `part`."""
        net = part.network
        return cls(
            sizes=tuple(net.sizes),
            head=net.head,
            acts=tuple(net.layer_activation(l) for l in range(net.n_matrices)),
            input_is_identity=net.input_activation == "identity",
            kind=part.learning_kind,
            reuse=part.weight_reuse,
            synaptic=part.synaptic,
            update_precisions=part.update_precisions,
            leak=part.time_step * math.exp(part.tonic_volatility),
            optimiser=part.optimiser,
        )

    def backward(self, state: LearningNetworkState, cache: NetworkCache, error: jax.Array,
                 ctx: StepContext) -> tuple[jax.Array, LearningNetworkState, PartMetrics]:
        """The learning step (`Core.backward`): the sweep towards the input from the output
        error $E$ `(..., out)` (in float32), then the weight step, the precisions of the sweep
        and the standard report; hands back $e_0$ `(..., in)`."""
        lead = error.shape[:-1]
        err = widened(error.reshape(-1, self.sizes[-1]))  # the recursion runs in float32
        sweep = self.error_sweep(state, cache, err, ctx)
        params, opt_state, weight_precision = self.weight_step(state, sweep, ctx)
        new_state = LearningNetworkState(params, sweep.precisions, opt_state, weight_precision)
        input_error = sweep.input_error.reshape(*lead, self.sizes[0])
        metrics = ctx.learning_metrics(state.params, params, error, input_error, self.sizes)
        return input_error, new_state, metrics

    def output_seed(self, precision: jax.Array, err: jax.Array,
                    cache: NetworkCache) -> tuple[jax.Array, jax.Array]:
        """The output's message and curvature: $(\\pi_L E, \\pi_L)$ for a gaussian head,
        $(E, \\hat y (1 - \\hat y))$ at the logits of a categorical or binary head."""
        if self.head == "gaussian":
            return precision * err, jnp.broadcast_to(precision, err.shape)
        out = cast(jax.Array, cache.output)  # cached by every head but the gaussian
        return err, out * (1.0 - out)

    def error_sweep(self, state: LearningNetworkState, cache: NetworkCache, err: jax.Array,
                    ctx: StepContext) -> _Sweep:
        """One sweep from the output error `err` `(R, out)` towards the input: at each
        matrix $l$ (output side first) the gradients $\\bar G_l = (k/R)\\, u_{l+1}^\\top a_l$ and
        $\\bar g_l = (k/R) \\sum_r u_{l+1}$, the synaptic increments $H_l$, then $e_{l+1} W_l$
        routed into hidden layer $l$ (`hidden_step`) or, at the input, $e_0 = g_0'(x) \\odot
        (e_1 W_0)$."""
        n_rows, n_mats, k = err.shape[0], len(self.acts), self.reuse
        w, b = state.params.weights, state.params.biases
        precisions = state.precisions
        message, curvature = self.output_seed(precisions[-1], err, cache)
        child_factor = err if self.kind == "standard" else message
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
            grads_w[l] = (k / n_rows) * ctx.weight_gradient(child_factor, a)
            if b[l] is not None:
                grads_b[l] = (k / n_rows) * jnp.sum(widened(child_factor), axis=0)
            if self.synaptic is not None:
                increments_w[l], increments_b[l] = self.increments(importance, a,
                                                                   b[l] is not None)
            back = ctx.matmul(message, w[l])
            if l == 0:
                if self.input_is_identity:
                    input_error = back
                else:
                    x_rows = cast(jax.Array, cache.x)  # cached for a non-identity input
                    input_error = self.acts[0].first(x_rows) * back
                break
            message, child_factor, kappa, importance, new_precisions[l - 1] = self.hidden_step(
                l, back, cache.pre_activations[l - 1], precisions[l - 1], w[l], kappa,
                importance,
            )
        return _Sweep(
            NetworkParams(tuple(grads_w), tuple(grads_b)),
            NetworkParams(tuple(increments_w), tuple(increments_b)),
            tuple(new_precisions),
            input_error,
        )

    def increments(self, importance: jax.Array, a: jax.Array,
                   has_bias: bool) -> tuple[jax.Array, jax.Array | None]:
        """The synaptic increments of matrix $l$ from the child's importance $h$ `(R, out)`
        and the parent's activations $a_l$ `(R, in)`: $H^W = k\\, \\mathrm{mean}_r h \\otimes
        \\mathrm{mean}_r a_l^2$ and, with a bias, $H^b = k\\, \\mathrm{mean}_r h$."""
        mean_importance = self.reuse * jnp.mean(importance, axis=0)
        a_wide = widened(a)
        weight = mean_importance[:, None] * jnp.mean(a_wide * a_wide, axis=0)[None, :]
        return weight, (mean_importance if has_bias else None)

    def hidden_step(self, l: int, back: jax.Array, z_hat: jax.Array, pi: jax.Array,
                    w_l: jax.Array, kappa: jax.Array, importance: jax.Array) -> _HiddenStep:
        """The sweep at hidden layer $l$ from `back` $= e_{l+1} W_l$ `(R, n_l)`, $\\hat z_l$,
        $\\pi_l$, $W_l$ and the child precision $\\kappa_{l+1}$: $e_l = R_l = g_l'(\\hat z_l)
        \\odot e_{l+1} W_l$, $\\xi_l = g_l'^2 \\odot (\\kappa_{l+1} (W_l \\odot W_l))$,
        $\\kappa_l = \\pi_l \\xi_l / (\\pi_l + \\xi_l)$, the child factor $u_l$ ($R_l / \\pi^+_l$
        for the standard kind, else $R_l$), the importance $\\max(g_l'^2 \\odot (h (W_l \\odot
        W_l)), 0)$ (synaptic kind) and, with `update_precisions`, $\\pi_l \\leftarrow (1 /
        (\\pi_l + \\mathrm{mean}_r(\\pi^+_l - \\pi_l)) + \\Delta t\\, e^{\\omega})^{-1}$."""
        act = self.acts[l]
        back = widened(back)
        z = widened(z_hat)
        first = act.first(z)
        routed = first * back
        w_squared = w_l * w_l
        evidence = first * first * (kappa @ w_squared)
        if self.kind == "standard" or self.update_precisions:
            posterior = jnp.maximum(pi + evidence + act.second(z) * back, pi)
        precision = pi
        if self.update_precisions:
            gained = pi + jnp.mean(posterior - pi, axis=0)
            precision = 1.0 / (1.0 / gained + self.leak)
        if self.synaptic is not None:
            importance = jnp.maximum(first * first * (importance @ w_squared), 0.0)
        kappa = pi * evidence / (pi + evidence)
        child_factor = routed / posterior if self.kind == "standard" else routed
        return _HiddenStep(routed, child_factor, kappa, importance, precision)

    def weight_step(self, state: LearningNetworkState, sweep: _Sweep,
                    ctx: StepContext) -> tuple[NetworkParams, PyTree, NetworkParams | None]:
        """`(params, opt_state, weight_precision)` after the step on the sweep's gradients:
        the synaptic rule (`_synaptic_network_step`), the optax optimiser, or nothing."""
        params, opt_state = state.params, state.opt_state
        if self.synaptic is not None:
            extra = cast(NetworkParams, state.weight_precision)  # kept by the synaptic kind
            return _synaptic_network_step(self.synaptic, self.optimiser, params,
                                         sweep.gradients, opt_state, extra, sweep.increments)
        if self.optimiser is not None:
            params, opt_state = ctx.optimiser_step(self.optimiser, params, sweep.gradients,
                                                   opt_state)
        return params, opt_state, None


def _synaptic_network_step(
    settings: SynapticSettings, optimiser: Any, params: NetworkParams,
    gradients: NetworkParams, opt_state: PyTree, weight_precision: NetworkParams,
    increments: NetworkParams,
) -> tuple[NetworkParams, PyTree, NetworkParams]:
    """`synaptic_step` on every weight and bias of a network: `(params, opt_state,
    weight_precision)` after it, from the descent `gradients` (scaled by a rate multiplier
    `optimiser`, `scaled_synaptic_gradient`), the precisions above the prior and the
    importance `increments` $H$ (entries None where a matrix has no bias)."""
    scaled, opt_state = scaled_synaptic_gradient(optimiser, gradients, opt_state)
    pairs_w = [
        synaptic_step(settings, w, g, extra, h)
        for w, g, extra, h in zip(params.weights, scaled.weights, weight_precision.weights,
                                  increments.weights)
    ]
    pairs_b = [
        # where a bias is an array, so are its gradient, precision and increment
        None if bias is None else synaptic_step(
            settings, bias, g, extra, h)  # type: ignore[arg-type]
        for bias, g, extra, h in zip(params.biases, scaled.biases, weight_precision.biases,
                                     increments.biases)
    ]
    new_params = NetworkParams(
        tuple(p[0] for p in pairs_w),
        tuple(None if p is None else p[0] for p in pairs_b),
    )
    new_precision = NetworkParams(
        tuple(p[1] for p in pairs_w),
        tuple(None if p is None else p[1] for p in pairs_b),
    )
    return new_params, opt_state, new_precision

__all__ = [
    "LearningNetwork",
    "LearningNetworkState",
    "NetworkCache",
    "NetworkParams",
    "network_params",
    "prediction_sweep",
]
