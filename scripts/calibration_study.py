"""The yardstick for per-slot learning-rate calibration: a matrix of short runs, each to the
same step budget, and the validation loss every calibration method reaches (see
docs/calibration.md).

    python scripts/calibration_study.py --quick                   # a sample, < 5 minutes
    python scripts/calibration_study.py --text my.txt             # the full study, ~30 minutes

The package's `calibration_evidence.json` (what `fusedpc report` suggests from) is this
study's summary; docs/calibration.md gives the command that writes it (`--evidence PATH`),
and `--evidence-from JSONL OUT.json` writes it from a finished study's `calibration.jsonl`.

Prints one JSON line per run and one summary line per cell and method (also written to
`--out`/calibration.jsonl, with a plot in `--out`/calibration.png); progress goes to stderr.

A cell is (text, learning kind, learn preset, optimiser). In each cell and for each seed, one
warm-up of the first `--warmup` share of the budget is trained; every method reads that
warm-up (its report rows, or short probes started from it) and returns one rate multiplier
per slot; training then continues from the warmed-up state (weights and optimiser moments
kept, only the rates changed) to the budget, on the same batches for every method. `none`
is the uncalibrated run itself. Probe steps come on top of the budget (they only choose the
multipliers) and are counted in `probe_steps`.

The rates' multipliers live in the optimiser state (`fusedpc.training.with_rate_multiplier`,
as `fusedpc train --calibrate` builds them), so that every seed, text and method of a cell
runs one compiled program; the `probe` method is `fusedpc.training.probe_rates`, what
`fusedpc train --calibrate probe` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc.training import (
    data,
    gpt_slot,
    make_optimiser,
    probe_rates,
    rate_multipliers,
    scale_by_rate_multiplier,
    set_rate_multipliers,
    with_rate_multiplier,
)
from fusedpc.training._calibrate import calibrate_slots
from fusedpc.training._evaluate import batch_losses
from fusedpc.transformer import reference

KINDS = ("precision_weighted", "standard", "synaptic_uncertainty")
PRESETS = ("all", "ff_head")
OPTIMISERS = ("adam", "sgd")
BASE_LR = {"adam": 3e-3, "sgd": 0.1}
"""The global rate of each optimiser (`--lr-adam`, `--lr-sgd`)."""


# ----------------------------------------------------------------------------- methods
@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What a method may read: the report rows of the warm-up (each with its `step`), and
    `probe(groups, group)`, which runs `fusedpc.training.probe_rates` from the warmed-up
    state on the `probe_steps` training batches that come next (those the continuation then
    trains on), each trial scored on the probe split (not the validation split the study
    scores on), and returns its `ProbeResult`."""

    rows: list[dict[str, Any]]
    probe: Callable[..., Any]


Method = Callable[[WarmUp, float, tuple[str, ...]], dict[str, float]]
"""`(warm_up, base_lr, slots) -> {slot: multiplier}`; slots left out keep multiplier 1."""


def method_none(warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]) -> dict[str, float]:
    """Uncalibrated: every slot at the global rate."""
    return {}


def method_report_rule(
    warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]
) -> dict[str, float]:
    """`fusedpc report`'s suggestion: per slot $\\rho^* / \\tilde\\rho$ with $\\rho^* = 10^{-3}$
    and $\\tilde\\rho$ the median update/weight ratio of the slot's parts over the warm-up."""
    table = calibrate_slots(warm_up.rows)
    return {c.part: c.multiplier for c in table if c.multiplier is not None and c.part in slots}


def method_rebalance(
    warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]
) -> dict[str, float]:
    """`report_rule`'s multipliers $m_s$ divided by their geometric mean,
    $m_s / (\\prod_s m_s)^{1/n}$: the global rate is kept, only the balance between slots
    changes."""
    rule = method_report_rule(warm_up, base_lr, slots)
    if not rule:
        return {}
    mean = math.exp(float(np.mean([math.log(m) for m in rule.values()])))
    return {slot: m / mean for slot, m in rule.items()}


