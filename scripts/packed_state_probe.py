"""How close fusedpc's own step gets to the bare twin with its learning state stored flat: a
prototype, run on the digits-sized MLP, of the layout the small-models target needs.

`scripts/flat_state_probe.py` sized the layout on bare JAX. This script runs fusedpc's real
step program (the same parts, metrics, counters and skip rules) over a state stored as one
vector per dtype (`fusedpc.core.Packed`), in three variants beside the default:

* `packed_per_leaf`: the state stored packed and unpacked at the start of the step (slices),
  the parts' optimiser steps as they are (per leaf), the new state packed again
  (concatenated), the commit rule's state check as one sum of squares per vector (a per-leaf
  check, the one of the default step, taken only when that sum is not finite: `lax.cond`),
  one select per vector;
* `packed_flat`: the same, with every optimiser step deferred (the step context's sink) and
  applied once per part over the part's contiguous ranges of the vectors (its parameters, and
  each moment, one slice each), written back in place: the same elementwise update, fused
  otherwise by XLA, so equal to the per-leaf one to float32 rounding, not bit for bit;
* `packed_flat_no_reports`: `packed_flat` without the report norms.

A measurement of a prototype, not fusedpc code: it supports the MLP's part (a
`LearningNetwork`), refuses a tree whose optimiser steps it cannot lay flat, and does not
take masks, latents, clipping or the update-ratio guard. Every round times each variant in
turn (`--calls` calls, medians over `--rounds`); each row gives the kernels (fusions) of the
optimised program, and `max_abs_diff`, how far its weights are from the default step's after
`--check-steps` steps (the same batch).

    python scripts/packed_state_probe.py                   # 30 rounds of 50 calls
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc.bench._kernels import count_fusions
from fusedpc.bench._mlp_twin import mlp_problem, twin_call
from fusedpc.core._context import StepContext
from fusedpc.core._gradients import apply_optax
from fusedpc.core._measured import Measured, resolve_pending, state_norms_finite
from fusedpc.core._metrics import metrics_finite
from fusedpc.core._norms import all_finite
from fusedpc.core._packed import Packed
from fusedpc.execution._step_types import StepMetrics, StepOutput

ADAM = optax.adam(1e-3)
Span = tuple[int, int, int]  # (vector, offset, size)


def unpack(packed: Packed) -> tuple[Any, dict[int, Span], list[Any]]:
    """The state tree from its vectors, and where each leaf lies in them (by leaf id; the
    returned list keeps the leaves alive, so the ids stay unique)."""
    leaves, spans, held = [], {}, []
    for group, offset, shape in packed.layout:
        if group < 0:
            leaves.append(packed.others[offset])
            continue
        size = int(np.prod(shape, dtype=np.int64))
        leaf = packed.vectors[group][offset:offset + size].reshape(shape)
        spans[id(leaf)] = (group, offset, size)
        held.append(leaf)
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(packed.structure, leaves), spans, held


def _range(leaves: list[Any], spans: dict[int, Span]) -> Span | None:
    """The one contiguous range of one vector that `leaves` fill, in order, or None."""
    found = [spans.get(id(leaf)) for leaf in leaves]
    if not found or any(s is None for s in found):
        return None
    group, start, _ = found[0]  # type: ignore[misc]
    at = start
    for g, offset, size in found:  # type: ignore[misc]
        if g != group or offset != at:
            return None
        at += size
    return group, start, at - start


def flat_step(record: Any, spans: dict[int, Span], vectors: tuple[Any, ...]):
    """One deferred optimiser step applied over its part's ranges of the vectors: returns
    `(writes, substitutes)`: the new flat pieces `(vector, offset, array)` and the new value
    of each stand-in (by id). None when the step's leaves are not contiguous ranges."""
    p_leaves = jax.tree_util.tree_leaves(record.params)
    where = _range(p_leaves, spans)
    if where is None:
        return None
    group, offset, total = where
    sizes = [int(leaf.size) for leaf in p_leaves]
    p = vectors[group][offset:offset + total]
    g = jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(record.gradients)])
    template_tree = jax.eval_shape(record.optimiser.init,
                                   jax.ShapeDtypeStruct((total,), p.dtype))
    template = jax.tree_util.tree_leaves(template_tree)
    s_leaves, s_def = jax.tree_util.tree_flatten(record.opt_state)
    flat, runs, at = [], [], 0
    for t in template:
        n = len(p_leaves) if (t.shape == (total,) and at + len(p_leaves) <= len(s_leaves)
                              and [x.shape for x in s_leaves[at:at + len(p_leaves)]]
                              == [x.shape for x in p_leaves]) else 1
        run = _range(s_leaves[at:at + n], spans) if n > 1 or t.shape == (total,) else None
        if n > 1 and run is None:
            return None
        flat.append(vectors[run[0]][run[1]:run[1] + run[2]] if run else s_leaves[at])
        runs.append((run, n))
        at += n
    if at != len(s_leaves):
        return None
    new_p, new_s = apply_optax(record.optimiser, p, g, jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(template_tree), flat))

    def pieces(vector: jax.Array) -> list[jax.Array]:
        starts = np.cumsum([0, *sizes])
        return [vector[a:b].reshape(leaf.shape)
                for a, b, leaf in zip(starts[:-1], starts[1:], p_leaves)]

    writes = [(group, offset, new_p)]
    new_leaves: list[Any] = []
    for leaf, (run, n) in zip(jax.tree_util.tree_leaves(new_s), runs):
        if run is not None:
            writes.append((run[0], run[1], leaf))
        if n > 1:  # a moment over every parameter: back into one piece per parameter
            new_leaves.extend(pieces(leaf))
        else:  # its own leaf of the per-leaf state (a count, a one-leaf part's moment)
            new_leaves.append(jnp.reshape(leaf, s_leaves[len(new_leaves)].shape))
    stand_ins = jax.tree_util.tree_leaves((record.new_params, record.new_state))
    values = pieces(new_p) + jax.tree_util.tree_leaves(
        jax.tree_util.tree_unflatten(s_def, new_leaves))
    return writes, {id(a): b for a, b in zip(stand_ins, values, strict=True)}


