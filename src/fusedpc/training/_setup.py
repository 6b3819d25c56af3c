"""The pieces a run is built from: tokens, mesh, optimisers, pipeline; and `load_run`."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fusedpc.execution._checkpoint import read_checkpoint_manifest
from fusedpc.execution._pipeline import FusedPipeline
from fusedpc.execution._sharding import data_mesh
from fusedpc.execution._tree_relaxation import Relaxation
from fusedpc.training import data
from fusedpc.training._config import TrainConfig
from fusedpc.training._config_file import CHECKPOINT_NAME, resume_config
from fusedpc.training._optimisers import learning_rate_schedule, make_optimiser
from fusedpc.training._rates import scale_by_rate_multiplier, with_rate_multiplier
from fusedpc.training.corpus import open_corpus
from fusedpc.transformer._build import GPTConfig, build_gpt


def config_schedule(config: TrainConfig, scale: float = 1.0):
    """The rate schedule of `config` at peak `scale * config.lr` (a float when constant)."""
    return learning_rate_schedule(
        config.lr * scale,
        config.warmup_steps,
        config.lr_schedule,
        config.lr_decay_steps or config.steps,
        config.lr_final_fraction,
    )


def config_optimiser(config: TrainConfig, scale: float = 1.0, *, multiplier: bool = False):
    """The optax optimiser named by `config.optimiser` at rate `scale * config.lr`, on the
    config's schedule (warm-up, then constant or cosine); with a calibration, or when
    `multiplier` asks for it, its rate multiplier in the state (`with_rate_multiplier`)."""
    optimiser = make_optimiser(
        config.optimiser, config_schedule(config, scale), config.weight_decay
    )
    wrap = multiplier or config.calibrate != "none"
    return with_rate_multiplier(optimiser) if wrap else optimiser


def resolve_tokenizer(
    config: TrainConfig,
    text: str,
    saved: dict[str, Any] | None = None,
    tokenizer: data.Tokenizer | None = None,
) -> data.Tokenizer:
    """The run's tokeniser: `tokenizer` if given, else the one `saved` describes (a
    checkpoint's `to_dict`), else the one `config.tokenizer` names, built for `text`.

    Any object with `encode`, `decode`, `vocab_size` and `to_dict` will do
    (`fusedpc.training.data.Tokenizer`). When resuming (`saved` given) a `tokenizer` must
    describe itself as the checkpoint does: `tokenizer.to_dict() == saved`. A description of
    a kind other than the built-in ones can only be matched by giving the tokeniser again.
    """
    if tokenizer is not None:
        data.check_tokenizer(tokenizer)
        if saved is not None and tokenizer.to_dict() != saved:
            raise ValueError(
                f"tokenizer: the run was trained with the tokeniser {saved!r}, got one whose "
                f"to_dict() is {tokenizer.to_dict()!r}; resume with the same tokeniser."
            )
        return tokenizer
    if saved is not None:
        try:
            return data.tokenizer_from_dict(saved)
        except ValueError as err:
            raise ValueError(
                f"{err}; the run was trained with a tokeniser of your own: pass it again "
                "(train(..., tokenizer=...) or load_run(..., tokenizer=...))."
            ) from None
    if config.tokenizer == "char":
        return data.CharTokenizer.from_text(text)
    return data.ByteTokenizer()


def encode_text(tokenizer: data.Tokenizer, text: str) -> np.ndarray:
    """`tokenizer.encode(text)` checked: 1-D integers in `[0, tokenizer.vocab_size)`."""
    ids = np.asarray(tokenizer.encode(text))
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"tokenizer.encode: expected a 1-D array of integer token ids, got shape "
            f"{ids.shape} and dtype {ids.dtype}."
        )
    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        raise ValueError(
            f"tokenizer.encode: token ids must lie in [0, vocab_size={tokenizer.vocab_size}), "
            f"got values from {ids.min()} to {ids.max()}."
        )
    return ids


def load_tokens(
    config: TrainConfig,
    saved: dict[str, Any] | None = None,
    tokenizer: data.Tokenizer | None = None,
):
    """`(text, tokenizer, train_ids, val_ids)` for `config`; `saved` (a checkpoint's
    `to_dict`) when resuming, so that the vocabulary is the one the model was built with;
    `tokenizer` to use a tokeniser of your own (see `resolve_tokenizer`)."""
    if config.data:
        text, tok, train_ids, val_ids = _corpus_tokens(config, saved, tokenizer)
    else:
        text = data.load_text(config.text)
        tok = resolve_tokenizer(config, text, saved, tokenizer)
        train_ids, val_ids = data.split(encode_text(tok, text), config.validation_fraction)
    for name, part in (("training", train_ids), ("validation", val_ids)):
        if len(part) < config.model.max_len + 1:
            raise ValueError(
                f"the text's {name} split has {len(part)} tokens, fewer than max_len + 1 = "
                f"{config.model.max_len + 1}; use a longer text, a shorter --max-len or another "
                "validation_fraction."
            )
    return text, tok, train_ids, val_ids


def _corpus_tokens(config: TrainConfig, saved: dict[str, Any] | None,
                   tokenizer: data.Tokenizer | None):
    """`load_tokens` for a prepared corpus (`config.data`): its description (`meta.json`,
    standing for the text in the run's fingerprint), its tokeniser, its memory maps."""
    corpus = open_corpus(config.data)
    if tokenizer is None and corpus.tokenizer is None:
        raise ValueError(f"data: {config.data!r} has no meta.json naming its tokeniser; "
                         "prepare it with fusedpc prepare, or pass a tokenizer.")
    tok = corpus.tokenizer if tokenizer is None else data.check_tokenizer(tokenizer)
    if saved is not None and tok.to_dict() != saved:
        raise ValueError(f"data: the run was trained with another tokeniser than the corpus "
                         f"{config.data!r} holds; resume with the corpus it was trained on.")
    if tok.vocab_size != corpus.vocab_size:
        raise ValueError(f"tokenizer: {tok.vocab_size} ids, but the corpus {config.data!r} has "
                         f"{corpus.vocab_size}.")
    described = json.dumps({k: v for k, v in corpus.meta.items() if k != "source"},
                           sort_keys=True)
    return described, tok, corpus.train, corpus.val


def make_mesh(config: TrainConfig):
    """The data-parallel mesh for `config` (None for one device in one process)."""
    if config.distributed:
        return data_mesh()  # every device of every process
    return None if config.devices == 1 else data_mesh(config.devices)


def reference_skeleton(config: TrainConfig, vocab_size: int):
    """The run's GPT as a `fusedpc.transformer.reference.GPT` of its sizes and options, at
    weights drawn from key 0 (a skeleton for `to_reference`, or for counting shapes)."""
    from fusedpc.transformer.reference import GPT

    m = config.model
    return GPT(vocab_size, m.width, m.n_heads, m.n_blocks, m.ff_width, m.max_len,
               norm=m.norm, positions=m.positions, feed_forward=m.feed_forward,
               branch_scale=m.branch_scale, key=jax.random.key(0))


def parameter_count(config: TrainConfig, vocab_size: int) -> int:
    """The model's parameters (weights, biases, tables, LayerNorm affines): those of its
    equinox twin, counted from shapes alone (`jax.eval_shape`: nothing is allocated)."""
    import equinox as eqx

    shapes = eqx.filter_eval_shape(reference_skeleton, config, vocab_size)
    leaves = jax.tree_util.tree_leaves(shapes)
    return int(
        sum(
            int(np.prod(leaf.shape))
            for leaf in leaves
            if isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)
        )
    )


