"""What `fusedpc train` and `fusedpc report` do with their parsed arguments."""

from __future__ import annotations

import argparse
import os

from fusedpc.cli._flags import CONFIG_FLAGS, setting_name
from fusedpc.training import gpt_step_temporaries, host_memory_choice


def train_command(args: argparse.Namespace) -> int:
    from fusedpc.training import _config_file, _loop, _runtime

    overrides = {
        setting_name(flag): getattr(args, setting_name(flag))
        for flag, _ in CONFIG_FLAGS
        if getattr(args, setting_name(flag)) is not None
    }
    if args.distributed:
        overrides["distributed"] = True
    if args.resume is not None:
        if args.config is not None:
            raise ValueError(
                "--config and --resume cannot be combined: a resumed run keeps the "
                "configuration in DIR/config.toml (flags such as --steps may still change)."
            )
        config = _config_file.resume_config(args.resume, overrides)
    else:
        config = _config_file.resolve_config(args.config, overrides)
    if config.devices > 1:
        try:
            _runtime.emulate_cpu_devices(config.devices)
        except RuntimeError as err:
            raise ValueError(str(err)) from None
    _runtime.enable_compile_cache(args.compile_cache)
    # before jax computes anything: see fusedpc.training._host_memory
    host_memory_choice(
        args.host_memory,
        gpt_step_temporaries(
            batch=config.batch, seq=config.model.max_len, width=config.model.width,
            heads=config.model.n_heads, blocks=config.model.n_blocks,
            ff_width=config.model.ff_width,
        ),
    )
    result = _loop.train(config, args.out, resume_from=args.resume)
    import jax

    if jax.process_index() != 0:  # in a multi-process run, process 0 speaks for all
        return 130 if result.interrupted else 0
    if result.sample:
        print("sample:")
        print(result.sample)
        print()
    print(_loop.format_summary(result))
    return 130 if result.interrupted else 0  # the shell's status for a run stopped by Ctrl-C


def report_command(args: argparse.Namespace) -> int:
    from fusedpc.training import _calibrate, _plots
    from fusedpc.training._log import LOG_NAME, read_log

    path = args.log
    if os.path.isdir(path):
        path = os.path.join(path, LOG_NAME)
    records = read_log(path)
    target = _calibrate.DEFAULT_TARGET if args.target is None else args.target
    table = _calibrate.calibrate(records, target=target, fraction=args.fraction)
    out = args.out or os.path.dirname(os.path.abspath(path))
    if _plots.plots_available():
        for written in _plots.render_all(records, out, target=target):
            print(f"wrote {written}")
    else:
        print(_plots.PLOTS_MISSING)
    print(_calibrate.format_table(table, target))
    return 0