def packed_vectors(old: Packed, new_state: Any, writes: list[tuple[int, int, Any]]):
    """The new state's vectors: each flat write in its range, every other leaf raveled."""
    leaves = jax.tree_util.tree_leaves(new_state)
    starts = {(g, o): w for g, o, w in writes}
    vectors = []
    for group in range(len(old.vectors)):
        items = sorted((o, i) for i, (g, o, _) in enumerate(old.layout) if g == group)
        parts, covered = [], 0
        for offset, i in items:
            if offset < covered:
                continue
            if (group, offset) in starts:
                piece = starts[(group, offset)]
                parts.append(piece.astype(old.vectors[group].dtype))
                covered = offset + int(piece.size)
            else:
                parts.append(jnp.ravel(leaves[i]).astype(old.vectors[group].dtype))
                covered = offset + int(np.prod(old.layout[i][2], dtype=np.int64))
        vectors.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
    return tuple(vectors)


def packed_step(program, flat: bool):
    """`program.step`'s rule over a packed carry `(Packed, Counters)` (no mask, no latents)."""

    def step(carry, x, target, detailed: bool = True):
        packed, counters = carry
        state, spans, held = unpack(packed)
        ctx = StepContext(compute_dtype=program.compute_dtype)
        y, cache = program._forward(state, x, ctx)
        checks = program.input_checks(x, target, int(jnp.shape(y)[-1]))
        error = program.error_fn.error(y, target)
        measured, records = Measured(), []
        ctx = ctx.replace(detailed=detailed, measured=measured,
                          deferred=records if flat else None)
        input_error, new_state, part_metrics = program._backward(state, cache, error, ctx)
        writes, substitute = [], {}
        for record in records:
            done = flat_step(record, spans, packed.vectors)
            if done is None:
                raise ValueError("packed_state_probe: an optimiser step it cannot lay flat")
            writes.extend(done[0])
            substitute.update(done[1])
        new_state = jax.tree_util.tree_map(lambda leaf: substitute.get(id(leaf), leaf),
                                           new_state)
        measured._slots = [[tuple(substitute.get(id(v), v) if not isinstance(v, str) else v
                                  for v in item) for item in slot] for slot in measured._slots]
        loss = program._loss(y, target, None)
        error_slot = measured.add(error)
        norms = measured.norms()
        part_metrics = resolve_pending(part_metrics, measured, norms)
        vectors = packed_vectors(packed, new_state, writes)
        new_packed = Packed(vectors, packed.others, packed.structure, packed.layout,
                            packed.dtypes)
        sums = [jnp.sum(jnp.square(v)) for v in vectors if jnp.issubdtype(v.dtype, jnp.inexact)]
        whole = jnp.isfinite(jnp.stack(sums)).all()
        shapes = jax.eval_shape(state_norms_finite, new_state)
        state_finite = jax.lax.cond(
            whole, lambda p: jax.tree_util.tree_map(lambda s: jnp.ones(s.shape, s.dtype), shapes),
            lambda p: state_norms_finite(p.unpack()), new_packed)
        finite = program._finite(loss, None, [
            jnp.stack(jax.tree_util.tree_leaves(state_finite)).all(),
            all_finite((y, input_error)), metrics_finite(part_metrics),
            jnp.isfinite(norms.norms[error_slot])])
        code = program._skip_code(checks, jnp.array(True), finite, part_metrics, counters, loss)
        committed = code == 0
        kept = tuple(jnp.where(committed, n, o) for n, o in zip(vectors, packed.vectors))
        metrics = StepMetrics(loss=loss, committed=committed, parts=part_metrics,
                              state_finite=state_finite, skip_reason=code, input_checks=checks,
                              loss_mean=counters.loss_mean, reported=jnp.array(detailed))
        del held  # the unpacked leaves were kept alive until here: `spans` is keyed by id
        out = Packed(kept, packed.others, packed.structure, packed.layout, packed.dtypes)
        return (out, program._count(counters, code, loss)), StepOutput(y, input_error, metrics)

    return step


