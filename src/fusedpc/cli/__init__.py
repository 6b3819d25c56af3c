"""The `fusedpc` command: `fusedpc train` and `fusedpc report` (see `docs/cli.md`).

Arguments are parsed before anything touches JAX's devices, so that `--devices N` can still
make the CPU show N devices. Bad input ends with one line, `fusedpc: error: ...`, on stderr
and a non-zero exit status; never with a traceback (set `FUSEDPC_TRACEBACK=1` to see one).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from fusedpc.training._host_memory import (
    HOST_MEMORY_MODES,
    gpt_step_temporaries,
    host_memory_choice,
)

__all__ = ["build_parser", "main"]

# Flags that set a `TrainConfig` field: (flag, help). The field is the flag's name with
# underscores; type and default come from `TrainConfig`. The parsed defaults are None, so that
# only the flags actually given override the config file (which overrides the defaults).
_CONFIG_FLAGS: tuple[tuple[str, str], ...] = (
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


def _field(flag: str) -> str:
    return flag[2:].replace("-", "_")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error prints the short usage and one `fusedpc: error:` line.
    `commands` maps a sub-command's name to its parser."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"fusedpc: error: {message}\n")


def build_parser() -> _Parser:
    from fusedpc.training._train import TrainConfig  # no JAX backend is started by this import

    parser = _Parser(
        prog="fusedpc",
        description="Train hybrid predictive-coding GPTs and read their step reports.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

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
    defaults = TrainConfig()
    for flag, text in _CONFIG_FLAGS:
        field = _field(flag)
        default = getattr(defaults, field)
        kind = type(default)
        metavar = {int: "N", float: "X"}.get(kind, "PATH" if field == "text" else "NAME")
        train.add_argument(flag, dest=field, type=kind, default=None, metavar=metavar,
                           help=f"{text} (default {default})")
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
    train.set_defaults(handler=_train)

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
    report.set_defaults(handler=_report)
    bench = commands.add_parser(
        "bench", add_help=False,
        help="benchmark fused, fused-run, unfused and backprop steps (fusedpc bench --help)",
    )
    parser.commands = {"train": train, "report": report, "bench": bench}
    return parser


def _train(args: argparse.Namespace) -> int:
    from fusedpc.training import _train as training

    overrides = {
        _field(flag): getattr(args, _field(flag))
        for flag, _ in _CONFIG_FLAGS
        if getattr(args, _field(flag)) is not None
    }
    if args.distributed:
        overrides["distributed"] = True
    if args.resume is not None:
        if args.config is not None:
            raise ValueError(
                "--config and --resume cannot be combined: a resumed run keeps the "
                "configuration in DIR/config.toml (flags such as --steps may still change)."
            )
        config = training.resume_config(args.resume, overrides)
    else:
        config = training.resolve_config(args.config, overrides)
    if config.devices > 1:
        from fusedpc.execution._sharding import emulate_cpu_devices

        try:
            emulate_cpu_devices(config.devices)
        except RuntimeError as err:
            raise ValueError(str(err)) from None
    training.enable_compile_cache(args.compile_cache)
    # before jax computes anything: see fusedpc.training._host_memory
    host_memory_choice(
        args.host_memory,
        gpt_step_temporaries(
            batch=config.batch, seq=config.seq, width=config.width, heads=config.heads,
            blocks=config.blocks, ff_width=config.ff_width,
        ),
    )
    result = training.train(config, args.out, resume_from=args.resume)
    import jax

    if jax.process_index() != 0:  # in a multi-process run, process 0 speaks for all
        return 130 if result.interrupted else 0
    if result.sample:
        print("sample:")
        print(result.sample)
        print()
    print(training.format_summary(result))
    return 130 if result.interrupted else 0  # the shell's status for a run stopped by Ctrl-C


def _report(args: argparse.Namespace) -> int:
    from fusedpc.training import _calibrate, _plots
    from fusedpc.training._train import LOG_NAME, read_log

    path = args.log
    if os.path.isdir(path):
        path = os.path.join(path, LOG_NAME)
    records = read_log(path)
    target = _calibrate.DEFAULT_TARGET if args.target is None else args.target
    table = _calibrate.calibrate(records, target=target, fraction=args.fraction)
    out = args.out or os.path.dirname(os.path.abspath(path))
    for written in _plots.render_all(records, out, target=target):
        print(f"wrote {written}")
    print(_calibrate.format_table(table, target))
    return 0


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and len(err.args) > 1:
        message = err.strerror
    else:
        message = str(err) or type(err).__name__
    return " ".join(message.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run `fusedpc` with `argv` (default `sys.argv[1:]`); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:  # its own flags and parser: fusedpc.bench
        from fusedpc.bench import main as bench_main

        return _guarded(lambda: bench_main(argv[1:]))
    args, extras = parser.parse_known_args(argv)
    if extras:  # name them with the usage of the command they were given to
        command = parser.commands.get(args.command, parser)
        command.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return _guarded(lambda: args.handler(args))


def _guarded(command: Callable[[], int]) -> int:
    """Run `command`; bad input becomes one `fusedpc: error:` line and exit status 1."""
    try:
        return command()
    except (ValueError, TypeError, OSError) as err:
        if os.environ.get("FUSEDPC_TRACEBACK"):
            raise
        print(f"fusedpc: error: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fusedpc: interrupted", file=sys.stderr)
        return 130

