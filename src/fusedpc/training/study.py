"""Studies as a command: `fusedpc study --seeds N --vary name=v1,v2,... --case name=v,...`
(`run_study`).

A study trains one run per seed and setting (every case, default one, with every combination
of the varied values). The runs of settings that differ only in values that live in the state
(the rates: `lr`, `slot_lr_scales`) are one vmapped compiled program together with their
seeds (`fusedpc.training.seeds.train_runs`); every other setting is its own compiled group (it
may change shapes, the learning kind, the depth, or other static configuration). It writes,
into a new folder:

* `runs.jsonl`: one line per run and evaluation point (setting, seed, step, validation loss,
  the mean training loss since the previous point);
* `summary.json` and `table.md`: per setting the final validation loss's mean, standard
  deviation and seeds, and against the first setting the difference of means with a 95 %
  bootstrap interval (10,000 resamples of the seeds, with replacement, within each setting)
  and the verdict: "lower" or "higher" when the interval excludes 0, else "no difference
  shown";
* `curves.png`: each setting's validation loss over the steps, the mean with a band of
  plus or minus one standard deviation over the seeds.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fusedpc.training._config import TrainConfig
from fusedpc.training._settings import (
    SETTINGS,
    coerce_settings,
    config_from_settings,
    config_settings,
)
from fusedpc.training.seeds import SeedRuns, shared_program, train_runs

RESAMPLES = 10_000


def _assignment(item: str, flag: str, expected: str, seen: dict[str, Any],
                text: str) -> tuple[str, str]:
    """`name=value` of `flag`: the setting's name (dashes read as underscores; a known
    setting, not yet in `seen`) and the value's text; `text` is what the message quotes."""
    name, sep, value = item.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not value.strip():
        raise ValueError(f"{flag}: expected {expected}, got {text!r}.")
    if name in seen:
        raise ValueError(f"{flag}: {name!r} given twice ({text!r}).")
    _known(name, flag)
    return name, value.strip()


def parse_vary(texts: list[str]) -> dict[str, list[Any]]:
    """`["lr=0.001,0.003", ...]` as `{"lr": [0.001, 0.003]}`, each value read as its
    setting's type and checked as a config file's are (the message names the bad one)."""
    out: dict[str, list[Any]] = {}
    for text in texts:
        name, values = _assignment(text, "--vary", "name=v1,v2,...", out, text)
        out[name] = _checked(name, [_typed(name, v.strip()) for v in values.split(",")],
                             "--vary")
    return out


def parse_cases(texts: list[str]) -> list[dict[str, Any]]:
    """`["learning_kind=iterative,inference_steps=4", ...]` as one setting per text
    (`{"learning_kind": "iterative", "inference_steps": 4}`), each value read and checked as
    `parse_vary` reads one."""
    expected = "name=value,name=value,..."
    cases = []
    for text in texts:
        case: dict[str, Any] = {}
        for item in filter(None, (t.strip() for t in text.split(","))):
            name, value = _assignment(item, "--case", expected, case, text)
            case[name] = _checked(name, [_typed(name, value)], "--case")[0]
        if not case:
            raise ValueError(f"--case: expected {expected}, got {text!r}.")
        cases.append(case)
    return cases


def study_table(
    path: str | os.PathLike[str],
) -> tuple[int | None, dict[str, list[Any]], list[dict[str, Any]]]:
    """The `[study]` table of a TOML config file: `seeds = N`, `vary = {name = [v1, v2]}` and
    `cases = [{name = v, ...}, ...]` (each optional; `(None, {}, [])` without the table),
    checked as the flags are."""
    with open(path, "rb") as handle:
        table = tomllib.load(handle).get("study", {})
    where = f"config file {str(path)!r}"
    unknown = sorted(set(table) - {"seeds", "vary", "cases"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} in [study]; known keys there: "
                         "seeds, vary, cases.")
    seeds = table.get("seeds")
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int)):
        raise ValueError(f"{where}: [study] seeds must be an integer, got {seeds!r}.")
    vary = table.get("vary", {})
    if not isinstance(vary, dict) or not all(isinstance(v, list) and v for v in vary.values()):
        raise ValueError(f"{where}: [study] vary must be a table of non-empty lists, e.g. "
                         "vary = {lr = [0.001, 0.003]}.")
    cases = table.get("cases", [])
    if not isinstance(cases, list) or not all(isinstance(c, dict) and c for c in cases):
        raise ValueError(f"{where}: [study] cases must be a list of non-empty tables, e.g. "
                         'cases = [{learning_kind = "standard"}, {lr = 0.01}].')
    return seeds, {name: _checked(name, values, f"{where}: [study] vary")
                   for name, values in vary.items()}, [
        {name: _checked(name, [value], f"{where}: [study] cases")[0]
         for name, value in case.items()} for case in cases]


