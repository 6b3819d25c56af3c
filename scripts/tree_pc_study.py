"""Whole-tree predictive coding against the exact step and backprop, on the bundled text at a
fixed step budget: held-out loss, tokens/s and the distance from the backprop step.

Every run trains the default GPT of `fusedpc train` (width 64, 4 heads, 2 blocks, feed-forward
256, 64 tokens per row, batch 16, every weight learning, Adam 3e-3) for `--steps` steps on the
same batches per seed, and is scored on the same held-out windows (the text's last 10 %):

* `backprop_twin`: the reference GPT trained by `jax.grad` (`make_backprop_step`), one
  compiled call per step (the fused runs make one per `--per-call` steps);
* `exact`: the fused single-sweep step with no latents (backprop's gradients);
* `tree_pc_all_T<T>` (`tree_pc_all_T<T>_rate<r>` at a rate other than 0.1): `latents="all"`,
  a `fusedpc.Latent` after every slot (the fully-PC transformer), relaxed for T sweeps of
  gradient descent at that rate on the one energy of the whole tree (`fusedpc.Relaxation`);
* `tree_pc_blocks_T<T>` (T from `--blocks-inference-steps`, rate 0.1): `latents="blocks"`,
  a latent after the embedding and after every block.

Every `--distance-every` steps a tree-PC run also takes a probe: the step it is about to take,
compiled a second time with `Relaxation(backprop_distance=True, record_energy=True)` and
called on the pipeline's carry without committing. Its `backprop_distance` is
$\\lVert s_{pc} - s_{bp} \\rVert / \\lVert s_{bp} - s \\rVert$ over the step's whole new state
(weights and Adam moments) against the exact step's; the probe also gives the energy before
and after the relaxation. A second call of the probe and one of the exact step, both from the
same state with Adam's first moments zeroed (so that the new first moment is $(1 - \\beta_1)$
times the step's gradient), compare the gradients themselves: `gradient_distance`
$\\lVert g_{pc} - g_{bp} \\rVert / \\lVert g_{bp} \\rVert$ and `gradient_cosine` over every
weight, and the cosine per weight. Every step's relaxation report also says whether the
relaxation lowered the energy (`energy_ratio_*`, `energy_rose_steps`: after / before). The
probes are not timed.

It prints one JSON line per run (`val_loss`, `train_loss` of the last 50 steps, `tokens_per_s`
of the training calls after the first, the probes and their mean distance), one summary line
per variant (mean and standard deviation over the seeds, the gap to the twin), and with
`--plot` a PNG. Each fused variant compiles once; later seeds reuse its pipeline through
`set_state`, so their `first_call_s` holds no compile.

    python scripts/tree_pc_study.py                        # 3 seeds, 1000 steps, T = 4, 8, 16
    python scripts/tree_pc_study.py --quick                # 1 seed, 200 steps (a smoke run)
    python scripts/tree_pc_study.py --inference-steps 8 --rates 0.3,1.0 \\
        --variants tree_pc_all_T8_rate0.3,tree_pc_all_T8_rate1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc.training import data, make_optimiser
from fusedpc.transformer import reference
from fusedpc.transformer.reference import make_backprop_step

MODEL = {"width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "max_len": 64}
BATCH = 16
DEFAULT_RATE = 0.1


class Variant(NamedTuple):
    """One row of the study: where the GPT's latents go (`"none"`: no relaxation) and, with
    latents, its relaxation's sweeps and rate."""

    latents: str = "none"
    steps: int = 1
    rate: float = DEFAULT_RATE
    adam: bool = False  # Adam over the latents at `rate` instead of gradient descent
    incremental: bool = False  # incremental PC: the weights step at every sweep
    tolerance: float | None = None  # adaptive inference: stop once the energy settles
    fixed: bool = False  # fixed prediction: predictions and Jacobians held at feed-forward

    def relaxation(self, probe: bool = False) -> fusedpc.Relaxation | None:
        if self.latents == "none":
            return None
        return fusedpc.Relaxation(steps=self.steps, rate=self.rate, record_energy=probe,
                                  backprop_distance=probe,
                                  optimiser=optax.adam(self.rate) if self.adam else None,
                                  incremental=self.incremental, tolerance=self.tolerance,
                                  fixed_prediction=self.fixed)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def held_out_loss(logits_fn, xs: np.ndarray, ys: np.ndarray) -> float:
    """Mean next-token cross-entropy over the held-out batches `(N, B, T)`."""
    losses = [float(reference.cross_entropy(logits_fn(jnp.asarray(x)), jnp.asarray(y)))
              for x, y in zip(xs, ys, strict=True)]
    return float(np.mean(losses))


