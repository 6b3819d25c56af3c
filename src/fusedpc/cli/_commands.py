"""What `fusedpc train` and `fusedpc report` do with their parsed arguments."""

from __future__ import annotations

import argparse
import os

from fusedpc.cli._flags import CONFIG_FLAGS, setting_name
from fusedpc.training import gpt_step_temporaries, host_memory_choice


def _given_settings(args: argparse.Namespace) -> dict:
    """The `TrainConfig` settings the command line gave (the flags not given are None)."""
    return {setting_name(flag): getattr(args, setting_name(flag)) for flag, _ in CONFIG_FLAGS
            if getattr(args, setting_name(flag)) is not None}


def train_command(args: argparse.Namespace) -> int:
    from fusedpc.training import _config_file, _loop, _runtime

    overrides = _given_settings(args)
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
    _runtime.select_platform(args.device)  # after the host-memory choice: starts JAX
    if args.allow_config_change and args.resume is None:
        raise ValueError("--allow-config-change: only with --resume DIR.")
    result = _loop.train(
        config, args.out, resume_from=args.resume, allow_config_change=args.allow_config_change
    )
    import jax

    if jax.process_index() != 0:  # in a multi-process run, process 0 speaks for all
        return 130 if result.interrupted else 0
    if result.sample:
        print("sample (the prompt in []):")
        print(result.marked_sample())
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
    # the same figures in the unit a run takes (one multiplier per slot), ready to paste
    current: dict[str, float] = {}
    config = None
    config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "config.toml")
    if os.path.isfile(config_path):
        from fusedpc.training import _config_file

        config = _config_file.resolve_config(config_path)
        current = config.lr_scales()
    slots = _calibrate.calibrate_slots(records, target, args.fraction, current)
    flag = _calibrate.slot_lr_scales_flag(slots)
    if slots:
        print()
        print(_calibrate.format_table(slots, target).replace(
            "calibration: median update/weight ratio per step",
            "per slot (every part of a slot shares its optimiser): median update/weight ratio",
        ))
    if flag:
        scaled = " (the run's own --slot-lr-scales included)" if current else ""
        print(
            f"\nthese multipliers follow the rule of thumb (every ratio at {target:g}); it is "
            "not a calibration: in the calibration study it made the validation loss worse "
            "with Adam (docs/calibration.md). To apply them anyway"
            f"{scaled}, train with:\n  --slot-lr-scales {flag}"
        )
        print(f'or in the config file:\n  [optimiser]\n  slot_lr_scales = "{flag}"')
    print("\nsuggestion (from the calibration study, or this run's own calibration):")
    if config is None:
        print("  no config.toml next to the log, so no study cell to compare this run with")
        return 0
    from fusedpc.training._evidence import suggest

    for line in suggest(config, records):
        print(f"  {line}")
    return 0




def sample_command(args: argparse.Namespace) -> int:
    """`fusedpc sample RUN`: text from a run's checkpoint, the prompt marked in brackets."""
    import jax
    import numpy as np

    from fusedpc.training import _setup
    from fusedpc.transformer import generate

    pipeline, tokenizer, config, _ = _setup.load_run(args.run, argument="RUN")
    prompt = args.prompt if args.prompt is not None else "\n"
    if not prompt:
        raise ValueError("--prompt: give at least one character (the default is a newline).")
    ids = np.asarray(tokenizer.encode(prompt), np.int32)
    temperature = config.temperature if args.temperature is None else args.temperature
    out = generate(pipeline, ids[None], args.tokens, temperature,
                   jax.random.key(args.seed), top_k=args.top_k)
    continuation = tokenizer.decode(np.asarray(out)[0, ids.size:])
    print(f"[{prompt}]{continuation}")
    return 0


def _run_tokens(text: str | None, tokenizer, config, metadata: dict):
    """The ids `eval` and `infill` read: the run's own validation split (as `train`
    evaluates it), or `text` (a bundled name or a file) in the run's tokeniser."""
    import numpy as np

    from fusedpc.training import _setup, data

    if text is None:
        return _setup.load_tokens(config, metadata["tokenizer"], tokenizer)[3]
    return np.asarray(tokenizer.encode(data.load_text(text)), np.int32)


def eval_command(args: argparse.Namespace) -> int:
    """`fusedpc eval RUN`: the checkpoint's mean cross-entropy and perplexity on a text."""
    import math

    from fusedpc.training import _setup, data
    from fusedpc.training._evaluate import evaluate

    pipeline, tokenizer, config, metadata = _setup.load_run(args.run, argument="RUN")
    ids = _run_tokens(args.text, tokenizer, config, metadata)
    if args.text is None:
        source = (f"the validation split of {config.data!r}" if config.data
                  else f"the validation split of {config.text!r}")
    else:
        source = repr(args.text)
    batches = config.eval_batches if args.batches is None else args.batches
    if batches < 1:
        raise ValueError(f"--batches: expected an integer >= 1, got {batches}.")
    windows = data.BatchIterator(ids, config.batch, config.model.max_len, seed=config.seed)
    x, y = windows.next_batches(batches)
    loss = evaluate(pipeline, x, y, config.model.head_kind == "categorical")
    print(f"{source}: {batches} batches of {config.batch} x {config.model.max_len} tokens: "
          f"loss {loss:.4f}, perplexity {math.exp(loss):.2f}")
    return 0


def infill_command(args: argparse.Namespace) -> int:
    """`fusedpc infill RUN`: hidden tokens filled in by relaxation, against the causal
    readout."""
    import json

    from fusedpc.training import _setup
    from fusedpc.training._infill import format_infill, infill_score

    pipeline, tokenizer, config, metadata = _setup.load_run(args.run, argument="RUN")
    ids = _run_tokens(args.text, tokenizer, config, metadata)
    score = infill_score(pipeline, config, tokenizer, ids, hide_every=args.hide_every,
                         batches=args.batches, steps=args.steps, rate=args.rate)
    print(json.dumps(score) if args.json else format_infill(score))
    return 0


def prepare_command(args: argparse.Namespace) -> int:
    """`fusedpc prepare SOURCE --out DATA`: a corpus on disk for `fusedpc train --data`."""
    from fusedpc.training.corpus import prepare_corpus

    meta = prepare_corpus(args.source, args.out, tokenizer=args.tokenizer,
                          vocab_size=args.vocab, validation_fraction=args.validation_fraction)
    print(f"{args.out}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} validation "
          f"tokens ({meta['dtype']}), vocabulary {meta['vocab_size']:,} "
          f"({meta['tokenizer']['kind']}); train on it with fusedpc train --data {args.out}")
    return 0


def study_command(args: argparse.Namespace) -> int:
    """`fusedpc study --seeds N --vary name=v1,v2`: the seeds vmapped, each setting compiled."""
    import datetime

    from fusedpc.training import _config_file, _runtime
    from fusedpc.training.study import parse_cases, parse_vary, run_study, study_table

    overrides = _given_settings(args)
    seeds, vary, cases = study_table(args.config) if args.config else (None, {}, [])
    vary.update(parse_vary(args.vary or []))  # a flag's setting replaces the file's
    cases = parse_cases(args.case) if args.case else cases  # the flags replace the file's
    seeds = args.seeds if args.seeds is not None else 3 if seeds is None else seeds
    config = _config_file.resolve_config(args.config, overrides, other_sections=("study",))
    out = args.out or os.path.join(
        "studies", datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S"))
    _runtime.select_platform(args.device)
    run_study(config, seeds, vary, out, cases=cases)
    print(f"written: {out}/runs.jsonl, summary.json, table.md, curves.png")
    return 0
