"""Building what a variant measures: the GPT, its optimiser, the mesh, the batches, and the
one call that the timing loop repeats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fusedpc.bench._args import (
    CADENCE_VARIANTS,
    CALIBRATED_VARIANTS,
    FUSED_VARIANTS,
    RUN_VARIANTS,
    SCANNED_VARIANTS,
    TREE_PC_VARIANTS,
    UNROLLED_VARIANTS,
    BenchArgs,
    base_variant,
    variant_inference_steps,
)


def variant_scan(variant: str) -> bool | str:
    """The `GPTConfig.scan` a fused variant is built with.

    Args:
        variant: a fused variant's name.

    Returns:
        `True` (always scanned), `False` (a tuple of blocks) or `"auto"` (`build_gpt`'s
        default: a `Repeat` unrolled up to `AUTO_UNROLL_BLOCKS` blocks, scanned beyond).
    """
    if variant in SCANNED_VARIANTS:
        return True
    if variant in UNROLLED_VARIANTS:
        return False
    return "auto"


def variant_blocks_form(variant: str, n_blocks: int) -> str:
    """How a fused variant runs its blocks (`fusedpc.transformer.blocks_form`).

    Args:
        variant: a fused variant's name.
        n_blocks: the number of blocks.

    Returns:
        `"scanned"`, `"unrolled"` (an unrolled `Repeat`, what `scan="auto"` gives for few
        blocks) or `"tuple"` (`scan=False`).
    """
    from fusedpc.transformer import blocks_form

    return blocks_form(variant_scan(variant), n_blocks)


class Setup:
    """The GPT config, optimiser, mesh and device-resident batches shared by a variant.

    Args:
        args: the bench's settings.
        n_blocks: the number of GPT blocks (one depth of a sweep).

    Raises:
        RuntimeError: when `args.devices` asks for more devices than jax sees (jax started
            before `JAX_NUM_CPU_DEVICES` was set).
    """

    def __init__(self, args: BenchArgs, n_blocks: int):
        import jax
        import jax.numpy as jnp

        from fusedpc.training import make_optimiser

        self.args = args
        self.n_blocks = n_blocks
        self.optimiser = make_optimiser(args.optimiser, args.lr)
        self.mesh = None
        if args.devices > 1:
            if jax.device_count() < args.devices:
                raise RuntimeError(
                    f"--devices {args.devices}: jax sees {jax.device_count()} devices; jax "
                    "started before JAX_NUM_CPU_DEVICES was set. Run the bench in a fresh process."
                )
            self.mesh = jax.sharding.Mesh(jax.devices()[: args.devices], ("data",))
        key = jax.random.key(args.seed)
        self.model_key, data_key = jax.random.split(key)
        k_ids, k_targets = jax.random.split(data_key)
        shape = (4, args.batch, args.max_len)
        self.ids = jax.random.randint(k_ids, shape, 0, args.vocab, dtype=jnp.int32)
        self.targets = jax.random.randint(k_targets, shape, 0, args.vocab, dtype=jnp.int32)
        # Sliced and placed once: a call's timing holds the step, not the batch's preparation.
        self.batches = [
            (self.shard(self.ids[j]), self.shard(self.targets[j])) for j in range(shape[0])
        ]
        run_shape = (args.k, args.batch, args.max_len)
        self.run_ids = jax.random.randint(k_ids, run_shape, 0, args.vocab, dtype=jnp.int32)
        self.run_targets = jax.random.randint(
            k_targets, run_shape, 0, args.vocab, dtype=jnp.int32
        )

    def config(self, scan: bool | str, inference_steps: int | None = None,
               latents: bool = False):
        """The `GPTConfig` of these settings with blocks run per `scan`; with
        `inference_steps`, the feed-forwards learn by iterative inference (that many steps at
        `--inference-rate`), or with `latents` every slot's output is a latent."""
        import fusedpc

        args = self.args
        kind: dict[str, Any] = {}
        if latents:
            kind = {"latents": "all"}
        elif inference_steps is not None:
            kind = {"learning_kind": "iterative", "learning_kwargs": {
                "inference_steps": inference_steps, "inference_rate": args.inference_rate,
            }}
        return fusedpc.GPTConfig(
            vocab_size=args.vocab, width=args.width, n_heads=args.n_heads,
            n_blocks=self.n_blocks, ff_width=args.ff_width, max_len=args.max_len,
            learn=args.learning, scan=scan,
            compute_dtype=args.dtype, parameterisation=args.parameterisation, **kind,
        )

    def build(
        self, scan: bool | str, rate_multiplier: bool = False,
        inference_steps: int | None = None, latents: bool = False,
    ):
        """`(config, part, reference)`: the config and `fusedpc.build_gpt`'s part and twin;
        with `rate_multiplier`, the optimiser carries one (`with_rate_multiplier`); with
        `inference_steps`, the feed-forwards are `IterativeNetwork`s relaxing that many
        steps."""
        import fusedpc
        from fusedpc.training import with_rate_multiplier

        config = self.config(scan, inference_steps, latents)
        optimiser = with_rate_multiplier(self.optimiser) if rate_multiplier else self.optimiser
        part, reference = fusedpc.build_gpt(config, optimiser, self.model_key)
        return config, part, reference

    def pipeline(self, variant: str):
        """The `FusedPipeline` of a fused variant (an iterative one at its T: `base_variant`)."""
        import fusedpc

        steps = variant_inference_steps(variant, self.args.inference_steps)
        variant = base_variant(variant)
        tree_pc = variant in TREE_PC_VARIANTS
        config, part, _ = self.build(
            scan=variant_scan(variant), rate_multiplier=variant in CALIBRATED_VARIANTS,
            inference_steps=steps, latents=tree_pc,
        )
        guards: dict[str, Any] = {"nonfinite": self.args.nonfinite}
        if variant == "fused_guards":  # loose bounds: every rule computed, nothing skipped
            guards.update(max_update_ratio=1.0, loss_spike=100.0)
        elif variant == "fused_unguarded":
            guards["nonfinite"] = "ignore"
        if tree_pc:
            guards["relaxation"] = fusedpc.Relaxation(
                steps=self.args.inference_steps if steps is None else steps,
                rate=self.args.inference_rate,
                tolerance=self.args.inference_tolerance or None,
                incremental=self.args.incremental_inference)
        return fusedpc.FusedPipeline(part, config.error_fn, mesh=self.mesh, **guards)

    def shard(self, x, axis: int = 0):
        """Place a batch with its batch axis over the mesh's 'data' axis (no mesh: as is)."""
        from fusedpc.execution import shard_batch

        return shard_batch(x, self.mesh, axis)

    def batch(self, i: int):
        """The `i`-th `(ids, targets)` batch (four, taken in turn)."""
        return self.batches[i % len(self.batches)]