def method_probe(warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]) -> dict[str, float]:
    """`fusedpc.training.probe_rates` (what `fusedpc train --calibrate probe` runs): per
    slot, trials with its rate x0.5 and x2 from the warmed-up state (after trials of every
    slot at x0.5 and x2 together), each scored on the probe split, a change kept only when
    it is lower beyond twice the standard error of the batch-by-batch differences; the
    combined choice is tried once more. $2|S| + 4$ trials at most."""
    result = warm_up.probe(slots)
    return {s: m for s, m in result.multipliers.items() if m != 1.0}


def method_probe_global(
    warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]
) -> dict[str, float]:
    """A control for `probe`: the same trials with every slot as one group (the global rate
    x0.5 or x2, 3 trials). Where it does as well as `probe`, the gain is the global rate's,
    not the balance between slots'."""
    rated = set(slots)

    def every_slot(path: str) -> str | None:
        return "global" if gpt_slot(path) in rated else None

    result = warm_up.probe(("global",), every_slot)
    factor = result.multipliers["global"]
    return {} if factor == 1.0 else dict.fromkeys(slots, factor)


def method_probe_capped(
    warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]
) -> dict[str, float]:
    """`probe` without its global stage (`global_factors=()`): each slot's own trials at x0.5
    and x2 alone, so one calibration moves a rate by x2 at most, not x4. The cap tested for
    `synaptic_uncertainty`, whose x4 choices end far worse hundreds of steps later."""
    result = warm_up.probe(slots, global_factors=())
    return {s: m for s, m in result.multipliers.items() if m != 1.0}


def method_fixed(factor: float) -> Method:
    """A control: every slot at `factor` times its rate from the warm-up on, chosen by
    nobody (`x2` ... `x32`). What a rate alone can reach in a cell, the yardstick for what a
    calibration of rates could gain there."""

    def fixed(warm_up: WarmUp, base_lr: float, slots: tuple[str, ...]) -> dict[str, float]:
        return dict.fromkeys(slots, factor)

    fixed.__doc__ = f"Every slot at x{factor:g} from the warm-up on (a control)."
    return fixed


METHODS: dict[str, Method] = {
    "none": method_none,
    "report_rule": method_report_rule,
    "rebalance": method_rebalance,
    "probe": method_probe,
    "probe_global": method_probe_global,
    "probe_capped": method_probe_capped,
    **{f"x{f:g}": method_fixed(f) for f in (0.5, 2.0, 4.0, 8.0, 12.0, 16.0, 32.0)},
}
"""The calibration methods by name; add one here to have the study score it."""
DEFAULT_METHODS = ("none", "report_rule", "rebalance", "probe", "probe_global")
"""What `--methods` runs by default (`probe_capped` and the fixed controls `x0.5` ... `x32`
on request)."""


# ----------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class Study:
    """The study's settings: the step budget (`steps`, warm-up included), the warm-up and
    probe lengths, steps per compiled call, the matrix (seeds, kinds, presets, optimisers,
    methods), the global rate per optimiser, synaptic_uncertainty's `window`, and the small
    model and batch every run shares."""

    steps: int
    warmup: int
    probe_steps: int
    per_call: int
    seeds: tuple[int, ...]
    kinds: tuple[str, ...]
    presets: tuple[str, ...]
    optimisers: tuple[str, ...]
    methods: tuple[str, ...]
    twin: bool
    lr: dict[str, float]
    window: int
    width: int = 32
    n_heads: int = 4
    n_blocks: int = 1
    ff_width: int = 128
    seq_len: int = 32
    batch: int = 16
    eval_batches: int = 8
    report_every: int = 5


def rated(name: str, lr: float) -> optax.GradientTransformation:
    """`make_optimiser(name, lr)` with a rate multiplier in its state (so it can be changed
    without recompiling), as `fusedpc train --calibrate` builds it."""
    if name not in OPTIMISERS:
        raise ValueError(f"--optimisers: expected names from {OPTIMISERS}, got {name!r}.")
    return with_rate_multiplier(make_optimiser(name, lr))


def with_rates(state, multipliers: dict[str, float]):
    """`state` with every rated slot's multiplier set (1 for the slots not named)."""
    every = dict.fromkeys(rate_multipliers(state), 1.0)
    return set_rate_multipliers(state, {**every, **multipliers})


