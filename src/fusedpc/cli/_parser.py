"""The `fusedpc` argument parser: the sub-commands and the flags of `fusedpc train`."""

from __future__ import annotations

import argparse
import sys

from fusedpc.cli._commands import (
    eval_command,
    infill_command,
    prepare_command,
    report_command,
    sample_command,
    study_command,
    train_command,
)
from fusedpc.cli._flags import (
    ALIASES,
    CONFIG_FLAGS,
    SPELLINGS,
    parse_bool,
    parse_scan,
    setting_name,
)
from fusedpc.training import HOST_MEMORY_MODES
from fusedpc.training._infill import INFILL_RATE, INFILL_STEPS
from fusedpc.training._runtime import PLATFORMS


class _Parser(argparse.ArgumentParser):
    """argparse, but an error prints the short usage and one `fusedpc: error:` line.
    `commands` maps a sub-command's name to its parser."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"fusedpc: error: {message}\n")


_Commands = argparse._SubParsersAction  # what add_subparsers returns; each helper adds one


def build_parser() -> _Parser:
    """`fusedpc` and its sub-commands, each added by its own helper below; `commands` on the
    result maps a sub-command's name to its parser."""
    from fusedpc._version import __version__

    parser = _Parser(
        prog="fusedpc",
        description="Train hybrid predictive-coding GPTs and read their step reports.",
    )
    parser.add_argument("--version", action="version", version=f"fusedpc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    parser.commands = {
        name: add(commands)
        for name, add in (("train", _train), ("report", _report), ("sample", _sample),
                          ("eval", _eval), ("infill", _infill), ("prepare", _prepare),
                          ("study", _study),
                          ("bench", _bench))
    }
    return parser


def _train(commands: _Commands) -> _Parser:
    """`fusedpc train`: its own flags, then one per `TrainConfig` setting (`_config_flags`)."""
    train = commands.add_parser(
        "train",
        usage="fusedpc train [--config FILE] [--out DIR] [--resume DIR] [--steps N] [options]",
        help="train a hybrid predictive-coding GPT (on the bundled text by default)",
        description=(
            "Train a hybrid predictive-coding GPT. Settings come from the defaults, then "
            "--config FILE, then the flags given. Writes config.toml, log.jsonl, "
            "checkpoint.fpc and PNG plots into --out."
        ),
    )
    train.add_argument("--config", metavar="FILE", help="TOML config file (see docs/cli.md)")
    train.add_argument("--out", metavar="DIR",
                       help="output folder (default runs/<timestamp>; with --resume, DIR)")
    train.add_argument("--resume", metavar="DIR",
                       help="continue the run in DIR up to --steps total steps")
    train.add_argument("--allow-config-change", action="store_true",
                       help="with --resume: accept a DIR/config.toml edited since the "
                       "checkpoint (the change is logged); refused without it")
    _config_flags(train)
    train.add_argument("--device", choices=PLATFORMS, default=None,
                       help="the JAX platform to run on (default: JAX's choice, the GPU or "
                       "TPU when one is installed; JAX_PLATFORMS also works)")
    train.add_argument("--distributed", action="store_true", default=None,
                       help="join a multi-process run (jax.distributed.initialize())")
    train.add_argument("--compile-cache", metavar="DIR",
                       help="JAX compilation cache folder, reused by later runs (default "
                       "$FUSEDPC_CACHE or ~/.cache/fusedpc/jax); 'none' leaves JAX's own "
                       "setting")
    train.add_argument("--host-memory", choices=HOST_MEMORY_MODES, default="auto",
                       help="reuse: keep freed host memory for the next step "
                       "(fusedpc.training.reuse_host_memory); system: the C library's defaults; "
                       "auto "
                       "(default): reuse when a step's estimated temporaries reach 128 MiB")
    train.set_defaults(handler=train_command)
    return train


