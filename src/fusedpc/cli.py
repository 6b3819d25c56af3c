"""The `fusedpc` command: `fusedpc train` and `fusedpc report` (see `docs/cli.md`).

Arguments are parsed before anything touches JAX's devices, so that `--devices N` can still
make the CPU show N devices. Bad input ends with one line, `fusedpc: error: ...`, on stderr
and a non-zero exit status; never with a traceback (set `FUSEDPC_TRACEBACK=1` to see one).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Flags that set a `TrainConfig` field: (flag, field, type, help). Their defaults are None, so
# that only the flags actually given override the config file (which overrides the defaults).
_CONFIG_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--text", "text", str, "a UTF-8 text file to train on (default: the bundled 'hamlet')"),
    ("--tokenizer", "tokenizer", str, "'char' (the text's characters) or 'byte' (256 tokens)"),
    ("--validation-fraction", "validation_fraction", float,
     "share of the text, at its end, held out for validation (default 0.1)"),
    ("--width", "width", int, "model width (default 64)"),
    ("--heads", "heads", int, "attention heads; must divide the width (default 4)"),
    ("--blocks", "blocks", int, "transformer blocks (default 2)"),
    ("--ff-width", "ff_width", int, "feed-forward hidden width (default 256)"),
    ("--seq", "seq", int, "tokens per row, also the position table's length (default 64)"),
    ("--learn", "learn", str,
     "learning slots: a preset (all, ff_head, none) or a comma list of token, position, "
     "attention, feed_forward, norm, head (default all)"),
    ("--learning-kind", "learning_kind", str,
     "precision_weighted (default), standard or synaptic_uncertainty"),
    ("--window", "window", int, "window of synaptic_uncertainty (required with it)"),
    ("--head-kind", "head_kind", str, "gaussian (logits, default) or categorical"),
    ("--optimiser", "optimiser", str, "adam (default), adamw or sgd"),
    ("--lr", "lr", float, "learning rate (default 3e-3)"),
    ("--weight-decay", "weight_decay", float, "weight decay of adamw (default 1e-4)"),
    ("--steps", "steps", int, "total steps to reach (default 1000)"),
    ("--batch", "batch", int, "rows per step, per process (default 16)"),
    ("--steps-per-call", "steps_per_call", int,
     "steps per compiled call (FusedPipeline.run; default 10)"),
    ("--seed", "seed", int, "seed of the weights, the batches and the sample (default 0)"),
    ("--eval-every", "eval_every", int,
     "steps between validations; 0: only at the start and the end (default 200)"),
    ("--eval-batches", "eval_batches", int, "validation batches per evaluation (default 8)"),
    ("--report-every", "report_every", int,
     "steps between logged step reports (default 10)"),
    ("--save-every", "save_every", int,
     "steps between checkpoints; 0: only at the end (default 0)"),
    ("--sample-tokens", "sample_tokens", int,
     "tokens of the sample generated at the end; 0: none (default 200)"),
    ("--temperature", "temperature", float, "temperature of the sample (default 0.8)"),
    ("--devices", "devices", int,
     "data-parallel devices; on CPU they are emulated (default 1)"),
)


class _Parser(argparse.ArgumentParser):
    """argparse, but an error prints the short usage and one `fusedpc: error:` line."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"fusedpc: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fusedpc",
        description="Train hybrid predictive-coding GPTs and read their step reports.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = commands.add_parser(
        "train",
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
    for flag, field, kind, text in _CONFIG_FLAGS:
        train.add_argument(flag, dest=field, type=kind, default=None, help=text)
    train.add_argument("--distributed", action="store_true", default=None,
                       help="join a multi-process run (jax.distributed.initialize())")
    train.set_defaults(handler=_train)

    report = commands.add_parser(
        "report",
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
    report.add_argument("--target", type=float, default=None,
                        help="target update/weight ratio per step (default 1e-3)")
    report.add_argument("--fraction", type=float, default=1.0,
                        help="use only the last FRACTION of the logged steps (default 1)")
    report.set_defaults(handler=_report)
    return parser


def _train(args: argparse.Namespace) -> int:
    from . import _train as training

    overrides = {
        field: getattr(args, field)
        for _, field, _, _ in _CONFIG_FLAGS
        if getattr(args, field) is not None
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
        if args.config is not None and not os.path.isfile(args.config):
            raise FileNotFoundError(f"--config: no config file at {args.config!r}")
        config = training.resolve_config(args.config, overrides)
    if config.devices > 1:
        from ._sharding import emulate_cpu_devices

        try:
            emulate_cpu_devices(config.devices)
        except RuntimeError as err:
            raise ValueError(str(err)) from None
    result = training.train(config, args.out, resume_from=args.resume)
    if result.sample:
        print("sample:")
        print(result.sample)
        print()
    print(training.format_summary(result))
    return 0


def _report(args: argparse.Namespace) -> int:
    from . import _calibrate, _plots
    from ._train import LOG_NAME, read_log

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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except (ValueError, TypeError, OSError) as err:
        if os.environ.get("FUSEDPC_TRACEBACK"):
            raise
        print(f"fusedpc: error: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fusedpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
