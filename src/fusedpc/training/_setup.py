"""The pieces a run is built from: tokens, mesh, optimisers, pipeline; and `load_run`."""

from __future__ import annotations

import os

import jax

from fusedpc.execution._checkpoint import read_checkpoint_manifest
from fusedpc.execution._pipeline import FusedPipeline
from fusedpc.execution._sharding import data_mesh
from fusedpc.training import data
from fusedpc.training._config import CHECKPOINT_NAME, TrainConfig, resume_config
from fusedpc.training._optimisers import make_optimiser
from fusedpc.transformer._build import build_gpt


def config_optimiser(config: TrainConfig, scale: float = 1.0):
    """The optax optimiser named by `config.optimiser` at rate `scale * config.lr`."""
    return make_optimiser(config.optimiser, config.lr * scale, config.weight_decay)


def load_tokens(config: TrainConfig, tokenizer: dict | None = None):
    """`(text, tokenizer, train_ids, val_ids)` for `config`; `tokenizer` (a `to_dict`) when
    resuming, so that the vocabulary is the one the model was built with."""
    text = data.load_text(config.text)
    if tokenizer is not None:
        tok = data.tokenizer_from_dict(tokenizer)
    elif config.tokenizer == "char":
        tok = data.CharTokenizer.from_text(text)
    else:
        tok = data.ByteTokenizer()
    ids = tok.encode(text)
    train_ids, val_ids = data.split(ids, config.validation_fraction)
    for name, part in (("training", train_ids), ("validation", val_ids)):
        if len(part) < config.seq + 1:
            raise ValueError(
                f"the text's {name} split has {len(part)} tokens, fewer than seq + 1 = "
                f"{config.seq + 1}; use a longer text, a shorter --seq or another "
                "validation_fraction."
            )
    return text, tok, train_ids, val_ids


def make_mesh(config: TrainConfig):
    """The data-parallel mesh for `config` (None for one device in one process)."""
    if config.distributed:
        return data_mesh()  # every device of every process
    return None if config.devices == 1 else data_mesh(config.devices)


def build_pipeline(config: TrainConfig, vocab_size: int, mesh=None):
    """The `FusedPipeline` of a run: `build_gpt` at `jax.random.key(config.seed)`."""
    gpt = config.gpt_config(vocab_size)
    slot_optimisers = {
        slot: config_optimiser(config, scale) for slot, scale in config.lr_scales().items()
    }
    part, _ = build_gpt(
        gpt, config_optimiser(config), jax.random.key(config.seed), slot_optimisers=slot_optimisers
    )
    return FusedPipeline(part, gpt.error_fn, key=jax.random.key(config.seed), mesh=mesh)


def load_run(run_dir: str | os.PathLike):
    """`(pipeline, tokenizer, config, metadata)` of the run saved in `run_dir`."""
    config = resume_config(run_dir)
    path = os.path.join(os.fspath(run_dir), CHECKPOINT_NAME)
    metadata = read_checkpoint_manifest(path)["metadata"]
    tok = data.tokenizer_from_dict(metadata["tokenizer"])
    pipeline = build_pipeline(config, tok.vocab_size)
    pipeline.load(path)
    return pipeline, tok, config, metadata


def call_size(step: int, total: int, per_call: int) -> int:
    """Steps in the next compiled call from `step`: up to the next multiple of `per_call`
    (and not beyond `total`), so that a run resumed anywhere rejoins the same calls."""
    return min(per_call - step % per_call, total - step)
