"""Predictive coding over the whole tree: the relaxation of every `fusedpc.Latent` on one
energy, inside the one compiled step (`docs/tree-pc.md`).

With latents $z_b$ at chosen boundaries and the segments between them predicting
$\\mu_b = f_b(z_{b-1})$, the energy is (every row on its own, rows averaged)

$$F = \\sum_b \\tfrac12 \\Pi_b \\lVert z_b - \\mu_b \\rVert^2 + \\mathrm{loss}(\\mu_{top}, t).$$

A **sweep** is one forward walk of the tree with every latent set to its current value
(each segment's prediction from the latent below it) and one backward walk that does not
learn (`StepContext(learning=False)`): the loss's error at the output and each latent's
$\\Pi_b(\\mu_b - z_b)$ are pulled back by the parts' own backward, so every latent reads its
energy gradient $\\partial F / \\partial z_b = \\Pi_b (z_b - \\mu_b) + J_{b+1}^\\top
\\Pi_{b+1}(\\mu_{b+1} - z_{b+1})$ (no `jax.grad`: the parts' hand-written or local
pullbacks). The latents start at their feed-forward values; sweep $t$ moves them by
$-\\eta\\, \\partial F / \\partial z$ (or an optax optimiser's step); sweeps $1 \\dots T-1$ are
one `lax.scan`, so the program does not grow with $T$. Then the **learning walk**: a forward
at the relaxed latents and the ordinary backward, in which each part learns from the error
at its output, $\\Pi_b(\\mu_b - z_b)$ below a latent and the loss's error at the top.

With `fixed_prediction=True` the predictions, the output and every Jacobian stay at their
feed-forward values: a sweep is a backward walk only, on the first forward's caches, and
the learning walk uses those caches too. Its errors then obey a linear recursion whose fixed
point is the backprop error at every latent; at rate $1/\\Pi$ it is reached exactly after as
many sweeps as the longest chain of latents (the Z-IL regime).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from fusedpc.core._context import StepContext
from fusedpc.core._metrics import iter_metrics
from fusedpc.core._part import AbstractPart, Core, PyTree
from fusedpc.core._precision import widened
from fusedpc.parts._latent import (
    Latent,
    LatentMetrics,
    LatentPull,
    LatentSlot,
    LatentState,
    is_latent_pull,
    is_latent_state,
)


@dataclasses.dataclass(frozen=True)
class Relaxation:
    """How a tree with `fusedpc.Latent` parts relaxes its latents in every step.

    Args:
        steps: $T \\ge 1$, the sweeps (each a forward and a backward walk that does not
            learn; one `lax.scan`).
        rate: $\\eta > 0$, the step size of the latents' gradient descent (ignored with an
            `optimiser`).
        optimiser: an optax transformation over the latents (its state fresh every step), or
            None for plain gradient descent at `rate`.
        fixed_prediction: hold every prediction, the output and every Jacobian at their
            feed-forward values (sweeps are backward walks only; the errors converge to the
            backprop errors, exactly at rate $1/\\Pi$ after as many sweeps as the longest
            chain of latents).
        record_energy: report each latent's energy before every sweep and after the last
            (`LatentMetrics.energy_trajectory`) and the whole tree's
            (`RelaxationReport.energy_trajectory`).
        backprop_distance: also compute the exact (backprop) step of the same tree and
            report how far the step's new state lies from it, relative to the backprop
            step's own size (`RelaxationReport.backprop_distance`); one more backward walk.
        tolerance: None (always `steps` sweeps, one `lax.scan`), or adaptive inference: the
            sweeps stop after the first whose energy differs from the previous sweep's by
            less than `tolerance` relative to it, at most `steps` (one `lax.while_loop`;
            the sweeps run reach `RelaxationReport.steps`). Needs an error function with a
            loss.
        incremental: incremental PC (iPC): the weights step at every sweep too, each part
            through its own optimiser, from the errors at that sweep's latents; the step
            takes `steps` weight steps (the sweeps after the first, then the learning walk).
            Not with `fixed_prediction`, a `tolerance` or a row mask.
    """

    steps: int = 8
    rate: float = 0.1
    optimiser: Any = None
    fixed_prediction: bool = False
    record_energy: bool = False
    backprop_distance: bool = False
    tolerance: float | None = None
    incremental: bool = False

    def __post_init__(self) -> None:
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(
                f"Relaxation: steps must be an integer >= 1, got {steps!r} (with no sweep the "
                "latents stay at their predictions and no part below the top one learns).")
        rate = float(self.rate) if isinstance(self.rate, numbers.Real) else math.nan
        if isinstance(self.rate, bool) or not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"Relaxation: rate must be a finite number > 0, got {self.rate!r}.")
        if self.optimiser is not None and not isinstance(
                self.optimiser, optax.GradientTransformation):
            raise TypeError(
                "Relaxation: optimiser must be an optax GradientTransformation or None, got "
                f"{type(self.optimiser).__name__}.")
        if self.tolerance is not None:
            tolerance = float(self.tolerance) if isinstance(
                self.tolerance, numbers.Real) else math.nan
            if isinstance(self.tolerance, bool) or not (math.isfinite(tolerance)
                                                        and tolerance > 0):
                raise ValueError(f"Relaxation: tolerance must be None or a finite number > 0, "
                                 f"got {self.tolerance!r}.")
            object.__setattr__(self, "tolerance", tolerance)
        object.__setattr__(self, "steps", int(steps))
        object.__setattr__(self, "rate", rate)
        for name in ("fixed_prediction", "record_energy", "backprop_distance", "incremental"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.incremental and (self.fixed_prediction or self.tolerance is not None):
            raise ValueError("Relaxation: incremental learns at every sweep from the sweep's own "
                             "predictions, so it takes neither fixed_prediction nor a "
                             "tolerance.")


class RelaxationReport(eqx.Module):
    """What a step of a tree with latents reports about its relaxation (`StepMetrics.
    relaxation`): the energy $F$ at the feed-forward latents (`energy_before`: the loss, every
    latent then being its prediction) and at the relaxed ones (`energy_after`), with
    `record_energy` its `energy_trajectory` `(T + 1,)`, and with `backprop_distance` the
    relative distance $\\lVert s_{pc} - s_{bp} \\rVert / \\lVert s_{bp} - s \\rVert$ of the
    step's new state from the backprop step's; `steps`, the sweeps run (`Relaxation.steps`,
    or fewer under a `tolerance`). NaN where the error function has no loss."""

    energy_before: jax.Array
    energy_after: jax.Array
    steps: jax.Array
    energy_trajectory: jax.Array | None = None
    backprop_distance: jax.Array | None = None

    def row(self) -> dict[str, Any]:
        """The report's row for the relaxation (host values)."""
        row: dict[str, Any] = {"part": "<relaxation>",
                               "energy_before": float(self.energy_before),
                               "energy_after": float(self.energy_after),
                               "steps": int(self.steps)}
        if self.energy_trajectory is not None:
            row["energy_trajectory"] = [float(v) for v in jnp.asarray(self.energy_trajectory)]
        if self.backprop_distance is not None:
            row["backprop_distance"] = float(self.backprop_distance)
        return row