def _config_flags(train: argparse.ArgumentParser) -> None:
    """One flag per `CONFIG_FLAGS` entry, typed by its `TrainConfig` default; the old
    spellings (`ALIASES`) and the short ones (`SPELLINGS`) set the same setting."""
    from fusedpc.training._settings import SETTINGS  # no JAX backend is started by this import

    old_spelling = {new: old for old, new in ALIASES.items()}
    for flag, text in CONFIG_FLAGS:
        field = setting_name(flag)
        default = SETTINGS[field]
        kind = parse_scan if field == "scan" else parse_bool if type(default) is bool else type(
            default
        )
        metavar = {int: "N", float: "X", parse_bool: "BOOL", parse_scan: "SCAN"}.get(
            kind, "PATH" if field in ("text", "data") else "NAME"
        )
        flags = [flag, old_spelling[flag]] if flag in old_spelling else [flag]
        if flag in SPELLINGS:
            flags.append(SPELLINGS[flag])
        default_text = str(default).lower() if isinstance(default, bool) else default
        train.add_argument(*flags, dest=field, type=kind, default=None, metavar=metavar,
                           help=f"{text} (default {default_text})",
                           # a bool flag alone means true: --tensorboard, --fused-qkv
                           nargs="?" if kind is parse_bool else None,
                           const=True if kind is parse_bool else None)


def _report(commands: _Commands) -> _Parser:
    """`fusedpc report LOG`."""
    report = commands.add_parser(
        "report",
        usage="fusedpc report LOG [--out DIR] [--target X] [--fraction X]",
        help="re-render the plots and print a rate calibration table from a log",
        description=(
            "Re-render loss.png, update_norm.png and update_ratio.png from a log.jsonl and "
            "print, per learning part, the median update/weight ratio and the learning-rate "
            "multiplier that brings it to --target."
        ),
    )
    report.add_argument("log", metavar="LOG", help="a log.jsonl, or the run folder holding it")
    report.add_argument("--out", metavar="DIR", help="where to write the plots (default: the "
                        "log's folder)")
    report.add_argument("--target", type=float, default=None, metavar="X",
                        help="target update/weight ratio per step (default 1e-3)")
    report.add_argument("--fraction", type=float, default=1.0, metavar="X",
                        help="use only the last FRACTION of the logged steps (default 1)")
    report.set_defaults(handler=report_command)
    return report


def _sample(commands: _Commands) -> _Parser:
    """`fusedpc sample RUN`."""
    sample = commands.add_parser(
        "sample",
        usage="fusedpc sample RUN [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] "
        "[--seed S]",
        help="print text sampled from a run's checkpoint",
        description="Sample from the model in RUN/checkpoint.fpc; the prompt is shown in [].",
    )
    sample.add_argument("run", metavar="RUN", help="a run folder fusedpc train wrote")
    sample.add_argument("--prompt", metavar="TEXT", help="the text to continue (default: a "
                        "newline)")
    sample.add_argument("--tokens", type=int, default=200, metavar="N",
                        help="tokens to generate (default 200)")
    sample.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="sampling temperature, 0: greedy (default: the run's)")
    sample.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample only among the K most likely tokens (default: all)")
    sample.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seed of the sampling (default 0)")
    sample.set_defaults(handler=sample_command)
    return sample


def _run_and_text(parser: argparse.ArgumentParser) -> None:
    """`RUN` and `--text PATH`, as `eval` and `infill` read them."""
    parser.add_argument("run", metavar="RUN", help="a run folder fusedpc train wrote")
    parser.add_argument("--text", metavar="PATH",
                        help="a bundled text name or a UTF-8 text file (default: the run's "
                        "validation split)")


def _eval(commands: _Commands) -> _Parser:
    """`fusedpc eval RUN`."""
    evaluate = commands.add_parser(
        "eval",
        usage="fusedpc eval RUN [--text PATH] [--batches N]",
        help="the validation loss and perplexity of a run's checkpoint on a text",
        description="Mean cross-entropy (nats per token) and perplexity of RUN's checkpoint "
        "on --text (default: the run's own validation split, as fusedpc train measures it).",
    )
    _run_and_text(evaluate)
    evaluate.add_argument("--batches", type=int, default=None, metavar="N",
                          help="batches of the run's batch size and length (default: the "
                          "run's eval_batches)")
    evaluate.set_defaults(handler=eval_command)
    return evaluate


