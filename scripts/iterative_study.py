"""Iterative inference against the single-sweep parts and backprop, on the bundled text at a
fixed step budget: held-out loss and tokens/s over several seeds.

Every run trains the default GPT of `fusedpc train` (width 64, 4 heads, 2 blocks, feed-forward
256, 64 tokens per row, batch 16, every weight learning, Adam 3e-3) for `--steps` steps on the
same batches per seed, and is scored on the same held-out windows (the text's last 10 %):

* `backprop_twin`: the reference GPT trained by `jax.grad` (`make_backprop_step`), one
  compiled call per step (the fused runs make one per `--per-call` steps);
* `precision_weighted`: the single-sweep exact step (backprop's gradients, fused);
* `standard`: the single-sweep confidence-scaled step;
* `iterative_T<T>` (with `--rates` other than the default, `iterative_T<T>_rate<r>`): every
  feed-forward an `IterativeNetwork` relaxing for T steps at that rate, every other slot the
  exact step.

It prints one JSON line per run (`val_loss`, `train_loss` of the last 50 steps, `tokens_per_s`
of the training calls after the first, which compiles), one summary line per variant (mean
and standard deviation over the seeds, the gap to the twin), and with `--plot` a PNG.

    python scripts/iterative_study.py                       # 3 seeds, 1000 steps, T = 4, 8, 16
    python scripts/iterative_study.py --quick               # 1 seed, 200 steps (a smoke run)
    python scripts/iterative_study.py --rates 0.1,0.5 --plot docs/figures/iterative_study.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import fusedpc
from fusedpc.training import data, make_optimiser
from fusedpc.transformer import reference
from fusedpc.transformer.reference import make_backprop_step

MODEL = {"width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "max_len": 64}
BATCH = 16


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def held_out_loss(logits_fn, xs: np.ndarray, ys: np.ndarray) -> float:
    """Mean next-token cross-entropy over the held-out batches `(N, B, T)`."""
    losses = [float(reference.cross_entropy(logits_fn(jnp.asarray(x)), jnp.asarray(y)))
              for x, y in zip(xs, ys, strict=True)]
    return float(np.mean(losses))


def variants(steps_list: list[int], rates: list[float]) -> dict[str, dict]:
    """Variant name -> the `GPTConfig` keywords of its learning kind."""
    out: dict[str, dict] = {
        "backprop_twin": {},
        "precision_weighted": {"learning_kind": "precision_weighted"},
        "standard": {"learning_kind": "standard"},
    }
    for rate in rates:
        for steps in steps_list:
            name = f"iterative_T{steps}" if len(rates) == 1 and rate == 0.1 else (
                f"iterative_T{steps}_rate{rate:g}")
            out[name] = {"learning_kind": "iterative", "learning_kwargs": {
                "inference_steps": steps, "inference_rate": rate}}
    return out


def fused_run(config: fusedpc.GPTConfig, seed: int, train: np.ndarray, val, steps: int,
              per_call: int, lr: float) -> dict:
    part, _ = fusedpc.build_gpt(config, make_optimiser("adam", lr), jax.random.key(seed))
    pipeline = fusedpc.FusedPipeline(part, config.error_fn, key=jax.random.key(seed))
    batches = data.BatchIterator(train, BATCH, MODEL["max_len"], seed=seed)
    losses: list[float] = []
    timed_s, timed_steps, first_s = 0.0, 0, 0.0
    done = 0
    while done < steps:
        k = min(per_call, steps - done)
        xs, ys = batches.next_batches(k)
        start = time.perf_counter()
        _, _, metrics = pipeline.run(xs, ys, keep_outputs=False, report_every=k)
        step_losses = np.asarray(metrics.loss)  # blocks until the call is done
        elapsed = time.perf_counter() - start
        if done == 0:
            first_s = elapsed
        elif k == per_call:
            timed_s, timed_steps = timed_s + elapsed, timed_steps + k
        losses.extend(step_losses.tolist())
        done += k
    return {
        "val_loss": held_out_loss(pipeline.predict, *val),
        "train_loss": float(np.mean(losses[-50:])),
        "tokens_per_s": round(timed_steps * BATCH * MODEL["max_len"] / timed_s)
        if timed_s else None,
        "first_call_s": round(first_s, 2),
        "skipped_steps": int(pipeline.skipped_steps),
    }


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
        out.append({
            "summary": name,
            "val_loss_mean": round(mean, 4),
            "val_loss_std": round(statistics.stdev(losses), 4) if len(losses) > 1 else 0.0,
            "gap_to_twin": None if twin_mean is None else round(mean - twin_mean, 4),
            "tokens_per_s_mean": round(statistics.mean(speeds)) if speeds else None,
            "seeds": len(rows),
        })
    return out


def plot(summary: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["summary"] for s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, [s["val_loss_mean"] for s in summary],
             yerr=[s["val_loss_std"] for s in summary], capsize=4, color="tab:blue")
    left.set_ylim(min(s["val_loss_mean"] for s in summary) * 0.95,
                  max(s["val_loss_mean"] for s in summary) * 1.03)
    left.set_ylabel("validation loss (mean over seeds)")
    right.bar(names, [s["tokens_per_s_mean"] or 0 for s in summary], color="tab:orange")
    right.set_ylabel("training tokens/s")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="the step budget of every run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--inference-steps", default="4,8,16",
                        help="the T values of the iterative runs")
    parser.add_argument("--rates", default="0.1", help="the relaxation rates of the iterative "
                        "runs (0.1: IterativeNetwork's default)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's rate (fusedpc train's)")
    parser.add_argument("--per-call", type=int, default=10, help="steps per `run` call")
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--variants", default=None,
                        help="a comma list of variant names to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 200 steps")
    parser.add_argument("--plot", default=None, help="write the summary's PNG here")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 1, 200
    steps_list = [int(v) for v in args.inference_steps.split(",") if v.strip()]
    rates = [float(v) for v in args.rates.split(",") if v.strip()]
    table = variants(steps_list, rates)
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
    runs = []
    for seed in range(args.seeds):
        for name, kind in table.items():  # variants interleaved within each seed
            start = time.perf_counter()
            if name == "backprop_twin":
                result = twin_run(vocab, seed, train, val, args.steps, args.lr, twin_step)
            else:
                config = fusedpc.GPTConfig(vocab_size=vocab, **MODEL, learn="all", **kind)
                result = fused_run(config, seed, train, val, args.steps, args.per_call,
                                   args.lr)
            row = {"variant": name, "seed": seed, "steps": args.steps, **result,
                   "wall_s": round(time.perf_counter() - start, 1)}
            runs.append(row)
            print(json.dumps(row), flush=True)
            _say(f"seed {seed} {name}: val {row['val_loss']:.4f} ({row['wall_s']} s)")
    summary = summarise(runs)
    for row in summary:
        print(json.dumps(row), flush=True)
    if args.plot:
        plot(summary, args.plot)


if __name__ == "__main__":
    main()