def has_latents(tree: AbstractPart) -> bool:
    """Whether `tree` holds a `fusedpc.Latent` anywhere (walked through `children()`)."""
    if isinstance(tree, Latent):
        return True
    return any(has_latents(child) for _, child in tree.children())


def resolve_relaxation(tree: AbstractPart, relaxation: Any,
                       error_normalisation: str) -> Relaxation | None:
    """`make_step`'s `relaxation` checked against the tree: `Relaxation()` for a tree with
    latents and None; refused for a tree without any, or with `"active"` normalisation."""
    latents = has_latents(tree)
    if relaxation is not None and not isinstance(relaxation, Relaxation):
        raise TypeError(f"relaxation: expected a fusedpc.Relaxation or None, got "
                        f"{type(relaxation).__name__}.")
    if relaxation is not None and not latents:
        raise ValueError("relaxation: the tree has no fusedpc.Latent to relax; place Latent() "
                         "parts at the boundaries that should relax, or pass relaxation=None.")
    if latents and error_normalisation == "active":
        raise ValueError("error_normalisation: 'active' cannot tell padding rows of a tree with "
                         "latents (their relaxed errors are not exact zeros); pass a mask.")
    if latents and relaxation is None:
        return Relaxation()
    return relaxation


def check_tolerance(relaxation: Relaxation | None, loss: Any, name: str) -> None:
    """Adaptive inference reads the energy, so it needs the error function's loss."""
    if relaxation is not None and relaxation.tolerance is not None and loss is None:
        raise ValueError(f"relaxation: a tolerance stops on the energy, which needs the loss; "
                         f"error_fn {name!r} has none (pass an ErrorFunction with a loss).")


