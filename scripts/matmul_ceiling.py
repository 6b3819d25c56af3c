"""How large a fraction of the matmul peak a GPT training step could reach at most here.

`fusedpc bench --peak` reports a step's model FLOP rate as a fraction of the best rate of a
large square product (the peak probe: 1024 and 2048 cubed, float32). A step's own products
are smaller and thinner (config M: 4096 rows by 256 to 1024 columns, attention batched over
batch x heads in 128 x 32 tiles), and XLA runs them at a lower rate than the probe's even
when nothing else runs. This script times each matrix product that `count_flops` counts for
one step, alone and as the fused step lays it out (forward `x @ W.T`, input error `e @ W`,
weight gradient `fusedpc.core.weight_gradient`, attention scores, mix and the two
transposed products of its backward), and prints the ceiling: the step's FLOPs over the sum
of those times, the rate of a step that did nothing but its products, each as fast as alone,
with no elementwise work, transposes, norms or optimiser at all. Its fraction of the probe
(timed in the same rounds, interleaved) bounds the fraction a step that computes these
products can reach (a causal attention that skips masked tiles computes fewer of the
attention products than `count_flops` counts, and can go a little beyond it).

Each product is timed as its own compiled call, so a call's fixed cost is part of its time;
the summary gives that cost (`dispatch_ms`, a call that adds 1 to one number). Where the
products take not much more than that (config S), the ceiling says little; at config M each
takes milliseconds.

    python scripts/matmul_ceiling.py                 # config M
    python scripts/matmul_ceiling.py --config S
    python scripts/matmul_ceiling.py --smoke         # a tiny config (tests)

One JSON line per product kind, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from fusedpc.bench._configs import CONFIGS  # smoke, S and M: GPTConfig fields, (rows, seq)

VOCAB = 65


def products(config: str) -> list[dict]:
    """The step's matrix products: name, operand shapes, FLOPs of one, and how many a step
    runs. Together they make `count_flops` for the config (checked in the tests)."""
    fields, (batch, seq) = CONFIGS[config]
    w, f, heads, blocks = fields["width"], fields["ff_width"], fields["n_heads"], fields["n_blocks"]
    n, d = batch * seq, fields["width"] // fields["n_heads"]
    found = []

    def linear(name, d_in, d_out, count):
        flops = 2 * n * d_in * d_out
        for role, shapes in (("forward", ((n, d_in), (d_out, d_in))),
                             ("input_error", ((n, d_out), (d_out, d_in))),
                             ("weight_gradient", ((n, d_out), (n, d_in)))):
            found.append({"product": f"{name} {role}", "kind": role, "shapes": shapes,
                          "flops": flops, "count": count})

    linear(f"projection {w}x{w}", w, w, 4 * blocks)  # q, k, v, o
    linear(f"feed-forward in {w}->{f}", w, f, blocks)
    linear(f"feed-forward out {f}->{w}", f, w, blocks)
    linear(f"head {w}->{VOCAB}", w, VOCAB, 1)
    attention = 2 * batch * heads * seq * seq * d
    bhtd, bhts = (batch, heads, seq, d), (batch, heads, seq, seq)
    for name, kind, shapes in (
        ("attention scores (forward; backward dP)", "scores", (bhtd, bhtd)),
        ("attention mix (forward; backward dQ)", "mix", (bhts, bhtd)),
        ("attention transposed mix (backward dK, dV)", "transposed_mix", (bhts, bhtd)),
    ):
        found.append({"product": name, "kind": kind, "shapes": shapes, "flops": attention,
                      "count": 2 * blocks})
    return found


def _function(kind: str):
    import jax
    import jax.numpy as jnp

    from fusedpc.core import weight_gradient

    highest = jax.lax.Precision.HIGHEST
    return jax.jit({
        "forward": lambda x, w: jnp.matmul(x, w.T, precision=highest),
        "input_error": lambda e, w: jnp.matmul(e, w, precision=highest),
        "weight_gradient": weight_gradient,
        "scores": lambda q, k: jnp.einsum("bhtd,bhsd->bhts", q, k, precision=highest),
        "mix": lambda p, v: jnp.einsum("bhts,bhsd->bhtd", p, v, precision=highest),
        "transposed_mix": lambda p, q: jnp.einsum("bhts,bhtd->bhsd", p, q, precision=highest),
        "probe": lambda a, b: jnp.matmul(a, b, precision=highest),
    }[kind])


def _timed(call, operands, reps: int) -> float:
    import jax

    times = []
    for _ in range(reps):
        began = time.perf_counter()
        jax.block_until_ready(call(*operands))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("S", "M"), default="M")
    parser.add_argument("--smoke", action="store_true", help="a tiny config (tests)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 1)")
    parser.add_argument("--reps", type=int, default=5, help="calls timed per product per round")
    parser.add_argument("--peak-sizes", default="1024,2048",
                        help="n of the n x n x n probe products, comma-separated")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be >= 1, got {args.rounds} and {args.reps}.")
    config = "smoke" if args.smoke else args.config
    sizes = [int(s) for s in args.peak_sizes.split(",")]
    if args.smoke:
        sizes = sorted({min(s, 128) for s in sizes})

    import jax
    import numpy as np

    from fusedpc.transformer.reference import count_flops

    rng = np.random.default_rng(0)
    items = products(config) + [
        {"product": f"probe {s}", "kind": "probe", "shapes": ((s, s), (s, s)),
         "flops": 2 * s**3, "count": 0} for s in sizes
    ]
    for item in items:
        item["call"] = _function(item["kind"])
        item["operands"] = [jax.numpy.asarray(rng.standard_normal(s, dtype=np.float32))
                            for s in item["shapes"]]
        jax.block_until_ready(item["call"](*item["operands"]))  # compile, outside the timing
        item["times"] = []
    # What a call costs with (almost) no work: products near it measure the dispatch more
    # than the product (config S's do; M's, milliseconds each, do not).
    dispatch = {"call": jax.jit(lambda x: x + 1.0), "operands": [jax.numpy.zeros((1,))],
                "times": []}
    jax.block_until_ready(dispatch["call"](*dispatch["operands"]))
    for _ in range(args.rounds):  # every product once per round: a load hits them alike
        for item in [*items, dispatch]:
            item["times"].append(_timed(item["call"], item["operands"], args.reps))

    fields, (batch, seq) = CONFIGS[config]
    total_flops = count_flops(VOCAB, fields["width"], fields["n_heads"], fields["n_blocks"],
                              fields["ff_width"], seq, batch)
    counted = sum(item["flops"] * item["count"] for item in items)
    step_s = 0.0
    peak = 0.0
    for item in items:
        seconds = statistics.median(item["times"])
        rate = item["flops"] / seconds / 1e9
        if item["kind"] == "probe":
            peak = max(peak, rate)
        step_s += seconds * item["count"]
        print(json.dumps({"product": item["product"], "shapes": item["shapes"],
                          "count_per_step": item["count"], "ms": round(seconds * 1e3, 4),
                          "gflops": round(rate, 1)}), flush=True)
    ceiling = total_flops / step_s / 1e9
    print(json.dumps({
        "summary": True, "config": config, "flops_per_step": total_flops,
        "flops_of_products": counted, "products_s": round(step_s, 5),
        "ceiling_gflops": round(ceiling, 1), "peak_gflops": round(peak, 1),
        "ceiling_fraction_of_peak": round(ceiling / peak, 4),
        "dispatch_ms": round(statistics.median(dispatch["times"]) * 1e3, 4),
        "rounds": args.rounds,
        "load_avg_1m": os.getloadavg()[0], "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
