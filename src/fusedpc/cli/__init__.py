"""The `fusedpc` command: `fusedpc train` and `fusedpc report` (see `docs/cli.md`).

Arguments are parsed before anything touches JAX's devices, so that `--devices N` can still
make the CPU show N devices. Bad input ends with one line, `fusedpc: error: ...`, on stderr
and a non-zero exit status; never with a traceback (set `FUSEDPC_TRACEBACK=1` to see one).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from fusedpc.cli._parser import build_parser

__all__ = ["build_parser", "main"]


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and len(err.args) > 1:
        # keep the path: "File exists: runs/x", not "File exists"
        message = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
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
    except (MemoryError, RuntimeError) as err:
        # an allocation failure (XLA's RESOURCE_EXHAUSTED, or the host's) is one line too, and
        # so is a run whose first step failed in XLA (`RunStartError`: its files removed);
        # any other runtime error is a bug worth its traceback
        from fusedpc.training._loop import RunStartError  # loaded already when it is one

        text = str(err)
        if isinstance(err, RunStartError) and not os.environ.get("FUSEDPC_TRACEBACK"):
            print(f"fusedpc: error: {_one_line(err)}", file=sys.stderr)
            return 1
        if os.environ.get("FUSEDPC_TRACEBACK") or not (
            isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
        ):
            raise
        print(
            f"fusedpc: error: out of memory ({_one_line(err)[:200]}); lower --batch, --width or "
            "--max-len.",
            file=sys.stderr,
        )
        return 1