def with_slots(state: PyTree, slots: list[Any]) -> PyTree:
    """`state` with its latents' places (in tree order) holding `slots`."""
    leaves, structure = jax.tree_util.tree_flatten(state, is_leaf=is_latent_state)
    places = iter(slots)
    filled = [next(places) if is_latent_state(leaf) else leaf for leaf in leaves]
    return jax.tree_util.tree_unflatten(structure, filled)


def pulls_of(tree: PyTree) -> list[LatentPull]:
    """The `LatentPull`s of a sweep's new state, in tree order."""
    return [leaf for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_latent_pull)
            if is_latent_pull(leaf)]


def latent_energy(metrics: PyTree) -> jax.Array:
    """The sum of every latent's reported energy in a metrics tree."""
    energies = [jnp.sum(m.energy) for _, m in iter_metrics(metrics)
                if isinstance(m, LatentMetrics)]
    return sum(energies, jnp.zeros((), jnp.float32))


class Relaxed(eqx.Module):
    """What the relaxation hands the learning walk: the step's `output` (the feed-forward
    readout), each latent's feed-forward value (`anchors`) and relaxed shift (`shifts`),
    in tree order, with its energies before every sweep (`per_latent`, None unless
    recorded), the first forward's caches (`first_cache`), the energy at the feed-forward
    latents (`energy_before`), the whole tree's energy before every sweep (`trajectory`
    `(T,)`, None unless recorded; NaN for sweeps not run), the sweeps run (`steps`) and the
    tree's state the learning walk starts from (`tree_state`: the step's own, or under
    incremental relaxation the state after the sweeps' weight steps)."""

    output: Any
    anchors: list[jax.Array]
    shifts: list[jax.Array]
    per_latent: list[Any]
    first_cache: PyTree
    energy_before: jax.Array
    trajectory: jax.Array | None
    steps: jax.Array
    tree_state: PyTree