def _infill(commands: _Commands) -> _Parser:
    """`fusedpc infill RUN`."""
    infill = commands.add_parser(
        "infill",
        usage="fusedpc infill RUN [--text PATH] [--hide-every K] [--batches N] [--steps T] "
        "[--rate X] [--json]",
        help="fill in hidden tokens by relaxing them as generative latents",
        description="Hide every K-th token of RUN's validation windows (or --text's), infer "
        "them from the tokens on both sides by relaxing each as a distribution over the "
        "vocabulary on the GPT's energy, and compare with the causal readout.",
    )
    _run_and_text(infill)
    infill.add_argument("--hide-every", type=int, default=8, metavar="K",
                        help="hide positions K, 2K, ... of every window (default 8)")
    infill.add_argument("--batches", type=int, default=None, metavar="N",
                        help="windows: N batches of the run's batch size and length (default: "
                        "the run's eval_batches)")
    infill.add_argument("--steps", type=int, default=INFILL_STEPS, metavar="T",
                        help=f"relaxation sweeps (default {INFILL_STEPS})")
    infill.add_argument("--rate", type=float, default=INFILL_RATE, metavar="X",
                        help=f"step size of the relaxation (default {INFILL_RATE:g})")
    infill.add_argument("--json", action="store_true",
                        help="print the figures as one JSON line")
    infill.set_defaults(handler=infill_command)
    return infill


def _study(commands: _Commands) -> _Parser:
    """`fusedpc study`: its own flags, then one per `TrainConfig` setting (`_config_flags`)."""
    study = commands.add_parser(
        "study",
        usage="fusedpc study [--config FILE] [--seeds N] [--vary NAME=V1,V2,...] "
        "[--case NAME=V,...] [--out DIR] [options]",
        help="train N seeds per setting (the seeds in one vmapped program) and compare",
        description="Train every case with every combination of the --vary values, N seeds "
        "each (one vmapped compiled step per setting; settings that differ only in their rates "
        "share one), and write runs.jsonl, summary.json, table.md (mean ± std, "
        "a bootstrap interval against the first setting) and curves.png into --out.",
    )
    study.add_argument("--config", metavar="FILE", help="TOML config file (see docs/cli.md)")
    study.add_argument("--seeds", type=int, default=None, metavar="N",
                       help="seeds per setting, from --seed on (default: [study] seeds in "
                       "--config, else 3)")
    study.add_argument("--vary", action="append", metavar="NAME=V1,V2,...",
                       help="a setting and its values (repeat for a grid; adds to, or replaces "
                       "a setting of, [study] vary in --config)")
    study.add_argument("--case", action="append", metavar="NAME=V,NAME=V,...",
                       help="one setting of several values, tried as one case (repeat for "
                       "more; each case runs with every --vary combination; replaces [study] "
                       "cases in --config)")
    study.add_argument("--out", metavar="DIR",
                       help="a new output folder (default studies/<timestamp>)")
    _config_flags(study)
    study.add_argument("--device", choices=PLATFORMS, default=None,
                       help="the JAX platform to run on (default: JAX's choice)")
    study.set_defaults(handler=study_command)
    return study


def _prepare(commands: _Commands) -> _Parser:
    """`fusedpc prepare SOURCE --out DATA`."""
    prepare = commands.add_parser(
        "prepare",
        usage="fusedpc prepare SOURCE --out DATA [--tokenizer char|byte|bpe] [--vocab N] "
        "[--validation-fraction X]",
        help="tokenise a text file or folder into a memory-mapped corpus for train --data",
        description="Write DATA/train.bin and DATA/val.bin (token ids, uint16 or uint32, "
        "nanoGPT's layout) and DATA/meta.json (dtype, vocabulary, tokeniser) from SOURCE, a "
        "UTF-8 text file or a folder of .txt files; a BPE tokeniser is trained here, offline.",
    )
    prepare.add_argument("source", metavar="SOURCE", help="a UTF-8 text file or a folder of "
                         ".txt files")
    prepare.add_argument("--out", required=True, metavar="DATA",
                         help="a new folder for the corpus (never overwritten)")
    prepare.add_argument("--tokenizer", choices=("char", "byte", "bpe"), default="char",
                         help="char (the source's characters), byte (256 ids) or bpe (trained "
                         "on the source; needs --vocab) (default char)")
    prepare.add_argument("--vocab", type=int, default=None, metavar="N",
                         help="the BPE vocabulary, > 256")
    prepare.add_argument("--validation-fraction", type=float, default=0.1, metavar="X",
                         help="the share of the tokens, at the end, held out (default 0.1)")
    prepare.set_defaults(handler=prepare_command)
    return prepare


def _bench(commands: _Commands) -> _Parser:
    """`fusedpc bench`: its flags are `fusedpc.bench`'s own (`fusedpc.cli.main` hands them on)."""
    return commands.add_parser(
        "bench", add_help=False,
        help="benchmark fused, fused-run, unfused and backprop steps (fusedpc bench --help)",
    )
