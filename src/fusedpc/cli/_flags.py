"""The flags of `fusedpc train` that set a `TrainConfig` setting."""

from __future__ import annotations

import argparse

# Flags that set a `TrainConfig` field: (flag, help). The field is the flag's name with
# underscores; type and default come from `TrainConfig`. The parsed defaults are None, so that
# only the flags actually given override the config file (which overrides the defaults).
CONFIG_FLAGS: tuple[tuple[str, str], ...] = (
    ("--text", "a bundled text name or a UTF-8 text file to train on"),
    ("--tokenizer", "'char' (the text's characters) or 'byte' (256 tokens)"),
    ("--validation-fraction", "share of the text, at its end, held out for validation"),
    ("--data", "a corpus folder made by fusedpc prepare (memory-mapped ids and their "
     "tokeniser), trained on instead of --text"),
    ("--width", "model width"),
    ("--n-heads", "attention heads; must divide the width"),
    ("--n-blocks", "transformer blocks"),
    ("--ff-width", "feed-forward hidden width"),
    ("--max-len", "the position table's length, also the tokens per row"),
    ("--learn", "learning slots: a preset (all, ff_head, none) or a comma list of token, "
     "position, attention, feed_forward, norm, head"),
    ("--learning-kind", "precision_weighted, standard, synaptic_uncertainty, or iterative "
     "(the feed-forwards learn by iterative inference)"),
    ("--window", "window of synaptic_uncertainty (required with it)"),
    ("--latents", "none, blocks (a latent after the embedding and every block) or all (after "
     "every slot): the whole transformer relaxes them on one energy"),
    ("--latent-precision", "precision of every latent's prediction error"),
    ("--inference-steps", "relaxation sweeps of the latents (--latents), and of the iterative "
     "kind's feed-forwards"),
    ("--inference-rate", "step size of the latents' and the iterative kind's relaxation"),
    ("--inference-tolerance", "with --latents: stop the sweeps once the energy's relative "
     "change falls below this (at most --inference-steps); 0: always all"),
    ("--incremental-inference", "true, with --latents: incremental PC, the weights step at "
     "every sweep too"),
    ("--parameterisation", "standard, or mupc: every block's two residual branches scaled by "
     "1/sqrt(2 n_blocks) (the depth multiplier of muPC), for deep stacks"),
    ("--head-kind", "gaussian (logits) or categorical (probabilities)"),
    ("--fused-qkv", "true: the learning query, key and value projections as one fused part"),
    ("--hidden-precision", "precision of the feed-forward's hidden-layer errors"),
    ("--scan", "how blocks run: auto (unrolled up to 4, scanned beyond), true or false"),
    ("--attention-mixing", "tiles (cached weights), or dot_product_attention "
     "(jax.nn.dot_product_attention; no T x T cache, for GPUs)"),
    ("--compute-dtype", "float32, or bfloat16 (also --dtype bf16): activations and matrix "
     "products in bfloat16, weights and optimiser state float32"),
    ("--norm", "layer (LayerNorm) or rms (RMSNorm) in every norm slot"),
    ("--positions", "table (a learned position table) or rotary (queries and keys rotated "
     "by position; no table)"),
    ("--feed-forward", "gelu (linear, GELU, linear) or swiglu (a gated feed-forward)"),
    ("--optimiser", "adam, adamw or sgd"),
    ("--lr", "learning rate"),
    ("--weight-decay", "weight decay of adamw"),
    ("--clip", "global gradient-norm clipping over all parts (clip_by_global_norm); 0: none"),
    ("--lr-schedule", "after the warm-up: constant, or cosine decay to --lr-final-fraction"),
    ("--warmup-steps", "steps of linear warm-up from 0 to --lr; 0: none"),
    ("--lr-decay-steps", "the step where the cosine ends; 0: the run's --steps"),
    ("--lr-final-fraction", "the cosine's final rate, as a fraction of --lr"),
    ("--slot-lr-scales", "per-slot rate multipliers, e.g. head=0.5,attention=2 (such as the "
     "rates a calibration chose, which 'fusedpc report' prints)"),
    ("--calibrate", "none, or probe (also: auto): calibrate every slot's rate once, at "
     "--calibrate-at, by trial runs at x0.5 and x2 that keep what lowers the held-out loss"),
    ("--calibrate-at", "the step of the calibration; 0: 15%% of --steps"),
    ("--probe-steps", "steps per trial run of the calibration"),
    ("--steps", "total steps to reach"),
    ("--batch", "rows per step, per process"),
    ("--steps-per-call", "steps per compiled call (FusedPipeline.run)"),
    ("--seed", "seed of the weights, the batches and the sample"),
    ("--eval-every", "steps between validations; 0: only at the start and the end"),
    ("--eval-batches", "validation batches per evaluation"),
    ("--report-every", "steps between logged step reports"),
    ("--save-every", "steps between checkpoints; 0: only at the end"),
    ("--tensorboard", "also write TensorBoard event files into DIR/tensorboard (needs "
     "tensorboardX: pip install 'fusedpc[tensorboard]')"),
    ("--init-from", "a run folder whose checkpoint a new run starts from (weights and optimiser "
     "state), e.g. to fine-tune at a lower --lr"),
    ("--max-update-ratio", "skip a step in which a part's update/weight norm ratio exceeds "
     "this; 0: no bound"),
    ("--loss-spike", "skip a step whose loss exceeds this factor (> 1) times the running mean "
     "loss; 0: no guard"),
    ("--sample-tokens", "tokens of the sample generated at the end; 0: none"),
    ("--temperature", "temperature of the sample (0: greedy)"),
    ("--infill-hide-every", "at the end, hide every K-th validation token, fill them in by "
     "relaxation (fusedpc infill) and report the accuracy; 0: not"),
    ("--devices", "data-parallel devices; on CPU they are emulated"),
)


ALIASES: dict[str, str] = {"--heads": "--n-heads", "--blocks": "--n-blocks", "--seq": "--max-len"}

SPELLINGS: dict[str, str] = {"--compute-dtype": "--dtype"}
"""Shorter spellings of flags, accepted alongside them."""
"""The flags of fusedpc 0.1, still accepted: each is another spelling of the flag it names."""


def setting_name(flag: str) -> str:
    """The setting a flag sets: `--max-len` -> `max_len`."""
    return flag[2:].replace("-", "_")


def parse_bool(text: str) -> bool:
    """`true`/`false` (also `1`/`0`, `yes`/`no`) as a flag's value."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
        str(text).strip().lower()
    )
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def parse_scan(text: str) -> bool | str:
    """`auto`, `true` or `false` as the value of `--scan`."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}") from None