def _problem():
    x, y, network = mlp_problem()
    return x, y, fusedpc.LearningNetwork(network, ADAM)


def variants() -> dict[str, tuple[Callable[[], Any], dict, Callable[[], Any]]]:
    """name -> (one call, its kernels, the current state tree)."""
    x, y, tree = _problem()
    program = fusedpc.make_step(tree)
    out = {}
    for name in ("fused", "packed_per_leaf", "packed_flat", "packed_flat_no_reports"):
        carry = program.init(jax.random.key(0))
        if name == "fused":
            jitted = jax.jit(program.step, donate_argnums=0)
            box = {"carry": carry}

            def state(box=box):
                return box["carry"].state
        else:
            inner = packed_step(program, flat=name != "packed_per_leaf")
            detailed = name != "packed_flat_no_reports"
            jitted = jax.jit(lambda c, a, b, inner=inner, d=detailed: inner(c, a, b, d),
                             donate_argnums=0)
            box = {"carry": (Packed.of(carry.state), carry.counters)}

            def state(box=box):
                return box["carry"][0].unpack()
        kernels = count_fusions(jitted.lower(box["carry"], x, y).compile().as_text())

        def call(jitted=jitted, box=box):
            box["carry"], result = jitted(box["carry"], x, y)
            return result.metrics.loss

        out[name] = (call, kernels, state)
    out["twin"] = twin_call(tree.network, ADAM, x, y)
    return out


def _weights(tree_state: Any) -> list[np.ndarray]:
    """The weight matrices of a state (the network's params) or of the twin's."""
    if isinstance(tree_state, list):
        return [np.asarray(w) for w, _ in tree_state]
    return [np.asarray(w) for w in tree_state.params.weights]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--check-steps", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.rounds, args.calls, args.check_steps) < 1:
        parser.error("--rounds, --calls and --check-steps: expected integers >= 1")
    made = variants()
    for call, _, _ in made.values():  # the same steps from the same start for every variant
        for _ in range(args.check_steps):
            value = call()
        jax.block_until_ready(value)
    reference = _weights(made["fused"][2]())
    diffs = {name: max(float(np.max(np.abs(a - b)))
                       for a, b in zip(_weights(state()), reference))
             for name, (_, _, state) in made.items()}
    times: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(args.rounds):
        for name, (call, _, _) in made.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                value = call()
            jax.block_until_ready(value)
            times[name].append((time.perf_counter() - start) / args.calls)
    base = statistics.median(times["twin"])
    rows = []
    for name, (_, kernels, _) in made.items():
        ms = statistics.median(times[name])
        row = {"variant": name, "step_ms": round(1e3 * ms, 4), "vs_twin": round(ms / base, 3),
               **kernels, "max_abs_diff": diffs[name], "rounds": args.rounds,
               "calls": args.calls}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