def variants(steps_list: list[int], rates: list[float], blocks_steps: int,
             adam_rates: tuple[float, ...] = (), schedules: tuple[str, ...] = (),
             tolerance: float = 1e-3) -> dict[str, Any]:
    """Variant name -> its `Variant` (None for the backprop twin)."""
    out: dict[str, Any] = {"backprop_twin": None, "exact": Variant()}
    for rate in rates:
        for steps in steps_list:
            suffix = "" if rate == DEFAULT_RATE else f"_rate{rate:g}"
            out[f"tree_pc_all_T{steps}{suffix}"] = Variant("all", steps, rate)
            if "incremental" in schedules:
                out[f"tree_pc_all_T{steps}{suffix}_incremental"] = Variant(
                    "all", steps, rate, incremental=True)
            if "adaptive" in schedules:
                out[f"tree_pc_all_T{steps}{suffix}_adaptive"] = Variant(
                    "all", steps, rate, tolerance=tolerance)
            if "fixed" in schedules:
                out[f"tree_pc_all_T{steps}{suffix}_fixed"] = Variant("all", steps, rate,
                                                                      fixed=True)
    for rate in adam_rates:
        for steps in steps_list:
            out[f"tree_pc_all_T{steps}_adam{rate:g}"] = Variant("all", steps, rate, adam=True)
    out[f"tree_pc_blocks_T{blocks_steps}"] = Variant("blocks", blocks_steps)
    return out


class ExactStep:
    """The exact (backprop) step of the latent-free GPT, compiled once and called on a tree-PC
    run's state: a `Latent` holds no state, so both trees have the same leaves in the same
    order."""

    def __init__(self, vocab: int, lr: float):
        config = fusedpc.GPTConfig(vocab_size=vocab, **MODEL, learn="all")
        part, _ = fusedpc.build_gpt(config, make_optimiser("adam", lr), jax.random.key(0))
        program = fusedpc.make_step(part, config.error_fn)
        carry = program.init(jax.random.key(0))
        self.structure = jax.tree_util.tree_structure(carry.state)
        self.shapes = [jnp.shape(v) for v in jax.tree_util.tree_leaves(carry.state)]
        self.counters = carry.counters
        self.step = jax.jit(program.step)

    def new_state(self, leaves: list[jax.Array], x: jax.Array, y: jax.Array) -> list:
        shapes = [jnp.shape(v) for v in leaves]
        assert shapes == self.shapes, "the tree-PC state's leaves differ from the exact GPT's"
        state = jax.tree_util.tree_unflatten(self.structure, leaves)
        carry, _ = self.step(fusedpc.StepCarry(state, self.counters), x, y)
        return jax.tree_util.tree_leaves(carry.state)


def _first_moments(state) -> list[tuple[int, str]]:
    """(leaf index, weight name) of every Adam first moment `mu` in `state`; the name is the
    path up to the optimiser state, without the `Sequential` wrappers of the latents."""
    out = []
    for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(state)):
        keys = [getattr(k, "name", None) for k in path]
        if "mu" in keys:
            name = jax.tree_util.keystr(path).split(".opt_state")[0].replace(".parts[0]", "")
            out.append((i, name.lstrip(".")))
    return out


