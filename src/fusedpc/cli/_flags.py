"""The flags of `fusedpc train` that set a `TrainConfig` setting."""

from __future__ import annotations

# Flags that set a `TrainConfig` field: (flag, help). The field is the flag's name with
# underscores; type and default come from `TrainConfig`. The parsed defaults are None, so that
# only the flags actually given override the config file (which overrides the defaults).
CONFIG_FLAGS: tuple[tuple[str, str], ...] = (
    ("--text", "a bundled text name or a UTF-8 text file to train on"),
    ("--tokenizer", "'char' (the text's characters) or 'byte' (256 tokens)"),
    ("--validation-fraction", "share of the text, at its end, held out for validation"),
    ("--width", "model width"),
    ("--heads", "attention heads; must divide the width"),
    ("--blocks", "transformer blocks"),
    ("--ff-width", "feed-forward hidden width"),
    ("--seq", "tokens per row, also the position table's length"),
    ("--learn", "learning slots: a preset (all, ff_head, none) or a comma list of token, "
     "position, attention, feed_forward, norm, head"),
    ("--learning-kind", "precision_weighted, standard or synaptic_uncertainty"),
    ("--window", "window of synaptic_uncertainty (required with it)"),
    ("--head-kind", "gaussian (logits) or categorical (probabilities)"),
    ("--optimiser", "adam, adamw or sgd"),
    ("--lr", "learning rate"),
    ("--weight-decay", "weight decay of adamw"),
    ("--slot-lr-scales", "per-slot rate multipliers, e.g. head=0.5,attention=2 (what "
     "'fusedpc report' suggests)"),
    ("--steps", "total steps to reach"),
    ("--batch", "rows per step, per process"),
    ("--steps-per-call", "steps per compiled call (FusedPipeline.run)"),
    ("--seed", "seed of the weights, the batches and the sample"),
    ("--eval-every", "steps between validations; 0: only at the start and the end"),
    ("--eval-batches", "validation batches per evaluation"),
    ("--report-every", "steps between logged step reports"),
    ("--save-every", "steps between checkpoints; 0: only at the end"),
    ("--sample-tokens", "tokens of the sample generated at the end; 0: none"),
    ("--temperature", "temperature of the sample (0: greedy)"),
    ("--devices", "data-parallel devices; on CPU they are emulated"),
)


def setting_name(flag: str) -> str:
    return flag[2:].replace("-", "_")