def copy_state(state):
    return jax.tree.map(jnp.copy, state)


def held_out_loss(logits_fn, xs: np.ndarray, ys: np.ndarray) -> float:
    """Mean next-token cross-entropy of `logits_fn` over the batches `xs`, `ys` `(N, B, T)`,
    in one call on `(N B, T)`."""
    n, b, t = xs.shape
    logits = logits_fn(jnp.asarray(xs.reshape(n * b, t)))
    return float(reference.cross_entropy(logits, jnp.asarray(ys.reshape(n * b, t))))


@dataclasses.dataclass
class Text:
    name: str
    train: np.ndarray
    probe: tuple[np.ndarray, np.ndarray]
    val: tuple[np.ndarray, np.ndarray]


def load_texts(paths: list[str], study: Study) -> tuple[list[Text], int]:
    """Each text split 80/10/10 into training, probe and validation parts, all encoded with
    one character vocabulary (the union of the texts'), so that they share compiled
    programs."""
    raw = {p: data.load_text(p) for p in paths}
    tok = data.CharTokenizer.from_text("".join(raw.values()))
    texts = []
    for path, text in raw.items():
        ids = tok.encode(text)
        train, held = data.split(ids, 0.2)
        probe, val = data.split(held, 0.5)
        n = study.eval_batches
        texts.append(Text(
            os.path.basename(path) if os.path.exists(path) else path,
            train,
            data.BatchIterator(probe, study.batch, study.seq_len, seed=1).next_batches(n),
            data.BatchIterator(val, study.batch, study.seq_len, seed=2).next_batches(n),
        ))
    return texts, tok.vocab_size


# ----------------------------------------------------------------------------- runs
def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Cell:
    """One (learning kind, preset, optimiser): one pipeline, compiled once, reused for every
    text, seed and method by replacing its state."""

    def __init__(self, study: Study, vocab: int, kind: str, preset: str, optimiser: str):
        self.study, self.kind, self.preset, self.optimiser = study, kind, preset, optimiser
        self.lr = study.lr[optimiser]
        kwargs = {"window": study.window} if kind == "synaptic_uncertainty" else None
        self.config = fusedpc.GPTConfig(
            vocab_size=vocab, width=study.width, n_heads=study.n_heads,
            n_blocks=study.n_blocks, ff_width=study.ff_width, max_len=study.seq_len,
            learn=preset, learning_kind=kind, learning_kwargs=kwargs,
        )
        self.slots = self.config.learning_slots()
        # whether any slot learns through the optimiser (else Adam and SGD cells are one)
        self.uses_optimiser = not all(self.own_rule(s) for s in self.slots)
        self.pipeline = self.fresh(0)
        # the slots whose rate an optimiser sets (synaptic_uncertainty has its own rule)
        self.rated_slots = tuple(sorted(rate_multipliers(self.pipeline.state),
                                        key=self.slots.index))

    def fresh(self, seed: int) -> fusedpc.FusedPipeline:
        # synaptic_uncertainty's own steps take a bare multiplier; the LayerNorms the optimiser
        slot_optimisers = {
            s: scale_by_rate_multiplier() if self.own_rule(s) else rated(self.optimiser, self.lr)
            for s in self.slots
        }
        part, _ = fusedpc.build_gpt(self.config, rated(self.optimiser, self.lr),
                                    jax.random.key(seed), slot_optimisers=slot_optimisers)
        return fusedpc.FusedPipeline(part, self.config.error_fn, key=jax.random.key(seed))

    def own_rule(self, slot: str) -> bool:
        """Whether `slot` learns by synaptic_uncertainty's own rule (not the optimiser)."""
        return self.kind == "synaptic_uncertainty" and slot != "norm"

    def train(self, batches: data.BatchIterator, steps: int, rows: list | None = None):
        """`steps` more steps; returns the losses. Report rows every `report_every` steps
        go to `rows` when given."""
        losses = []
        done = 0
        while done < steps:
            k = min(self.study.per_call, steps - done)
            xs, ys = batches.next_batches(k)
            _, _, metrics = self.pipeline.run(xs, ys, keep_outputs=False)
            losses.extend(np.asarray(metrics.loss).tolist())
            if rows is not None:
                for i in range(k):
                    step = batches.step - k + i + 1
                    if step % self.study.report_every == 0:
                        rows.extend({"step": step, **r} for r in self.pipeline.report(index=i))
            done += k
        return losses

    def loss(self, split: tuple[np.ndarray, np.ndarray]) -> float:
        return held_out_loss(self.pipeline.predict, *split)

    def seed_runs(self, text: Text, seed: int, methods: tuple[str, ...]) -> list[dict]:
        """Every method's run for one text and seed, from one shared warm-up."""
        study = self.study
        t0 = time.perf_counter()
        self.pipeline.set_state(with_rates(self.fresh(seed).state, {}))
        batches = data.BatchIterator(text.train, study.batch, study.seq_len, seed=seed)
        rows: list[dict] = []
        self.train(batches, study.warmup, rows)
        warm = copy_state(self.pipeline.state)
        warm_s = time.perf_counter() - t0
        probes = [0]
        probe_xs, probe_ys = batches.next_batches(study.probe_steps)  # what comes next
        batches.step = study.warmup

        def probe(groups: tuple[str, ...], group=gpt_slot, **settings):
            self.pipeline.set_state(with_rates(warm, {}), steps=study.warmup)
            result = probe_rates(self.pipeline, probe_xs, probe_ys, groups=groups,
                                 per_call=study.per_call, group=group,
                                 score=lambda p: batch_losses(p, *text.probe, False),
                                 **settings)
            probes[0] += result.steps
            return result

        warm_up = WarmUp(rows, probe)
        results = []
        for method in methods:
            t1 = time.perf_counter()
            probes[0] = 0
            multipliers = METHODS[method](warm_up, self.lr, self.rated_slots)
            self.pipeline.set_state(with_rates(warm, multipliers), steps=study.warmup)
            batches.step = study.warmup
            losses = self.train(batches, study.steps - study.warmup)
            val = self.loss(text.val)
            results.append({
                "multipliers": {s: round(m, 4) for s, m in multipliers.items()},
                "method": method,
                "val_loss": val,
                "train_loss": float(np.mean(losses[-50:])),
                "probe_steps": probes[0],
                "wall_s": round(warm_s + time.perf_counter() - t1, 2),
            })
        return results