def gradient_agreement(pc: list, bp: list, moments: list[tuple[int, str]]) -> dict:
    """The distance $\\lVert g_{pc} - g_{bp} \\rVert / \\lVert g_{bp} \\rVert$ and cosine of
    the two steps' gradients over every weight, and the cosine per weight, from Adam's first
    moments after a step from $\\mu = 0$ (then $\\mu' = (1 - \\beta_1) g$)."""
    by_name: dict[str, list[float]] = {}
    for i, name in moments:
        g_pc = np.asarray(pc[i], np.float64).ravel()
        g_bp = np.asarray(bp[i], np.float64).ravel()
        sums = by_name.setdefault(name, [0.0, 0.0, 0.0, 0.0])  # pc.bp, |pc|^2, |bp|^2, |d|^2
        sums[0] += float(g_pc @ g_bp)
        sums[1] += float(g_pc @ g_pc)
        sums[2] += float(g_bp @ g_bp)
        sums[3] += float(np.sum(np.square(g_pc - g_bp)))
    total = np.sum(list(by_name.values()), axis=0)

    def cosine(s) -> float:
        return round(s[0] / max(np.sqrt(s[1] * s[2]), 1e-30), 4)

    return {"gradient_distance": round(float(np.sqrt(total[3] / max(total[2], 1e-30))), 4),
            "gradient_cosine": cosine(total),
            "gradient_cosine_by_weight": {name: cosine(s) for name, s in by_name.items()}}


class FusedRunner:
    """A variant's pipeline and probe, compiled on the first seed and reused by later ones
    (`set_state` with the new seed's weights: the compiled programs hold no arrays)."""

    def __init__(self, variant: Variant, vocab: int, lr: float, exact: ExactStep):
        self.variant = variant
        self.config = fusedpc.GPTConfig(vocab_size=vocab, **MODEL, learn="all",
                                        latents=variant.latents)
        self.lr = lr
        self.exact = exact
        self.pipeline: fusedpc.FusedPipeline | None = None
        self.probe = None

    def start(self, seed: int) -> fusedpc.FusedPipeline:
        part, _ = fusedpc.build_gpt(self.config, make_optimiser("adam", self.lr),
                                    jax.random.key(seed))
        if self.pipeline is None:
            self.pipeline = fusedpc.FusedPipeline(
                part, self.config.error_fn, key=jax.random.key(seed),
                relaxation=self.variant.relaxation())
            if self.variant.latents != "none":
                program = fusedpc.make_step(part, self.config.error_fn,
                                            relaxation=self.variant.relaxation(probe=True))
                self.probe = jax.jit(program.step)
        else:
            self.pipeline.set_state(part.init_state(jax.random.key(seed)))
        return self.pipeline

    def probe_at(self, step: int, x: np.ndarray, y: np.ndarray) -> dict:
        """The step the pipeline is about to take on `(x, y)`, taken apart and dropped: its
        relaxation report, then its gradients against the exact step's (both from the
        current state with every first moment zeroed)."""
        x, y = jnp.asarray(x), jnp.asarray(y)
        carry = self.pipeline.carry
        _, out = self.probe(carry, x, y)
        report = jax.device_get(out.metrics.relaxation)
        moments = _first_moments(carry.state)
        leaves, structure = jax.tree_util.tree_flatten(carry.state)
        zeroed = list(leaves)
        for i, _ in moments:
            zeroed[i] = jnp.zeros_like(leaves[i])
        start = fusedpc.StepCarry(jax.tree_util.tree_unflatten(structure, zeroed),
                                  carry.counters)
        pc = jax.tree_util.tree_leaves(self.probe(start, x, y)[0].state)
        bp = self.exact.new_state(zeroed, x, y)
        return {"step": step,
                "backprop_distance": round(float(report.backprop_distance), 5),
                **gradient_agreement(pc, bp, moments),
                "energy_before": round(float(report.energy_before), 5),
                "energy_after": round(float(report.energy_after), 5),
                "energy_trajectory": [round(float(v), 5) for v in report.energy_trajectory]}