@dataclasses.dataclass(frozen=True)
class TreeRelaxation:
    """The relaxation of one compiled tree under one `Relaxation`: `core` the tree's Core,
    `error` the loss's error $\\partial \\ell_r / \\partial y_r$ per row and `row_loss` its
    per-row mean loss (or None)."""

    core: Core
    settings: Relaxation
    error: Any
    loss: Any

    def _loss(self, y: Any, target: Any) -> jax.Array:
        if self.loss is None:
            return jnp.full((), jnp.nan, jnp.float32)
        return self.loss(y, target).astype(jnp.float32)

    def _walk(self, state: PyTree, x: Any, target: Any, ctx: StepContext,
              cache: PyTree = None, top: Any = None):
        """One sweep's walks at `state`'s latents: the forward (unless `cache` and `top` are
        given, under fixed prediction) and the backward that does not learn. Returns the
        output, the pulls and the loss at the output."""
        if cache is None:
            top, cache = self.core.forward(state, x, ctx)
            top = jax.tree_util.tree_map(widened, top)
        error = self.error(top, target)
        _, pulled, _ = self.core.backward(state, cache, error, ctx)
        return top, pulls_of(pulled), self._loss(top, target)

    def _move(self, shifts: list[jax.Array], pulls: list[LatentPull], opt_state: Any):
        gradients = [p.gradient for p in pulls]
        if self.settings.optimiser is None:
            rate = self.settings.rate
            return [d - rate * g for d, g in zip(shifts, gradients)], opt_state
        with jax.numpy_dtype_promotion("standard"):  # optax mixes floats and int counts
            updates, opt_state = self.settings.optimiser.update(gradients, opt_state, shifts)
            return optax.apply_updates(shifts, updates), opt_state

    def _scanned(self, sweep, shifts, carried, first):
        """Sweeps $1 \\dots T-1$ as one `lax.scan`: the shifts, what the sweeps carry
        besides (the latents' optimiser state, an incremental sweep's tree state), $T$, and
        (recorded) every sweep's energies `(T, ...)` per latent and its loss `(T,)`."""
        record = self.settings.record_energy

        def body(carry, _):
            shifts, carried, energies, loss = sweep(*carry)
            return (shifts, carried), (energies, loss) if record else None

        (shifts, carried), later = jax.lax.scan(body, (shifts, carried), None,
                                                length=self.settings.steps - 1)
        if record:
            later = ([jnp.concatenate([e0[None], e]) for e0, e in zip(first[0], later[0])],
                     jnp.concatenate([first[1][None], later[1]]))
        return shifts, carried, jnp.int32(self.settings.steps), later

    def _until_settled(self, sweep, shifts, carried, first):
        """Sweeps until the energy's relative change falls below the tolerance, at most
        $T$ (one `lax.while_loop`): the shifts, the sweeps run, and the energies as
        `_scanned`'s (NaN for sweeps not run)."""
        steps, tolerance = self.settings.steps, self.settings.tolerance

        def total(energies, loss):
            return sum((jnp.sum(e) for e in energies), jnp.zeros((), jnp.float32)) + loss

        def written(buffers, t, energies, loss):
            per_latent, losses = buffers
            return ([b.at[t].set(e) for b, e in zip(per_latent, energies)], losses.at[t].set(loss))

        blank = ([jnp.full((steps, *jnp.shape(e)), jnp.nan, jnp.float32) for e in first[0]],
                 jnp.full((steps,), jnp.nan, jnp.float32))
        start = (jnp.int32(1), shifts, carried, total(*first), jnp.array(jnp.inf, jnp.float32),
                 written(blank, 0, *first))

        def going(carry):
            t, _, _, _, change, _ = carry
            return (t < steps) & ~(change < tolerance)

        def body(carry):
            t, shifts, carried, previous, _, buffers = carry
            shifts, carried, energies, loss = sweep(shifts, carried)
            now = total(energies, loss)
            change = jnp.abs(now - previous) / jnp.maximum(jnp.abs(previous), 1e-30)
            return t + 1, shifts, carried, now, change, written(buffers, t, energies, loss)

        t, shifts, carried, _, _, buffers = jax.lax.while_loop(going, body, start)
        return shifts, carried, t, buffers

    def relax(self, state: PyTree, x: Any, target: Any, ctx: StepContext,
              learn: Any = None) -> Relaxed:
        """The $T$ sweeps from the feed-forward latents; what the learning walk needs.
        `learn(state, cache, error, ctx) -> (input_error, new_state, metrics)` is the step's
        learning backward (global clipping included), which incremental sweeps take."""
        fixed, incremental = self.settings.fixed_prediction, self.settings.incremental
        sweep_ctx = ctx.for_inner_trace().replace(learning=False, detailed=False)
        y0, cache0 = self.core.forward(state, x, ctx)
        y0 = jax.tree_util.tree_map(widened, y0)
        _, pulls, loss0 = self._walk(state, x, target, sweep_ctx, cache0, y0)
        anchors = [p.anchor for p in pulls]
        shifts = [jnp.zeros_like(a) for a in anchors]
        optimiser = self.settings.optimiser
        with jax.numpy_dtype_promotion("standard"):
            opt_state = None if optimiser is None else optimiser.init(shifts)
        shifts, opt_state = self._move(shifts, pulls, opt_state)
        first = ([p.energy for p in pulls], loss0)

        def sweep(shifts, carried):
            opt_state, tree_state = carried
            slots = [LatentSlot(a, d, pulled=incremental) for a, d in zip(anchors, shifts)]
            current = with_slots(state if tree_state is None else tree_state, slots)
            if incremental:
                tree_state, pulls, loss = self._learning_sweep(current, x, target, ctx, learn)
            elif fixed:
                _, pulls, loss = self._walk(current, x, target, sweep_ctx, cache0, y0)
            else:
                _, pulls, loss = self._walk(current, x, target, sweep_ctx)
            shifts, opt_state = self._move(shifts, pulls, opt_state)
            return shifts, (opt_state, tree_state), [p.energy for p in pulls], loss

        run = self._until_settled if self.settings.tolerance is not None else self._scanned
        shifts, (_, tree_state), steps, later = run(
            sweep, shifts, (opt_state, state if incremental else None), first)
        per_latent: list[Any] = [None] * len(anchors)
        trajectory = None
        if self.settings.record_energy:  # each latent's energies before every sweep
            per_latent = [jnp.moveaxis(e, 0, -1) for e in later[0]]
            totals = [jnp.sum(e, axis=tuple(range(e.ndim - 1))) for e in per_latent]
            trajectory = sum(totals, jnp.zeros(self.settings.steps, jnp.float32)) + later[1]
        return Relaxed(y0, anchors, shifts, per_latent, cache0, loss0, trajectory, steps,
                       state if tree_state is None else tree_state)

    def _learning_sweep(self, current: PyTree, x: Any, target: Any, ctx: StepContext,
                        learn: Any):
        """An incremental sweep: the forward at `current`'s latents and weights and the
        learning backward, which steps every part and hands back each latent's pull. Returns
        the new state (the latents' own places restored), the pulls and the loss."""
        inner = ctx.for_inner_trace().replace(detailed=False)
        top, cache = self.core.forward(current, x, inner)
        top = jax.tree_util.tree_map(widened, top)
        _, learned, _ = learn(current, cache, self.error(top, target), inner)
        pulls = pulls_of(learned)
        restored = jax.tree_util.tree_map(
            lambda leaf: LatentState() if is_latent_pull(leaf) else leaf, learned,
            is_leaf=is_latent_pull)
        return restored, pulls, self._loss(top, target)

    def learning_forward(self, state: PyTree, x: Any, relaxed: Relaxed,
                         ctx: StepContext) -> tuple[Any, PyTree]:
        """The learning walk's forward at the relaxed latents: its output (float32) and
        caches (under fixed prediction the first forward's)."""
        if self.settings.fixed_prediction:
            return relaxed.output, relaxed.first_cache
        slots = [LatentSlot(a, d) for a, d in zip(relaxed.anchors, relaxed.shifts)]
        top, cache = self.core.forward(with_slots(state, slots), x, ctx)
        return jax.tree_util.tree_map(widened, top), cache

    def learning_state(self, state: PyTree, relaxed: Relaxed,
                       row_weight: jax.Array | None) -> PyTree:
        """`state` with the relaxed latents, each with the mask's `row_weight` (rows...) on
        its learning error and its recorded energies."""
        slots = [LatentSlot(a, d, None if row_weight is None else _broadcast(row_weight, a), t)
                 for a, d, t in zip(relaxed.anchors, relaxed.shifts, relaxed.per_latent)]
        return with_slots(state, slots)

    def report(self, relaxed: Relaxed, metrics: PyTree, top: Any, target: Any,
               new_state: PyTree, backprop: PyTree | None, state: PyTree) -> RelaxationReport:
        """The step's `RelaxationReport` from the learning walk's metrics (each latent's
        energy at the relaxed latents), its output `top` and, when computed, the backprop
        step's new state."""
        after = latent_energy(metrics) + self._loss(top, target)
        trajectory = None
        if relaxed.trajectory is not None:
            trajectory = jnp.concatenate([relaxed.trajectory, after[None]])
        distance = None if backprop is None else state_distance(new_state, backprop, state)
        return RelaxationReport(relaxed.energy_before, after, relaxed.steps, trajectory,
                                distance)