def twin_run(study: Study, vocab: int, text: Text, optimiser: str, seed: int, step) -> dict:
    """The backprop twin: the reference GPT at the same initial weights, every weight trained
    by backpropagation with `make_optimiser(optimiser, lr)`, on the same batches."""
    t0 = time.perf_counter()
    config = fusedpc.GPTConfig(vocab_size=vocab, width=study.width, n_heads=study.n_heads,
                               n_blocks=study.n_blocks, ff_width=study.ff_width,
                               max_len=study.seq_len)
    _, model = fusedpc.build_gpt(config, None, jax.random.key(seed))
    optimiser_fn = make_optimiser(optimiser, study.lr[optimiser])
    opt_state = optimiser_fn.init(eqx.filter(model, eqx.is_array))
    batches = data.BatchIterator(text.train, study.batch, study.seq_len, seed=seed)
    losses = []
    for _ in range(study.steps):
        x, y = batches.next_batch()
        model, opt_state, loss = step[optimiser](model, opt_state, x, y)
        losses.append(loss)
    val = held_out_loss(lambda x: _forward(model, x), *text.val)
    return {
        "method": "backprop_twin",
        "multipliers": {},
        "val_loss": val,
        "train_loss": float(np.mean(np.asarray(losses[-50:]))),
        "probe_steps": 0,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


@eqx.filter_jit
def _forward(model, x):
    return model(x)


# ----------------------------------------------------------------------------- summary
def summarise(runs: list[dict]) -> list[dict]:
    """One line per cell and method: mean, standard deviation and range over seeds, and the
    gaps (mean minus mean) to the cell's uncalibrated run and to the backprop twin of the
    same text, preset and optimiser."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (r["text"], r["learning_kind"], r["learn"], r["optimiser"], r["method"])
        groups.setdefault(key, []).append(r)
    means = {k: float(np.mean([r["val_loss"] for r in g])) for k, g in groups.items()}
    lines = []
    for key, group in groups.items():
        text, kind, learn, opt, method = key
        values = np.asarray([r["val_loss"] for r in group])
        base = means.get((text, kind, learn, opt, "none"))
        twin = means.get((text, "backprop", "all", opt, "backprop_twin"))
        comparable = learn == "all" and method != "backprop_twin"
        lines.append({
            "kind": "summary", "text": text, "learning_kind": kind, "learn": learn,
            "optimiser": opt, "method": method, "seeds": len(group),
            "val_loss_mean": float(values.mean()),
            "val_loss_std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "val_loss_min": float(values.min()), "val_loss_max": float(values.max()),
            "gap_to_none": None if base is None or method == "backprop_twin"
            else float(values.mean() - base),
            "gap_to_twin": float(values.mean() - twin) if comparable and twin is not None
            else None,
        })
    return lines


def targets(summary: list[dict]) -> list[dict]:
    """Per method, the issue's targets read off the summary. The *spread* of a comparison
    is the larger of the two seed standard deviations.

    * `worse_cells`: cells where the method's mean is above `none`'s by more than the spread
      (the target: none);
    * `behind_twin`: cells (preset `all`) where `none` is above the twin by more than the
      spread, and `helped`: those of them where the method is below `none` by more than the
      spread (the target: at least half);
    * `gap_closed`: per `standard` and `synaptic_uncertainty` cell of preset `all`, the share
      of `none`'s gap to the twin that the method closes, $(\\bar l_{none} - \\bar l_m) /
      (\\bar l_{none} - \\bar l_{twin})$ (the target: >= 0.5), where there is a gap."""
    by_key = {(s["text"], s["learning_kind"], s["learn"], s["optimiser"], s["method"]): s
              for s in summary}
    methods = sorted({s["method"] for s in summary} - {"none", "backprop_twin"})
    lines = []
    for method in methods:
        worse, behind, helped, closed = [], [], [], {}
        for (text, kind, learn, opt, m), s in by_key.items():
            if m != method:
                continue
            none = by_key.get((text, kind, learn, opt, "none"))
            if none is None:
                continue
            cell = f"{text}/{kind}/{learn}/{opt}"
            spread = max(s["val_loss_std"], none["val_loss_std"])
            if s["val_loss_mean"] > none["val_loss_mean"] + spread:
                worse.append(cell)
            twin = by_key.get((text, "backprop", "all", opt, "backprop_twin"))
            if learn != "all" or twin is None:
                continue
            gap = none["val_loss_mean"] - twin["val_loss_mean"]
            if gap > max(none["val_loss_std"], twin["val_loss_std"]):
                behind.append(cell)
                if s["val_loss_mean"] < none["val_loss_mean"] - spread:
                    helped.append(cell)
            if kind in ("standard", "synaptic_uncertainty") and gap > 0:
                closed[cell] = (none["val_loss_mean"] - s["val_loss_mean"]) / gap
        lines.append({"kind": "targets", "method": method, "worse_cells": worse,
                      "behind_twin": behind, "helped": helped, "gap_closed": closed})
    return lines


def plot(summary: list[dict], path: str) -> None:
    """Validation loss per cell and method, bars at the seed mean with the seed range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = sorted({s["text"] for s in summary})
    methods = [m for m in (*METHODS, "backprop_twin") if any(s["method"] == m for s in summary)]
    fig, axes = plt.subplots(len(texts), 1, figsize=(12, 4.5 * len(texts)), squeeze=False)
    for ax, text in zip(axes[:, 0], texts, strict=True):
        rows = [s for s in summary if s["text"] == text]
        # the twins last, after the cells of the learning kinds
        cells = sorted({(s["learning_kind"], s["learn"], s["optimiser"]) for s in rows},
                       key=lambda c: (c[0] == "backprop", c))
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            labelled = False
            for i, cell in enumerate(cells):
                found = [s for s in rows if (s["learning_kind"], s["learn"], s["optimiser"])
                         == cell and s["method"] == method]
                if not found:
                    continue
                s = found[0]
                err = [[s["val_loss_mean"] - s["val_loss_min"]],
                       [s["val_loss_max"] - s["val_loss_mean"]]]
                ax.bar(i + (j - (len(methods) - 1) / 2) * width, s["val_loss_mean"], width,
                       yerr=err, capsize=2, color=f"C{j}",
                       label=None if labelled else method)
                labelled = True
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(["\n".join(c) for c in cells], fontsize=7)
        ax.set_ylabel("validation loss at the budget")
        ax.set_title(f"{text}: mean over seeds, bars to the seed range")
        values = [s["val_loss_min"] for s in rows] + [s["val_loss_max"] for s in rows]
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            ax.set_ylim(min(finite) - 0.1, max(finite) + 0.1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def names(value: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: expected a comma-separated list from {allowed}, got {value!r}.")
    return chosen


def parse(argv: list[str] | None) -> tuple[Study, list[str], str, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a sample in under 5 minutes: 300 steps, 2 seeds, preset all, the "
                        "bundled text only (other flags still override)")
    p.add_argument("--text", default=None, help="a second text (a path) besides 'hamlet'")
    p.add_argument("--steps", type=int, default=None,
                   help="the step budget, rounded to whole calls of --per-call (default 1200; "
                        "quick 300)")
    p.add_argument("--warmup", type=float, default=0.15,
                   help="share of the budget the warm-up takes (default 0.15)")
    p.add_argument("--probe-steps", type=int, default=None,
                   help="steps per probe of the probe method, rounded to whole calls "
                        "(default 100, as fusedpc train's --probe-steps; quick 20)")
    p.add_argument("--per-call", type=int, default=20, help="steps per compiled call")
    p.add_argument("--seeds", default=None, help="seeds, e.g. 0,1,2 (default; quick 0,1)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--presets", default=None, help="default all,ff_head (quick all)")
    p.add_argument("--optimisers", default=",".join(OPTIMISERS))
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"from {', '.join(METHODS)}")
    p.add_argument("--no-twin", action="store_true", help="leave out the backprop twin")
    p.add_argument("--lr-adam", type=float, default=BASE_LR["adam"])
    p.add_argument("--lr-sgd", type=float, default=BASE_LR["sgd"])
    p.add_argument("--window", type=int, default=100,
                   help="synaptic_uncertainty's learning_kwargs['window'] (default 100)")
    p.add_argument("--out", default="runs/calibration_study",
                   help="folder for calibration.jsonl, calibration_evidence.json and "
                        "calibration.png")
    p.add_argument("--evidence", default=None, metavar="PATH",
                   help="also write the evidence file here (the package's: "
                        "src/fusedpc/training/calibration_evidence.json)")
    a = p.parse_args(argv)
    steps = a.steps or (300 if a.quick else 1200)
    seeds = a.seeds or ("0,1" if a.quick else "0,1,2")
    def calls(n: float) -> int:  # whole calls, so that every call has one shape
        return max(1, round(n / a.per_call)) * a.per_call

    study = Study(
        steps=calls(steps),
        warmup=calls(a.warmup * steps),
        probe_steps=calls(a.probe_steps or (20 if a.quick else 100)),
        per_call=a.per_call,
        seeds=tuple(int(s) for s in seeds.split(",")),
        kinds=names(a.kinds, KINDS, "--kinds"),
        presets=names(a.presets or ("all" if a.quick else ",".join(PRESETS)), PRESETS,
                      "--presets"),
        optimisers=names(a.optimisers, OPTIMISERS, "--optimisers"),
        methods=names(a.methods, tuple(METHODS), "--methods"),
        twin=not a.no_twin,
        lr={"adam": a.lr_adam, "sgd": a.lr_sgd},
        window=a.window,
    )
    if not 0 < study.warmup < study.steps:
        raise SystemExit(f"--warmup: the warm-up ({study.warmup} steps) must lie inside the "
                         f"budget ({study.steps}); raise --steps or lower --warmup.")
    texts = [data.DEFAULT_TEXT] + ([a.text] if a.text else [])
    return study, texts, a.out, a.evidence


def write_evidence(jsonl: str, path: str) -> None:
    """The study's settings and summary lines from `jsonl` as the evidence file `fusedpc
    report` reads (`src/fusedpc/training/calibration_evidence.json` in the package)."""
    with open(jsonl, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    settings = next(line for line in lines if line["kind"] == "study")
    evidence = {
        "study": {k: settings[k] for k in ("steps", "warmup", "probe_steps", "seeds", "texts",
                                           "lr", "width", "n_heads", "n_blocks", "seq_len",
                                           "batch", "jax")},
        "cells": [{k: v for k, v in line.items() if k != "kind"}
                  for line in lines if line["kind"] == "summary"],
        "targets": [line for line in lines if line["kind"] == "targets"],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(evidence, f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--evidence-from"]:  # convert a finished study's JSONL, nothing else
        if len(argv) != 3:
            raise SystemExit("usage: calibration_study.py --evidence-from JSONL OUT.json")
        write_evidence(argv[1], argv[2])
        return 0
    study, paths, out, evidence = parse(argv)
    os.makedirs(out, exist_ok=True)
    jsonl = open(os.path.join(out, "calibration.jsonl"), "w", encoding="utf-8")

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        jsonl.write(text + "\n")
        jsonl.flush()

    began = time.perf_counter()
    texts, vocab = load_texts(paths, study)
    emit({"kind": "study", **dataclasses.asdict(study), "texts": [t.name for t in texts],
          "vocab": vocab, "devices": str(jax.devices()), "jax": jax.__version__})
    runs: list[dict] = []

    def record(cell: dict, seed: int, result: dict) -> None:
        line = {"kind": "run", **cell, "seed": seed, **result}
        runs.append(line)
        emit(line)
        say(f"  {cell['text']} {cell['learning_kind']} {cell['learn']} {cell['optimiser']} "
            f"seed {seed} {result['method']}: val {result['val_loss']:.4f} "
            f"({result['wall_s']:.1f} s, {time.perf_counter() - began:.0f} s in all)")

    for kind in study.kinds:
        for preset in study.presets:
            for optimiser in study.optimisers:
                t0 = time.perf_counter()
                cell = Cell(study, vocab, kind, preset, optimiser)
                say(f"cell {kind} / {preset} / {optimiser} (rated slots: "
                    f"{', '.join(cell.rated_slots) or 'none'})")
                methods = study.methods
                if not cell.uses_optimiser and optimiser != study.optimisers[0]:
                    emit({"kind": "skipped", "learning_kind": kind, "learn": preset,
                          "optimiser": optimiser, "reason": f"no slot of {preset!r} takes "
                          f"an optimiser under {kind}: identical to the "
                          f"{study.optimisers[0]} cell"})
                    continue
                # every learning slot carries a multiplier (the synaptic rule's too), so every
                # method runs on every slot; a cell whose slots take no optimiser is labelled
                # by its own rule
                label = optimiser if cell.uses_optimiser else "own_rule"
                for text in texts:
                    for seed in study.seeds:
                        for result in cell.seed_runs(text, seed, methods):
                            record({"text": text.name, "learning_kind": kind, "learn": preset,
                                    "optimiser": label}, seed, result)
                emit({"kind": "cell", "learning_kind": kind, "learn": preset,
                      "optimiser": label, "wall_s": round(time.perf_counter() - t0, 1)})
                say(f"cell done in {time.perf_counter() - t0:.0f} s (compilation included)")
    if study.twin and "all" in study.presets:
        steps = {o: reference.make_backprop_step(make_optimiser(o, study.lr[o]))
                 for o in study.optimisers}
        for optimiser in study.optimisers:
            for text in texts:
                for seed in study.seeds:
                    record({"text": text.name, "learning_kind": "backprop", "learn": "all",
                            "optimiser": optimiser}, seed,
                           twin_run(study, vocab, text, optimiser, seed, steps))
    summary = summarise(runs)
    for line in summary:
        emit(line)
    for line in targets(summary):
        emit(line)
    emit({"kind": "done", "wall_s": round(time.perf_counter() - began, 1)})
    jsonl.close()
    for path in filter(None, (os.path.join(out, "calibration_evidence.json"), evidence)):
        write_evidence(os.path.join(out, "calibration.jsonl"), path)
    plot(summary, os.path.join(out, "calibration.png"))
    say(f"wrote {os.path.join(out, 'calibration.jsonl')} and calibration.png "
        f"in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