def fused_run(runner: FusedRunner, seed: int, train: np.ndarray, val, steps: int,
              per_call: int, distance_every: int) -> dict:
    pipeline = runner.start(seed)
    batches = data.BatchIterator(train, BATCH, MODEL["max_len"], seed=seed)
    losses: list[float] = []
    ratios: list[float] = []  # energy after / before the relaxation, every step
    sweeps: list[int] = []  # the sweeps each step's relaxation ran
    probes: list[dict] = []
    timed_s, timed_steps, first_s = 0.0, 0, 0.0
    done = 0
    while done < steps:
        k = min(per_call, steps - done)
        xs, ys = batches.next_batches(k)
        if runner.probe is not None and distance_every and done % distance_every == 0:
            probes.append(runner.probe_at(done, xs[0], ys[0]))
        start = time.perf_counter()
        _, _, metrics = pipeline.run(xs, ys, keep_outputs=False, report_every=k)
        step_losses = np.asarray(metrics.loss)  # blocks until the call is done
        elapsed = time.perf_counter() - start
        if done == 0:
            first_s = elapsed
        elif k == per_call:
            timed_s, timed_steps = timed_s + elapsed, timed_steps + k
        losses.extend(step_losses.tolist())
        if metrics.relaxation is not None:
            ratios.extend((np.asarray(metrics.relaxation.energy_after)
                           / np.asarray(metrics.relaxation.energy_before)).tolist())
            sweeps.extend(np.asarray(metrics.relaxation.steps).tolist())
        done += k
    row = {
        "val_loss": held_out_loss(pipeline.predict, *val),
        "train_loss": float(np.mean(losses[-50:])),
        "tokens_per_s": round(timed_steps * BATCH * MODEL["max_len"] / timed_s)
        if timed_s else None,
        "first_call_s": round(first_s, 2),
        "skipped_steps": int(pipeline.skipped_steps),
    }
    if ratios:
        row["energy_ratio_median"] = round(float(np.median(ratios)), 5)
        row["energy_ratio_max"] = float(f"{max(ratios):.4g}")
        row["energy_rose_steps"] = int(np.sum(np.asarray(ratios) > 1.0))
        row["sweeps_mean"] = round(float(np.mean(sweeps)), 3)
    if probes:
        for field in ("backprop_distance", "gradient_distance", "gradient_cosine"):
            row[f"{field}_median"] = round(_finite_median([p[field] for p in probes]), 5)
        row["nonfinite_probes"] = sum(not np.isfinite(p["gradient_distance"]) for p in probes)
        row["probes"] = probes
    return row


def twin_run(vocab: int, seed: int, train: np.ndarray, val, steps: int, lr: float,
             step) -> dict:
    config = fusedpc.GPTConfig(vocab_size=vocab, **MODEL)
    _, model = fusedpc.build_gpt(config, None, jax.random.key(seed))
    optimiser = make_optimiser("adam", lr)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    batches = data.BatchIterator(train, BATCH, MODEL["max_len"], seed=seed)
    xs, ys = batches.next_batches(steps)  # drawn up front, as `run` gets its K batches
    start = time.perf_counter()
    model, opt_state, loss = step(model, opt_state, xs[0], ys[0])
    losses = [float(loss)]
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    on_device = []
    for i in range(1, steps):  # no host sync per step: the losses are read at the end
        model, opt_state, loss = step(model, opt_state, xs[i], ys[i])
        on_device.append(loss)
    losses.extend(float(v) for v in jax.device_get(on_device))
    timed_s = time.perf_counter() - start
    return {
        "val_loss": held_out_loss(lambda x: _forward(model, x), *val),
        "train_loss": float(np.mean(losses[-50:])),
        "tokens_per_s": round((steps - 1) * BATCH * MODEL["max_len"] / timed_s)
        if timed_s else None,
        "first_call_s": round(first_s, 2),
        "skipped_steps": 0,
    }