def _known(name: str, where: str) -> None:
    """A setting a study may vary: one of `SETTINGS`, not the seed."""
    if name not in SETTINGS:
        raise ValueError(f"{where}: unknown setting {name!r}; known: {', '.join(SETTINGS)}.")
    if name == "seed":
        raise ValueError(f"{where}: the seeds are --seeds, not a setting to vary.")


def _checked(name: str, values: list[Any], where: str) -> list[Any]:
    """`values` of the setting `name`, each checked by the config file's own rules
    (`coerce_settings`)."""
    _known(name, where)
    return [coerce_settings({name: value}, where)[name] for value in values]


def _typed(name: str, text: str) -> Any:
    """A command-line value as its setting's type (`true`/`false` for a boolean and for
    `scan`, whose other value is `auto`)."""
    kind = type(SETTINGS[name])
    if kind is bool or (name == "scan" and text.lower() in ("true", "false")):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--vary: {name}={text!r} is not true or false.")
        return text.lower() == "true"
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--vary: {name}={text!r} is not a {kind.__name__}.") from None


def settings_grid(vary: dict[str, list[Any]],
                  cases: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every case (default: one empty case) with every combination of the varied values, in
    the order given (one empty setting when nothing varies)."""
    names = list(vary)
    combinations = [dict(zip(names, values)) for values in itertools.product(*vary.values())]
    cases = cases or [{}]
    for case in cases:
        both = sorted(set(case) & set(vary))
        if both:
            raise ValueError(f"--case and --vary both set {both}: a setting is either varied "
                             "or set per case.")
    return [{**case, **combination} for case in cases for combination in combinations]


def label(setting: dict[str, Any]) -> str:
    """A setting as `name=value, ...` (`base` when nothing varies)."""
    return ", ".join(f"{k}={v}" for k, v in setting.items()) or "base"


def bootstrap_difference(a: np.ndarray, b: np.ndarray, seed: int = 0) -> tuple[float, ...]:
    """`mean(b) - mean(a)` and its 95 % percentile bootstrap interval (each sample resampled
    with replacement, `RESAMPLES` times)."""
    rng = np.random.default_rng(seed)
    a_means = rng.choice(a, (RESAMPLES, len(a))).mean(axis=1)
    b_means = rng.choice(b, (RESAMPLES, len(b))).mean(axis=1)
    low, high = np.percentile(b_means - a_means, [2.5, 97.5])
    return float(b.mean() - a.mean()), float(low), float(high)


def summarise(results: list[tuple[dict[str, Any], SeedRuns]],
              programs: list[int] | None = None) -> list[dict[str, Any]]:
    """One row per setting: the final validation loss's mean, std, the seeds, the compiled
    program it ran in (`programs`; its compile and wall seconds, and the training tokens per
    second of each of its runs, are the program's); the difference to the first setting with
    its interval and verdict."""
    rows = []
    base = results[0][1].val_loss[:, -1]
    programs = programs or list(range(len(results)))
    for i, (setting, runs) in enumerate(results):
        final = runs.val_loss[:, -1]
        shared = programs.count(programs[i]) * len(final)
        row: dict[str, Any] = {
            "setting": label(setting), **setting, "seeds": len(final),
            "val_loss_mean": round(float(final.mean()), 4),
            "val_loss_std": round(float(final.std(ddof=1)), 4) if len(final) > 1 else 0.0,
            "skipped_steps": int(runs.skipped.sum()), "program": programs[i],
            "compile_s": round(runs.compile_s, 2), "wall_s": round(runs.wall_s, 2),
            "run_tokens_per_s": None if runs.tokens_per_s is None else
            round(runs.tokens_per_s / shared, 1)}
        if i:
            difference, low, high = bootstrap_difference(base, final)
            verdict = ("lower" if high < 0 else "higher" if low > 0 else
                       "no difference shown")
            row.update(difference=round(difference, 4), interval=[round(low, 4),
                       round(high, 4)], verdict=verdict)
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setting | validation loss (mean ± std) | seeds | against the first (95 % "
             "bootstrap interval) | verdict | program | tokens/s per run |",
             "| --- | ---: | ---: | --- | --- | ---: | ---: |"]
    for row in rows:
        against = ("" if "difference" not in row else
                   f"{row['difference']:+.4f} [{row['interval'][0]:+.4f}, "
                   f"{row['interval'][1]:+.4f}]")
        lines.append(f"| {row['setting']} | {row['val_loss_mean']:.4f} ± "
                     f"{row['val_loss_std']:.4f} | {row['seeds']} | {against} | "
                     f"{row.get('verdict', '(baseline)')} | {row['program']} | "
                     f"{_count(row['run_tokens_per_s'])} |")
    return "\n".join(lines)


def _count(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def _plot(results: list[tuple[dict[str, Any], SeedRuns]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for setting, runs in results:
        mean, std = runs.val_loss.mean(axis=0), runs.val_loss.std(axis=0)
        axis.plot(runs.steps, mean, label=label(setting))
        axis.fill_between(runs.steps, mean - std, mean + std, alpha=0.25)
    axis.set_xlabel("step")
    axis.set_ylabel("validation loss (mean ± std over seeds)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _run_lines(setting: dict[str, Any], runs: SeedRuns) -> list[dict[str, Any]]:
    """Every run's evaluation points; a calibrated run's last line also holds the rate
    multipliers its calibration chose."""
    lines = []
    for i, seed in enumerate(runs.seeds):
        previous = 0
        for k, step in enumerate(runs.steps):
            window = runs.train_loss[i, previous:step]
            lines.append({"setting": label(setting), **setting, "seed": seed, "step": int(step),
                          "val_loss": round(float(runs.val_loss[i, k]), 5),
                          "train_loss": round(float(np.mean(window)), 5)})
            previous = int(step)
        if runs.calibrations:
            lines[-1]["multipliers"] = runs.calibrations[i]["multipliers"]
    return lines


def run_study(config: TrainConfig, seeds: int, vary: dict[str, list[Any]],
              out: str | os.PathLike[str], *, cases: list[dict[str, Any]] | None = None,
              say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the study (module docstring) into the new folder `out`; returns the summary
    rows. `config.seed` is the first seed, the others follow it; `cases` are settings tried
    one by one, each with every combination of `vary`."""
    if seeds < 1:
        raise ValueError(f"--seeds: expected an integer >= 1, got {seeds}.")
    folder = Path(out)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"--out: {str(folder)!r} is not empty; a study writes into a new "
                              "folder (nothing saved is overwritten).")
    grid = settings_grid(vary, cases)
    labels = [label(s) for s in grid]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"--case/--vary: the setting(s) {repeated} come more than once.")
    configs = [config_from_settings(s, config) for s in grid]  # all checked before training
    for c in configs:
        c.validate()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(
        {"settings": config_settings(config), "seeds": seeds, "vary": vary,
         "cases": cases or [], "jax": jax.__version__}, indent=1, default=str))
    results: list[tuple[dict[str, Any], SeedRuns, int] | None] = [None] * len(grid)
    seed_list = range(config.seed, config.seed + seeds)
    with open(folder / "runs.jsonl", "w") as log:
        for program, members in enumerate(program_groups(configs)):
            runs = train_runs([dataclasses.replace(configs[i], seed=s)
                               for i in members for s in seed_list])
            for k, i in enumerate(members):
                mine = runs.select(range(k * seeds, (k + 1) * seeds))
                results[i] = (grid[i], mine, program)
                for line in _run_lines(grid[i], mine):
                    log.write(json.dumps(line) + "\n")
                say(f"{labels[i]}: validation loss "
                    + ", ".join(f"{v:.4f}" for v in mine.val_loss[:, -1])
                    + f" (program {program}: {len(members)} setting(s) x {seeds} seed(s), "
                    f"{runs.wall_s:.1f} s, compile {runs.compile_s:.1f} s)")
            log.flush()
    done = [r for r in results if r is not None]
    rows = summarise([(setting, runs) for setting, runs, _ in done],
                     [program for _, _, program in done])
    (folder / "summary.json").write_text(json.dumps(rows, indent=1))
    table = _table(rows)
    (folder / "table.md").write_text(table + "\n")
    _plot([(setting, runs) for setting, runs, _ in done], folder / "curves.png")
    say(table)
    return rows


def program_groups(configs: list[TrainConfig]) -> list[list[int]]:
    """The indices of `configs` by compiled program: settings that differ only in what lives
    in the state (the rates, `RATE_SETTINGS`) share one; in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(configs):
        key = json.dumps(config_settings(shared_program(c)), sort_keys=True, default=str)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


__all__ = ["bootstrap_difference", "parse_cases", "parse_vary", "program_groups", "run_study",
           "settings_grid", "study_table", "summarise"]