def row_weight(weights: jax.Array) -> jax.Array:
    """What a mask of row `weights` makes of each row's learning error, $w_r R / \\sum w$
    (0 for a row of weight 0), as `apply_row_mask` does at the output."""
    scale = weights * (weights.size / jnp.sum(weights))
    return jnp.where(weights > 0, scale, 0.0)


def _broadcast(weights: jax.Array, anchor: jax.Array) -> jax.Array:
    """Row weights `(rows...)` as `(stack..., rows..., 1)` for a latent of `anchor`'s shape."""
    return jnp.broadcast_to(weights[..., None], anchor.shape[:-1] + (1,)).astype(jnp.float32)


def state_distance(new: PyTree, reference: PyTree, old: PyTree) -> jax.Array:
    """$\\lVert n - r \\rVert / \\lVert r - o \\rVert$ over the inexact leaves of three trees
    of one structure (NaN where the reference did not move)."""
    def inexact(tree):
        return [x for x in jax.tree_util.tree_leaves(tree)
                if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]

    off = jnp.zeros((), jnp.float32)
    size = jnp.zeros((), jnp.float32)
    for n, r, o in zip(inexact(new), inexact(reference), inexact(old), strict=True):
        off = off + jnp.sum(jnp.square((n - r).astype(jnp.float32)))
        size = size + jnp.sum(jnp.square((r - o).astype(jnp.float32)))
    return jnp.where(size > 0, jnp.sqrt(off) / jnp.sqrt(jnp.where(size > 0, size, 1.0)),
                     jnp.nan)


__all__ = [
    "Relaxation",
    "RelaxationReport",
    "Relaxed",
    "TreeRelaxation",
    "check_tolerance",
    "has_latents",
    "latent_energy",
    "pulls_of",
    "resolve_relaxation",
    "row_weight",
    "state_distance",
    "with_slots",
]