@eqx.filter_jit
def _forward(model, x):
    return model(x)


def _spread(values: list[float]) -> float:
    return round(statistics.stdev(values), 4) if len(values) > 1 else 0.0


def _finite_median(values: list[float]) -> float:
    """The median of the finite `values` (NaN when none is: the probes of diverged steps;
    a median, since one diverged relaxation makes a distance of 1e12)."""
    finite = [v for v in values if np.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")


def summarise(runs: list[dict]) -> list[dict]:
    by_variant: dict[str, list[dict]] = {}
    for run in runs:
        by_variant.setdefault(run["variant"], []).append(run)
    twin = by_variant.get("backprop_twin")
    twin_mean = statistics.mean(r["val_loss"] for r in twin) if twin else None
    out = []
    for name, rows in by_variant.items():
        losses = [r["val_loss"] for r in rows]
        speeds = [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
        mean = statistics.mean(losses)
        summary = {
            "summary": name,
            "val_loss_mean": round(mean, 4),
            "val_loss_std": _spread(losses),
            "gap_to_twin": None if twin_mean is None else round(mean - twin_mean, 4) + 0.0,
            "tokens_per_s_mean": round(statistics.mean(speeds)) if speeds else None,
            "seeds": len(rows),
        }
        if all("sweeps_mean" in r for r in rows):
            summary["sweeps_mean"] = round(statistics.mean(r["sweeps_mean"] for r in rows), 3)
        probed = [r for r in rows if "probes" in r]
        if probed:
            probes = [p for r in probed for p in r["probes"]]
            for field in ("backprop_distance", "gradient_distance", "gradient_cosine"):
                medians = [_finite_median([p[field] for p in r["probes"]]) for r in probed]
                values = [v for v in medians if np.isfinite(v)]  # each run's median
                summary[f"{field}_median"] = round(statistics.mean(values), 4) if values else (
                    float("nan"))
                summary[f"{field}_std"] = _spread(values)
            summary["energy_rose_steps"] = sum(r["energy_rose_steps"] for r in probed)
            summary["skipped_steps"] = sum(r["skipped_steps"] for r in probed)
            for field in ("energy_before", "energy_after"):  # medians: a diverged probe is huge
                summary[f"{field}_median"] = round(float(np.median(
                    [p[field] for p in probes])), 4)
        out.append(summary)
    return out


def plot(summary: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["summary"] for s in summary]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    left.bar(names, [s["val_loss_mean"] for s in summary],
             yerr=[s["val_loss_std"] for s in summary], capsize=4, color="tab:blue")
    left.set_ylim(min(s["val_loss_mean"] for s in summary) * 0.95,
                  max(s["val_loss_mean"] for s in summary) * 1.03)
    left.set_ylabel("validation loss (mean over seeds)")
    middle.bar(names, [s.get("gradient_cosine_median", 1.0) for s in summary],
               yerr=[s.get("gradient_cosine_std", 0.0) for s in summary], capsize=4,
               color="tab:green")
    middle.set_ylabel("gradient cosine with backprop's (probes' median)")
    right.bar(names, [s["tokens_per_s_mean"] or 0 for s in summary], color="tab:orange")
    right.set_ylabel("training tokens/s")
    for ax in (left, middle, right):
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="the step budget of every run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--inference-steps", default="4,8,16",
                        help="the T values of the fully-PC (latents='all') runs")
    parser.add_argument("--rates", default=str(DEFAULT_RATE),
                        help="the relaxation rates of the fully-PC runs")
    parser.add_argument("--schedules", default="",
                        help="also run the fully-PC variants as incremental PC and/or with "
                        "adaptive inference, or under fixed prediction: a comma list of "
                        "incremental, adaptive, fixed (variants "
                        "tree_pc_all_T<T>[_rate<r>]_incremental, ..._adaptive, ..._fixed)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="the relative energy change at which the *_adaptive variants stop")
    parser.add_argument("--latent-adam-rates", default="",
                        help="also relax the fully-PC runs with Adam over the latents at these "
                        "rates (variants tree_pc_all_T<T>_adam<r>)")
    parser.add_argument("--blocks-inference-steps", type=int, default=8,
                        help="T of the block-PC (latents='blocks') run, at rate 0.1")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's rate (fusedpc train's)")
    parser.add_argument("--per-call", type=int, default=10, help="steps per `run` call")
    parser.add_argument("--distance-every", type=int, default=100,
                        help="probe the backprop distance every this many steps (a multiple "
                        "of --per-call; 0: never)")
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--variants", default=None,
                        help="a comma list of variant names to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 200 steps")
    parser.add_argument("--plot", default=None, help="write the summary's PNG here")
    parser.add_argument("--from-json", default=None, nargs="+", metavar="PATH",
                        help="train nothing: summarise (and plot) the run rows of these "
                        "files of this script's output")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_json:
        lines = [json.loads(line) for path in args.from_json for line in open(path)
                 if line.startswith("{")]
        return _finish([row for row in lines if "variant" in row], args.plot)
    if args.quick:
        args.seeds, args.steps = 1, 200
    if args.distance_every % args.per_call:
        parser.error(f"--distance-every ({args.distance_every}) must be a multiple of "
                     f"--per-call ({args.per_call}): a probe is taken between two calls.")
    steps_list = [int(v) for v in args.inference_steps.split(",") if v.strip()]
    rates = [float(v) for v in args.rates.split(",") if v.strip()]
    adam_rates = tuple(float(v) for v in args.latent_adam_rates.split(",") if v.strip())
    schedules = tuple(v.strip() for v in args.schedules.split(",") if v.strip())
    unknown = sorted(set(schedules) - {"incremental", "adaptive", "fixed"})
    if unknown:
        parser.error(f"--schedules: unknown {unknown}; choose from incremental, adaptive, fixed")
    table = variants(steps_list, rates, args.blocks_inference_steps, adam_rates, schedules,
                     args.tolerance)
    if args.variants:
        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(wanted) - set(table))
        if unknown:
            parser.error(f"--variants: unknown {unknown}; choose from {sorted(table)}")
        table = {name: table[name] for name in wanted}

    text = data.load_text(data.DEFAULT_TEXT)
    tokenizer = data.CharTokenizer.from_text(text)
    train, held = data.split(tokenizer.encode(text), 0.1)
    val = data.BatchIterator(held, BATCH, MODEL["max_len"], seed=12345).next_batches(
        args.eval_batches)
    vocab = tokenizer.vocab_size
    twin_step = make_backprop_step(make_optimiser("adam", args.lr))
    exact = ExactStep(vocab, args.lr)
    runners = {name: FusedRunner(v, vocab, args.lr, exact) for name, v in table.items()
               if v is not None}
    runs = []
    for seed in range(args.seeds):
        for name in table:  # variants interleaved within each seed
            start = time.perf_counter()
            if name == "backprop_twin":
                result = twin_run(vocab, seed, train, val, args.steps, args.lr, twin_step)
            else:
                result = fused_run(runners[name], seed, train, val, args.steps,
                                   args.per_call, args.distance_every)
            row = {"variant": name, "seed": seed, "steps": args.steps, **result,
                   "wall_s": round(time.perf_counter() - start, 1)}
            runs.append(row)
            print(json.dumps(row), flush=True)
            cosine = row.get("gradient_cosine_median")
            _say(f"seed {seed} {name}: val {row['val_loss']:.4f}"
                 + ("" if cosine is None else f", gradient cosine {cosine:.3f}")
                 + f" ({row['wall_s']} s)")
    return _finish(runs, args.plot)


def _finish(runs: list[dict], plot_path: str | None) -> list[dict]:
    summary = summarise(runs)
    for row in summary:
        print(json.dumps(row), flush=True)
    if plot_path:
        plot(summary, plot_path)
    return runs + summary


if __name__ == "__main__":
    main()