def build_part(config: TrainConfig, gpt: GPTConfig, key: jax.Array, *,
               multipliers: bool = False):
    """The run's GPT part (`build_gpt` of `gpt`, the model of `config`) at `key`: every slot
    with the optimiser the config gives it (its rate scale; under a calibration of the synaptic
    rule, a rate multiplier over the rule's own steps); `multipliers` puts a rate multiplier
    in every optimiser's state (a study's runs that differ in their rates only)."""
    slot_optimisers: dict[str, Any] = {
        slot: config_optimiser(config, scale, multiplier=multipliers)
        for slot, scale in config.lr_scales().items()
    }
    if config.calibrate != "none" and gpt.learning_kind == "synaptic_uncertainty":
        # the synaptic rule's own steps, scaled by a multiplier (the LayerNorms: optax)
        for slot in config.calibrated_slots():
            if slot != "norm":
                slot_optimisers[slot] = scale_by_rate_multiplier()
    return build_gpt(gpt, config_optimiser(config, multiplier=multipliers), key,
                     slot_optimisers=slot_optimisers)[0]


def model_relaxation(gpt: GPTConfig) -> Relaxation | None:
    """The relaxation of a model with latents (None without)."""
    return None if gpt.latents == "none" else Relaxation(
        steps=gpt.relaxation_steps, rate=gpt.relaxation_rate,
        tolerance=gpt.relaxation_tolerance, incremental=gpt.relaxation_incremental)


def build_pipeline(config: TrainConfig, vocab_size: int, mesh=None):
    """The `FusedPipeline` of a run: `build_part` at `jax.random.key(config.seed)`."""
    gpt = config.gpt_config(vocab_size)
    return FusedPipeline(
        build_part(config, gpt, jax.random.key(config.seed)),
        gpt.error_fn,
        key=jax.random.key(config.seed),
        mesh=mesh,
        settings=config.step_settings,
        relaxation=model_relaxation(gpt),
    )


def load_run(
    run_dir: str | os.PathLike[str], *, tokenizer: data.Tokenizer | None = None,
    argument: str = "run_dir",
) -> tuple[FusedPipeline, data.Tokenizer, TrainConfig, dict[str, Any]]:
    """The run saved in `run_dir`.

    Args:
        run_dir: a folder `fusedpc train` wrote (its `config.toml` and `checkpoint.fpc`).
        tokenizer: the tokeniser the run was trained with, when it is one of your own (a
            built-in one is rebuilt from the checkpoint).
        argument: what the messages call `run_dir` (`fusedpc sample` and `eval` say `RUN`).

    Returns:
        `(pipeline, tokenizer, config, metadata)`.
    """
    config = resume_config(run_dir, argument=argument)
    path = os.path.join(os.fspath(run_dir), CHECKPOINT_NAME)
    metadata = read_checkpoint_manifest(path)["metadata"]
    tok = resolve_tokenizer(config, "", metadata["tokenizer"], tokenizer)
    pipeline = build_pipeline(config, tok.vocab_size)
    pipeline.load(path)
    return pipeline, tok, config, metadata


def call_size(step: int, total: int, per_call: int) -> int:
    """Steps in the next compiled call from `step`: up to the next multiple of `per_call`
    (and not beyond `total`), so that a run resumed anywhere rejoins the same calls."""
    return min(per_call - step % per_call, total - step)
