"""The bfloat16 compute dtype against float32: loss curves and step times at config S.

Trains config S (vocabulary of the bundled text, width 64, 4 heads, 2 blocks, feed-forward
256, sequence 64, batch 16, every weight learning, Adam 3e-3) for `--steps` steps twice from
the same weights and batches, once per compute dtype, K steps per call, and prints one JSON
line per dtype (final and mean loss, median time per step) and a summary line with the
largest gap between the two loss curves (raw, and smoothed over `--smooth` steps).

    python scripts/precision_curve.py                 # 200 steps
    python scripts/precision_curve.py --steps 400 --smooth 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
import optax

import fusedpc
from fusedpc.training import data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--k", type=int, default=10, help="steps per call")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps % args.k:
        parser.error(f"--steps {args.steps} must be a multiple of --k {args.k}")
    text = data.load_text()
    tokenizer = data.CharTokenizer.from_text(text)
    batches = data.BatchIterator(tokenizer.encode(text), 16, 64, seed=args.seed)
    xs, ys = (np.asarray(a, np.int32) for a in batches.next_batches(args.steps))
    curves = {}
    for dtype in ("float32", "bfloat16"):
        config = fusedpc.GPTConfig(vocab_size=tokenizer.vocab_size, width=64, n_heads=4,
                                   n_blocks=2, ff_width=256, max_len=64, learn="all",
                                   compute_dtype=dtype)
        part, _ = fusedpc.build_gpt(config, optax.adam(3e-3), jax.random.key(args.seed))
        pipeline = fusedpc.FusedPipeline(part, config.error_fn)
        losses, times = [], []
        for start in range(0, args.steps, args.k):
            t0 = time.perf_counter()
            _, _, metrics = pipeline.run(xs[start:start + args.k], ys[start:start + args.k],
                                         keep_outputs=False)
            loss = np.asarray(metrics.loss)
            times.append((time.perf_counter() - t0) / args.k)
            losses.extend(loss.tolist())
        curves[dtype] = np.asarray(losses)
        print(json.dumps({
            "dtype": dtype, "steps": args.steps, "final_loss": float(np.mean(losses[-10:])),
            "mean_loss": float(np.mean(losses)),
            "step_ms_median": 1e3 * statistics.median(times[1:]),  # the first call compiles
            "first_call_s": times[0] * args.k, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
        }), flush=True)
    f32, bf16 = curves["float32"], curves["bfloat16"]
    window = np.ones(args.smooth) / args.smooth
    smooth_gap = np.abs(np.convolve(f32, window, "valid") - np.convolve(bf16, window, "valid"))
    print(json.dumps({
        "summary": "bfloat16 vs float32", "max_abs_gap": float(np.max(np.abs(f32 - bf16))),
        "max_smoothed_gap": float(smooth_gap.max()), "smooth": args.smooth,
        "final_gap": float(abs(f32[-10:].mean() - bf16[-10:].mean())),
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