def _infill_call(setup: Setup, variant: str) -> Callable:
    """The `infill` variant's call: the batch's every 8th token hidden and relaxed as
    generative latents (`fusedpc.transformer.infill`) at its T and `--inference-rate`."""
    import jax
    import jax.numpy as jnp

    from fusedpc.transformer import infill

    _, _, reference = setup.build(scan=True)
    steps = variant_inference_steps(variant, setup.args.inference_steps)
    assert steps is not None  # an infill variant always has its T
    relax = jax.jit(lambda r, ids, hidden: infill(r, ids, hidden, steps=steps,
                                                  rate=setup.args.inference_rate).ids)
    ids = setup.batch(0)[0]
    hidden = setup.shard(jnp.zeros(ids.shape, bool).at[:, 8::8].set(True))

    def infill_call(i: int) -> Any:
        return relax(reference, setup.batch(i)[0], hidden)

    return infill_call


def prepare_variant(args: BenchArgs, variant: str, n_blocks: int) -> tuple[Callable, int]:
    """Build one variant.

    Args:
        args: the bench's settings.
        variant: the variant's name (not a probe).
        n_blocks: the number of GPT blocks.

    Returns:
        `(call, steps_per_call)`: `call(i)` runs one call on batch `i` and returns what to
        block on; `steps_per_call` is `args.k` for the `run` variants, 1 otherwise.

    Raises:
        ValueError: for an unknown variant.
    """
    import equinox as eqx
    import jax

    from fusedpc.execution import UnfusedPipeline
    from fusedpc.transformer.reference import make_backprop_step

    setup = Setup(args, n_blocks)
    if base_variant(variant) in FUSED_VARIANTS:
        pipeline = setup.pipeline(variant)
        if base_variant(variant) in RUN_VARIANTS:
            every = args.k if variant in CADENCE_VARIANTS else None

            def run_call(i: int) -> Any:
                pipeline.run(setup.run_ids, setup.run_targets, keep_outputs=False,
                             report_every=every)
                return pipeline.state, pipeline.last_metrics.loss

            return run_call, args.k

        def step_call(i: int) -> Any:
            y, e = pipeline.step(*setup.batch(i))
            return y, e, pipeline.state

        return step_call, 1

    if base_variant(variant) == "infill":
        return _infill_call(setup, variant), 1

    if variant == "unfused":
        config, part, _ = setup.build(scan=False)
        plain = UnfusedPipeline(part, config.error_fn, mesh=setup.mesh)

        def unfused_call(i: int) -> Any:
            y, e = plain.step(*setup.batch(i))
            return y, e, plain.state

        return unfused_call, 1

    if variant == "backprop":
        _, _, reference = setup.build(scan=True)
        step = make_backprop_step(setup.optimiser, compute_dtype=setup.args.dtype)
        holder = {"model": reference, "opt": None}
        if setup.mesh is not None:
            replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
            holder["model"] = jax.device_put(holder["model"], replicated)
        holder["opt"] = setup.optimiser.init(eqx.filter(holder["model"], eqx.is_array))

        def backprop_call(i: int) -> Any:
            model, opt, loss = step(holder["model"], holder["opt"], *setup.batch(i))
            holder["model"], holder["opt"] = model, opt
            return model, loss

        return backprop_call, 1
    raise ValueError(f"unknown variant {variant!r}")
