"""Whole-tree predictive coding (`fusedpc.Latent` + `fusedpc.Relaxation`) beside FabricPC 0.6
and PCX 0.6.3: step time, tokens/s and test accuracy, measured side by side in one run.

Two measurements, each in rounds that take every variant once (the order rotated round by
round, medians over rounds: the machine is shared and noisy):

* `mlp`: the PC MLP 64-128-128-10 tanh on scikit-learn's `load_digits` (pixels / 16, 80/20
  split with `random_state=0`), batch 64, inference rate 0.1, Adam 1e-3, the same initial
  (xavier) weights, zero biases and batch order for every library. Per T in `--mlp-steps`:
  fusedpc's tree-PC step (one `step` a call, and `run` with K = 10 steps a call), FabricPC's
  and PCX's step; once: fusedpc's exact single-sweep step of the same tree without `Latent`
  parts and a bare `jax.grad` + Adam step. Then 10 epochs of training for each, and the test
  accuracy of the feed-forward readout. The cost of a sweep per library (from its two T) and
  the matrix products and kernels in the scan body of fusedpc's compiled step.
* `gpt`: the transformer at config S (vocab 65, width 64, 4 heads, 2 blocks, feed-forward
  256, seq 64, batch 16, rotary positions, Adam 3e-3) on the bundled text: fusedpc with
  `latents="all"` relaxing T = 8 sweeps at 0.1 (`step` and `run` K = 10), fusedpc's exact
  single-sweep step (`latents="none"`) and FabricPC's fully-PC transformer
  (`create_deep_transformer`, T = 8, rate 0.1): step ms and tokens/s. Speed only. fusedpc's
  step is also timed at the T of `--gpt-sweeps` (1, 2, 4), and a line through its step ms
  against T gives the cost of one sweep and of the rest, against the exact step
  (`gpt_sweep_cost`; FabricPC's from its T = 1 and 8): where the time of a tree-PC step
  goes. For scale, fusedpc's step with `fixed_prediction=True` (sweeps are backward walks
  only), its forward walk alone (`predict`), and the matrix products per sweep of the
  compiled programs.

The peers run in their own virtual environments, as subprocesses (`scripts/peers/`); a peer
whose python is missing is skipped with a note. It prints one JSON line per measurement, one
per summary (`"summary"`) and one per target (`"target"`), plus the machine load before and
after (`"uptime"`).

    python scripts/tree_pc_peers.py                         # both parts, 4 to 8 minutes
    python scripts/tree_pc_peers.py --parts mlp --rounds 3  # a quicker look
    python scripts/tree_pc_peers.py --fabricpc-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fusedpc
from fusedpc import frozen
from fusedpc.training import data
from fusedpc.transformer import GPTConfig, build_gpt

PEERS = Path(__file__).resolve().parent / "peers"
SIZES = (64, 128, 128, 10)
BATCH = 64
EPOCHS = 10
MLP_LR = 1e-3
RATE = 0.1
PER_CALL = 10
GPT = {"vocab_size": 65, "width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256,
       "max_len": 64}
GPT_BATCH = 16
GPT_STEPS = 8
GPT_LR = 3e-3
WARM = 3  # calls before any timing (the first compiles; a peer may retrace on the second)
TARGETS = {"mlp_speedup": 1.5, "gpt_over_exact": 4.0, "gpt_tokens_vs_fabricpc": 2.5}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "uptime unavailable"


# ---------------------------------------------------------------------------------------
# The peers: one subprocess each, answering the requests of `scripts/peers/_worker.py`.


class Peer:
    """A peer side running in its own python; `call` sends one request and waits."""

    def __init__(self, name: str, python: str, script: str):
        self.name = name
        self.process = subprocess.Popen(
            [python, str(PEERS / script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=sys.stderr, text=True, bufsize=1, cwd=str(PEERS))

    def call(self, cmd: str, **args) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the side ended without answering {cmd!r}.")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name} {cmd}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)


def start_peers(args) -> dict[str, Peer]:
    peers = {}
    for name, python, script in (("fabricpc", args.fabricpc_python, "fabricpc_side.py"),
                                 ("pcx", args.pcx_python, "pcx_side.py")):
        if name in args.skip:
            emit({"note": f"{name} skipped (--skip)"})
        elif not Path(python).exists():
            emit({"note": f"{name} skipped: no python at {python} (make its venv, see "
                          f"docs/tree-pc-peers.md, or pass --{name}-python)"})
        else:
            peers[name] = Peer(name, python, script)
    return peers


# ---------------------------------------------------------------------------------------
# The digits data, the shared initial weights and batch order.


def digits(pythons: list[str]) -> tuple[np.ndarray, ...]:
    """scikit-learn's `load_digits` (pixels / 16) split by `train_test_split(test_size=0.2,
    random_state=0)`: `x_train, y_train, x_test, y_test`, from this python or, when it has
    no scikit-learn, from the first of `pythons` that has."""
    code = ("import sys, numpy as np\n"
            "from sklearn.datasets import load_digits\n"
            "from sklearn.model_selection import train_test_split\n"
            "d = load_digits()\n"
            "a, b, c, e = train_test_split(d.data / 16.0, d.target, test_size=0.2, "
            "random_state=0)\n"
            "np.savez(sys.argv[1], x_train=a, x_test=b, y_train=c, y_test=e)\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "digits.npz")
        for python in [sys.executable, *pythons]:
            if Path(python).exists() and subprocess.run(
                    [python, "-c", code, path], capture_output=True, check=False).returncode == 0:
                with np.load(path) as d:
                    return (d["x_train"].astype(np.float32), d["y_train"].astype(np.int32),
                            d["x_test"].astype(np.float32), d["y_test"].astype(np.int32))
    raise SystemExit("tree_pc_peers: no python with scikit-learn for load_digits; install it "
                     "in this environment or in a peer's (pip install scikit-learn).")


def mlp_arrays(pythons: list[str]) -> dict[str, np.ndarray]:
    x_train, y_train, x_test, y_test = digits(pythons)
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    arrays = {"sizes": np.asarray(SIZES), "x_train": x_train, "y_train": y_train,
              "x_test": x_test, "y_test": y_test}
    for l, (k, a, b) in enumerate(zip(keys, SIZES, SIZES[1:], strict=False)):
        net = fusedpc.PCNetwork([a, b], init="xavier", key=k)
        arrays[f"w{l}"] = np.asarray(net.weights[0])
        arrays[f"b{l}"] = np.zeros((b,), np.float32)
    rng = np.random.default_rng(0)
    per_epoch = x_train.shape[0] // BATCH  # the last partial batch is dropped
    arrays["order"] = np.stack([rng.permutation(x_train.shape[0])[:per_epoch * BATCH]
                                .reshape(per_epoch, BATCH) for _ in range(EPOCHS)])
    return arrays


# ---------------------------------------------------------------------------------------
# fusedpc's side (in this process) and the bare jax.grad step.


def mlp_tree(arrays: dict[str, np.ndarray], latents: bool) -> fusedpc.Sequential:
    parts: list = []
    n_mats = len(SIZES) - 1
    for l in range(n_mats):
        net = fusedpc.PCNetwork([SIZES[l], SIZES[l + 1]], weights=[arrays[f"w{l}"]],
                                biases=[arrays[f"b{l}"]])
        parts.append(fusedpc.LearningNetwork(net, optax.adam(MLP_LR)))
        if l < n_mats - 1:
            parts.append(frozen.tanh())
            if latents:
                parts.append(fusedpc.Latent())
    return fusedpc.Sequential(parts)


class Local:
    """A fusedpc (or bare jax) variant timed in this process, with the peers' interface."""

    def __init__(self, build: Callable[[], tuple], batches: list, per_call: int = 1):
        self.state, self.call_fn = build()
        self.batches = batches
        self.per_call = per_call
        self.at = 0
        self.last = None
        start = time.perf_counter()
        self._one(0)
        jax.block_until_ready(self.last)
        self.first_call_s = round(time.perf_counter() - start, 3)
        for i in range(1, WARM):
            self._one(i)
        jax.block_until_ready(self.last)
        self.at = WARM

    def _one(self, i: int) -> None:
        batch = self.batches[(self.at + i) % len(self.batches)]
        self.state, self.last = self.call_fn(self.state, *batch)

    def ms(self, n: int) -> float:
        calls = max(1, n // self.per_call)
        start = time.perf_counter()
        for i in range(calls):
            self._one(i)
        jax.block_until_ready(self.last)
        self.at += calls
        return (time.perf_counter() - start) / (calls * self.per_call) * 1e3


def fused_program(tree, error_fn: str, steps: int | None) -> fusedpc.StepProgram:
    relaxation = None if steps is None else fusedpc.Relaxation(steps=steps, rate=RATE)
    return fusedpc.make_step(tree, error_fn, relaxation=relaxation)


def fused_step(program: fusedpc.StepProgram, detailed: bool = True) -> Callable[[], tuple]:
    def build():
        step = jax.jit(lambda c, x, t: program.step(c, x, t, detailed=detailed),
                       donate_argnums=0)

        def call(carry, x, t):
            carry, out = step(carry, x, t)
            return carry, out.metrics.loss

        return program.init(jax.random.key(0)), call

    return build


def fused_run(program: fusedpc.StepProgram) -> Callable[[], tuple]:
    def build():
        run = jax.jit(lambda c, xs, ts: program.run(c, xs, ts, keep_outputs=False),
                      donate_argnums=0)

        def call(carry, xs, ts):
            carry, out = run(carry, xs, ts)
            return carry, out.metrics.loss

        return program.init(jax.random.key(0)), call

    return build


def mlp_forward(params, x):
    for l, (w, b) in enumerate(params):
        x = x @ w.T + b
        if l < len(params) - 1:
            x = jnp.tanh(x)
    return x


def bare_step(arrays: dict[str, np.ndarray]) -> Callable[[], tuple]:
    optimiser = optax.adam(MLP_LR)

    def loss_fn(params, x, t):
        logits = mlp_forward(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

    @eqx.filter_jit(donate="all-except-first")
    def step(x, state, t):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, t)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def build():
        params = [(jnp.asarray(arrays[f"w{l}"]), jnp.asarray(arrays[f"b{l}"]))
                  for l in range(len(SIZES) - 1)]
        return (params, optimiser.init(params)), lambda s, x, t: step(x, s, t)

    return build


def accuracy(logits, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), -1) == labels))


def fused_train(arrays, latents: bool, steps: int | None) -> dict:
    program = fused_program(mlp_tree(arrays, latents), "softmax_cross_entropy", steps)
    step = jax.jit(program.step, donate_argnums=0)
    carry = program.init(jax.random.key(0))
    losses = []
    for epoch in arrays["order"]:
        for rows in epoch:
            carry, out = step(carry, jnp.asarray(arrays["x_train"][rows]),
                              jnp.asarray(arrays["y_train"][rows]))
            losses.append(out.metrics.loss)
    logits = program.predict(carry.state, jnp.asarray(arrays["x_test"]))
    last = np.asarray(jax.device_get(losses)).reshape(EPOCHS, -1)[-1].mean()
    return {"test_accuracy": accuracy(logits, arrays["y_test"]),
            "last_epoch_loss": float(last),
            "skipped_steps": int(carry.counters.skipped)}


def bare_train(arrays) -> dict:
    state, call = bare_step(arrays)()
    for epoch in arrays["order"]:
        for rows in epoch:
            state, _ = call(state, jnp.asarray(arrays["x_train"][rows]),
                            jnp.asarray(arrays["y_train"][rows]))
    return {"test_accuracy": accuracy(mlp_forward(state[0], jnp.asarray(arrays["x_test"])),
                                      arrays["y_test"])}


# ---------------------------------------------------------------------------------------
# Rounds.


def rounds(variants: dict[str, Callable[[int], float]], n_rounds: int, n: int,
           part: str) -> dict[str, list[float]]:
    """Every variant once a round (the order rotated each round); `n` steps each."""
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(n_rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        if r % 2:
            order.reverse()
        for name in order:
            times[name].append(variants[name](n))
        emit({"part": part, "round": r, "ms": {k: round(v[-1], 3) for k, v in times.items()}})
    return times


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def spread(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return [round(q[0], 3), round(q[-1], 3)]


def target(name: str, value: float | None, goal: float, better: str, note: str) -> None:
    met = None if value is None else (value >= goal if better == "higher" else value <= goal)
    emit({"target": name, "value": None if value is None else round(value, 3), "goal": goal,
          "better": better, "met": met, "note": note})


# ---------------------------------------------------------------------------------------
# The two parts.


def run_mlp(args, peers: dict[str, Peer], pythons: list[str], tmp: str) -> None:
    arrays = mlp_arrays(pythons)
    path = os.path.join(tmp, "mlp.npz")
    np.savez(path, **arrays)
    emit({"part": "mlp", "train_rows": int(arrays["x_train"].shape[0]),
          "test_rows": int(arrays["x_test"].shape[0]),
          "steps_per_epoch": int(arrays["order"].shape[1])})
    for name, peer in peers.items():
        emit({"part": "mlp", "library": name, "versions": peer.call("load", path=path)})

    flat = arrays["order"].reshape(-1, BATCH)
    singles = [(jnp.asarray(arrays["x_train"][r]), jnp.asarray(arrays["y_train"][r]))
               for r in flat]
    stacks = [(jnp.stack([s[0] for s in singles[i:i + PER_CALL]]),
               jnp.stack([s[1] for s in singles[i:i + PER_CALL]]))
              for i in range(0, len(singles) - PER_CALL + 1, PER_CALL)]
    variants: dict[str, Callable[[int], float]] = {}
    first: dict[str, float] = {}
    for steps in args.mlp_steps:
        tree = fused_program(mlp_tree(arrays, True), "softmax_cross_entropy", steps)
        for label, build, batches, per_call in (
                (f"fusedpc_tree_step_T{steps}", fused_step(tree), singles, 1),
                (f"fusedpc_tree_step_quiet_T{steps}", fused_step(tree, False), singles, 1),
                (f"fusedpc_tree_run{PER_CALL}_T{steps}", fused_run(tree), stacks, PER_CALL)):
            local = Local(build, batches, per_call)
            first[label] = local.first_call_s
            variants[label] = local.ms
        for name, peer in peers.items():
            label = f"{name}_T{steps}"
            first[label] = peer.call("mlp_build", name=label, steps=steps, rate=RATE,
                                     lr=MLP_LR)["first_call_s"]
            variants[label] = lambda n, peer=peer, label=label: peer.call(
                "time", name=label, n=n)["ms"]
    exact = fused_program(mlp_tree(arrays, False), "softmax_cross_entropy", None)
    for label, build in (("fusedpc_exact_step", fused_step(exact)),
                         ("jax_grad_adam", bare_step(arrays))):
        local = Local(build, singles)
        first[label] = local.first_call_s
        variants[label] = local.ms
    emit({"part": "mlp", "first_call_s": first})

    times = rounds(variants, args.rounds, args.mlp_n, "mlp")
    summary = {name: median(v) for name, v in times.items()}
    for name, values in times.items():
        emit({"summary": "mlp", "variant": name, "ms_median": summary[name],
              "ms_quartiles": spread(values), "rounds": len(values)})

    say("training 10 epochs per library ...")
    trained = {"fusedpc_exact_step": fused_train(arrays, False, None),
               "jax_grad_adam": bare_train(arrays)}
    for steps in args.mlp_steps:
        trained[f"fusedpc_tree_T{steps}"] = fused_train(arrays, True, steps)
        for name, peer in peers.items():
            trained[f"{name}_T{steps}"] = peer.call("mlp_train", steps=steps, rate=RATE,
                                                    lr=MLP_LR)
    for name, result in trained.items():
        emit({"summary": "mlp_accuracy", "variant": name, **result})

    for library in ("fusedpc_tree_step", *peers):
        cost = sweep_cost([(t, summary[f"{library}_T{t}"]) for t in args.mlp_steps],
                          summary["fusedpc_exact_step"])
        if cost is not None:
            emit({"summary": "mlp_sweep_cost", "library": library, **cost})
    steps = args.mlp_steps[0]
    program = fused_program(mlp_tree(arrays, True), "softmax_cross_entropy", steps)
    emit({"summary": "mlp_scan_body", "variant": f"fusedpc_tree_step_T{steps}",
          **scan_body_ops(program, *singles[0])})

    for steps in args.mlp_steps:
        ours = summary[f"fusedpc_tree_step_T{steps}"]
        for name in peers:
            theirs = summary[f"{name}_T{steps}"]
            gap = abs(trained[f"fusedpc_tree_T{steps}"]["test_accuracy"]
                      - trained[f"{name}_T{steps}"]["test_accuracy"])
            target(f"mlp_T{steps}_speedup_vs_{name}", theirs / ours, TARGETS["mlp_speedup"],
                   "higher", f"{name} {theirs} ms / fusedpc step {ours} ms; test accuracy gap "
                             f"{gap:.4f} ({round(gap * arrays['y_test'].shape[0])} digits)")


def gpt_batches(n: int) -> tuple[np.ndarray, np.ndarray]:
    text = data.load_text()
    tokenizer = data.CharTokenizer.from_text(text)
    if tokenizer.vocab_size != GPT["vocab_size"]:
        raise SystemExit(f"tree_pc_peers: the bundled text has {tokenizer.vocab_size} "
                         f"characters, config S expects {GPT['vocab_size']}.")
    train, _ = data.split(tokenizer.encode(text))
    return data.BatchIterator(train, GPT_BATCH, GPT["max_len"], seed=0).next_batches(n)


def fused_gpt(latents: str, steps: int | None,
              fixed_prediction: bool = False) -> tuple[fusedpc.StepProgram, int]:
    """fusedpc's GPT at config S with `latents` relaxing `steps` sweeps, and its parameter
    count (the reference GPT's)."""
    config = GPTConfig(**GPT, positions="rotary", latents=latents)
    part, reference = build_gpt(config, optax.adam(GPT_LR), jax.random.key(0))
    n_params = sum(int(v.size) for v in jax.tree_util.tree_leaves(
        eqx.filter(reference, eqx.is_inexact_array)))
    relaxation = None if steps is None else fusedpc.Relaxation(
        steps=steps, rate=RATE, fixed_prediction=fixed_prediction)
    return fusedpc.make_step(part, config.error_fn, relaxation=relaxation), n_params


def forward_only(program: fusedpc.StepProgram) -> Callable[[], tuple]:
    """The forward walk alone (`predict`), for the cost of one forward."""
    def build():
        predict = jax.jit(program.predict)
        return (program.init(jax.random.key(0)).state,
                lambda state, x, t: (state, predict(state, x)))

    return build


def sweep_cost(points: list[tuple[int, float]], exact: float) -> dict | None:
    """The least-squares line through (T, step ms): ms per sweep and the rest (the first
    forward, the learning walk, the update), also as fractions of the exact step's `exact`
    ms."""
    if len({t for t, _ in points}) < 2:
        return None
    slope, intercept = np.polyfit([t for t, _ in points], [ms for _, ms in points], 1)
    return {"ms_per_sweep": round(float(slope), 3), "ms_rest": round(float(intercept), 3),
            "sweep_over_exact": round(float(slope) / exact, 3),
            "rest_over_exact": round(float(intercept) / exact, 3),
            "from_T": [t for t, _ in points]}


def scan_body_ops(program: fusedpc.StepProgram, x, t) -> dict:
    """What XLA runs per sweep: the matrix products (its own and in the kernels it calls) and
    the kernels of the largest while-loop body of the compiled step, read off its HLO text,
    and the matrix products of the whole program text (a loop body's counted once)."""
    carry = program.init(jax.random.key(0))
    text = jax.jit(lambda c, x, t: program.step(c, x, t)).lower(carry, x, t).compile().as_text()
    computations: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            lines = computations.setdefault(head.group(1), [])
        else:
            lines.append(line)
    loops = [b for b in re.findall(r"while\(.*body=%?([\w.\-]+)", text) if b in computations]
    in_text = len(re.findall(r"\b(?:dot|convolution)\(", text))
    if not loops:
        return {"dots_in_program_text": in_text}

    def dots(name: str, seen: set[str]) -> int:
        if name in seen or name not in computations:
            return 0
        seen.add(name)
        found = 0
        for line in computations[name]:
            found += bool(re.search(r"\b(dot|convolution)\(", line))
            found += sum(dots(called, seen) for called in re.findall(r"calls=%?([\w.\-]+)", line))
        return found

    body = max(loops, key=lambda name: len(computations[name]))
    kernels = sum(bool(re.search(r" (fusion|dot|custom-call)\(", line))
                  for line in computations[body])
    return {"dots_per_sweep": dots(body, set()), "kernels_per_sweep": kernels,
            "dots_in_program_text": in_text}


def run_gpt(args, peers: dict[str, Peer], tmp: str) -> None:
    xs, ys = gpt_batches(args.gpt_batches)
    path = os.path.join(tmp, "gpt.npz")
    np.savez(path, xs=xs, ys=ys)
    singles = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(xs, ys, strict=True)]
    stacks = [(jnp.asarray(xs[i:i + PER_CALL]), jnp.asarray(ys[i:i + PER_CALL]))
              for i in range(0, len(xs) - PER_CALL + 1, PER_CALL)]
    variants: dict[str, Callable[[int], float]] = {}
    first: dict[str, float] = {}
    exact, n_params = fused_gpt("none", None)
    emit({"part": "gpt", "params": n_params, "tokens_per_step": GPT_BATCH * GPT["max_len"]})
    builds = [("fusedpc_exact_step", fused_step(exact), singles, 1)]
    tree_at = {}
    for steps in sorted(set(args.gpt_sweeps) | {GPT_STEPS}):
        tree, _ = fused_gpt("all", steps)
        tree_at[steps] = tree
        builds.append((f"fusedpc_tree_all_step_T{steps}", fused_step(tree), singles, 1))
        if steps == GPT_STEPS:
            builds.append((f"fusedpc_tree_all_run{PER_CALL}_T{steps}", fused_run(tree), stacks,
                           PER_CALL))
    fixed, _ = fused_gpt("all", GPT_STEPS, fixed_prediction=True)
    builds.append((f"fusedpc_tree_all_fixed_prediction_T{GPT_STEPS}", fused_step(fixed),
                   singles, 1))
    builds.append(("fusedpc_forward_only", forward_only(exact), singles, 1))
    for label, build, batches, per_call in builds:
        say(f"compiling {label} ...")
        local = Local(build, batches, per_call)
        first[label] = local.first_call_s
        variants[label] = local.ms
    if "fabricpc" in peers:
        peer = peers["fabricpc"]
        emit({"part": "gpt", "library": "fabricpc", "versions": peer.call("load", path=path)})
        for steps in sorted(set(args.gpt_peer_sweeps) | {GPT_STEPS}):
            label = f"fabricpc_fully_pc_T{steps}"
            built = peer.call("gpt_build", name=label, width=GPT["width"],
                              n_heads=GPT["n_heads"], n_blocks=GPT["n_blocks"],
                              ff_width=GPT["ff_width"], vocab=GPT["vocab_size"], steps=steps,
                              rate=RATE, lr=GPT_LR)
            first[label] = built["first_call_s"]
            variants[label] = lambda n, label=label: peer.call("time", name=label, n=n)["ms"]
        emit({"part": "gpt", "library": "fabricpc", "params": built["params"]})
    emit({"part": "gpt", "first_call_s": first})
    say("reading the compiled programs ...")
    for label, program in ((f"fusedpc_tree_all_step_T{GPT_STEPS}", tree_at[GPT_STEPS]),
                           (f"fusedpc_tree_all_fixed_prediction_T{GPT_STEPS}", fixed),
                           ("fusedpc_exact_step", exact)):
        emit({"summary": "gpt_scan_body", "variant": label, **scan_body_ops(program,
                                                                            *singles[0])})

    times = rounds(variants, args.gpt_rounds, args.gpt_n, "gpt")
    tokens = GPT_BATCH * GPT["max_len"]
    summary = {name: median(v) for name, v in times.items()}
    for name, values in times.items():
        emit({"summary": "gpt", "variant": name, "ms_median": summary[name],
              "ms_quartiles": spread(values), "tokens_per_s": round(tokens / summary[name] * 1e3),
              "rounds": len(values)})
    for library in ("fusedpc_tree_all_step", "fabricpc_fully_pc"):
        points = [(int(name.rsplit("_T", 1)[1]), ms) for name, ms in summary.items()
                  if name.startswith(library + "_T")]
        cost = sweep_cost(sorted(points), summary["fusedpc_exact_step"])
        if cost is not None:
            emit({"summary": "gpt_sweep_cost", "library": library, **cost})
    ours = summary[f"fusedpc_tree_all_step_T{GPT_STEPS}"]
    target("gpt_tree_over_exact", ours / summary["fusedpc_exact_step"],
           TARGETS["gpt_over_exact"], "lower",
           f"tree-PC {ours} ms / exact {summary['fusedpc_exact_step']} ms")
    label = f"fabricpc_fully_pc_T{GPT_STEPS}"
    if label in summary:
        target("gpt_tokens_vs_fabricpc", summary[label] / ours,
               TARGETS["gpt_tokens_vs_fabricpc"], "higher",
               f"FabricPC {summary[label]} ms / fusedpc tree-PC {ours} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fabricpc-python", default="/work/peer-venvs/fabricpc/bin/python")
    parser.add_argument("--pcx-python", default="/work/peer-venvs/pcx/bin/python")
    parser.add_argument("--parts", default="mlp,gpt", help="a comma list of mlp, gpt")
    parser.add_argument("--skip", default="", help="a comma list of peers to leave out")
    parser.add_argument("--mlp-steps", default="8,20", help="the MLP's T values")
    parser.add_argument("--rounds", type=int, default=7, help="MLP timing rounds")
    parser.add_argument("--mlp-n", type=int, default=100, help="MLP steps per variant a round")
    parser.add_argument("--gpt-rounds", type=int, default=8)
    parser.add_argument("--gpt-n", type=int, default=20, help="GPT steps per variant a round")
    parser.add_argument("--gpt-sweeps", default="1,2,4",
                        help="more T values of fusedpc's GPT step, for the cost of one sweep")
    parser.add_argument("--gpt-peer-sweeps", default="1",
                        help="more T values of FabricPC's transformer step (its sweep cost)")
    parser.add_argument("--gpt-batches", type=int, default=40,
                        help="distinct token batches, cycled")
    args = parser.parse_args(argv)
    args.mlp_steps = [int(s) for s in args.mlp_steps.split(",") if s.strip()]
    args.gpt_sweeps = [int(s) for s in args.gpt_sweeps.split(",") if s.strip()]
    args.gpt_peer_sweeps = [int(s) for s in args.gpt_peer_sweeps.split(",") if s.strip()]
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    parts = {s.strip() for s in args.parts.split(",") if s.strip()}

    emit({"uptime": "before", "load": uptime(), "jax": jax.__version__,
          "fusedpc": fusedpc.__version__, "cpus": os.cpu_count()})
    peers = start_peers(args)
    pythons = [args.fabricpc_python, args.pcx_python]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if "mlp" in parts:
                run_mlp(args, peers, pythons, tmp)
            if "gpt" in parts:
                run_gpt(args, {k: v for k, v in peers.items() if k == "fabricpc"}, tmp)
    finally:
        for peer in peers.values():
            peer.close()
    emit({"uptime": "after", "load": uptime()})


if __name__ == "__main__":
    main()
