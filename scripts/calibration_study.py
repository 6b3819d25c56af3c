"""The calibration study of docs/calibration.md, as one `fusedpc study`: per cell (text,
learning kind, learn preset, optimiser) the run without a calibration and the run with
`--calibrate auto`, 3 seeds each (`configs/calibration_study.toml` holds the cells), and the
evidence `fusedpc report` suggests from (the package's `calibration_evidence.json`).

    python scripts/calibration_study.py --out studies/calibration            # ~25 minutes
    python scripts/calibration_study.py --out studies/calibration --evidence \\
        src/fusedpc/training/calibration_evidence.json
    python scripts/calibration_study.py --quick --out /tmp/calibration      # a sample: < 2 min
    python scripts/calibration_study.py --evidence-from studies/calibration OUT.json

The study is `fusedpc study --config configs/calibration_study.toml --out DIR`; this script
runs it (or reads a finished one, `--evidence-from`) and turns its `runs.jsonl` into the
evidence: per cell and method (`none`, `probe` = `--calibrate auto`) the validation loss at the
budget over the seeds, the gaps to the uncalibrated run and to the backprop twin, and per
method the targets of docs/calibration.md. The twin's cells are the exact step's runs
(`precision_weighted`, learn `all`, no calibration), which is the backprop step to float32
rounding (its parity tests); the study trains no separate twin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fusedpc.training import _config_file
from fusedpc.training.study import run_study, study_table

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calibration_study.toml"
METHOD = {"none": "none", "auto": "probe", "probe": "probe"}
"""The study's `calibrate` values as the evidence's methods (`auto` is the `probe` method)."""


def text_name(text: str) -> str:
    """A bundled text's name, or a file's name: `/usr/share/common-licenses/GPL-3` ->
    `GPL-3`."""
    return os.path.basename(text) if os.sep in text else text


def final_runs(folder: Path) -> list[dict[str, Any]]:
    """One line per run of the study in `folder`: its cell, method, seed and the validation
    loss at its last evaluation."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    with open(folder / "runs.jsonl", encoding="utf-8") as handle:
        for line in map(json.loads, filter(str.strip, handle)):
            key = (line["setting"], line["seed"])
            if key not in last or line["step"] > last[key]["step"]:
                last[key] = line
    runs = []
    for line in last.values():
        kind, learn = line["learning_kind"], line["learn"]
        own_rule = kind == "synaptic_uncertainty" and learn == "ff_head"  # no optax slot
        runs.append({"text": text_name(line["text"]), "learning_kind": kind, "learn": learn,
                     "optimiser": "own_rule" if own_rule else line["optimiser"],
                     "method": METHOD[line["calibrate"]], "seed": line["seed"],
                     "val_loss": line["val_loss"]})
        if kind == "precision_weighted" and learn == "all" and line["calibrate"] == "none":
            runs.append({**runs[-1], "learning_kind": "backprop", "method": "backprop_twin"})
    return runs


def summarise(runs: list[dict]) -> list[dict]:
    """One line per cell and method: mean, standard deviation and range over seeds, and the
    gaps (mean minus mean) to the cell's uncalibrated run and to the backprop twin of the
    same text, preset and optimiser."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        key = (r["text"], r["learning_kind"], r["learn"], r["optimiser"], r["method"])
        groups.setdefault(key, []).append(r)
    means = {k: float(np.mean([r["val_loss"] for r in g])) for k, g in groups.items()}
    lines = []
    for key, group in groups.items():
        text, kind, learn, opt, method = key
        values = np.asarray([r["val_loss"] for r in group])
        base = means.get((text, kind, learn, opt, "none"))
        twin = means.get((text, "backprop", "all", opt, "backprop_twin"))
        comparable = learn == "all" and method != "backprop_twin"
        lines.append({
            "kind": "summary", "text": text, "learning_kind": kind, "learn": learn,
            "optimiser": opt, "method": method, "seeds": len(group),
            "val_loss_mean": float(values.mean()),
            "val_loss_std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "val_loss_min": float(values.min()), "val_loss_max": float(values.max()),
            "gap_to_none": None if base is None or method == "backprop_twin"
            else float(values.mean() - base),
            "gap_to_twin": float(values.mean() - twin) if comparable and twin is not None
            else None,
        })
    return lines


def targets(summary: list[dict]) -> list[dict]:
    """Per method, the targets read off the summary. The *spread* of a comparison is the
    larger of the two seed standard deviations.

    * `worse_cells`: cells where the method's mean is above `none`'s by more than the spread
      (the target: none);
    * `behind_twin`: cells (preset `all`) where `none` is above the twin by more than the
      spread, and `helped`: those of them where the method is below `none` by more than the
      spread (the target: at least half);
    * `gap_closed`: per `standard` and `synaptic_uncertainty` cell of preset `all`, the share
      of `none`'s gap to the twin that the method closes, $(\\bar l_{none} - \\bar l_m) /
      (\\bar l_{none} - \\bar l_{twin})$ (the target: >= 0.5), where there is a gap."""
    by_key = {(s["text"], s["learning_kind"], s["learn"], s["optimiser"], s["method"]): s
              for s in summary}
    methods = sorted({s["method"] for s in summary} - {"none", "backprop_twin"})
    lines = []
    for method in methods:
        worse, behind, helped, closed = [], [], [], {}
        for (text, kind, learn, opt, m), s in by_key.items():
            if m != method:
                continue
            none = by_key.get((text, kind, learn, opt, "none"))
            if none is None:
                continue
            cell = f"{text}/{kind}/{learn}/{opt}"
            spread = max(s["val_loss_std"], none["val_loss_std"])
            if s["val_loss_mean"] > none["val_loss_mean"] + spread:
                worse.append(cell)
            twin = by_key.get((text, "backprop", "all", opt, "backprop_twin"))
            if learn != "all" or twin is None:
                continue
            gap = none["val_loss_mean"] - twin["val_loss_mean"]
            if gap > max(none["val_loss_std"], twin["val_loss_std"]):
                behind.append(cell)
                if s["val_loss_mean"] < none["val_loss_mean"] - spread:
                    helped.append(cell)
            if kind in ("standard", "synaptic_uncertainty") and gap > 0:
                closed[cell] = (none["val_loss_mean"] - s["val_loss_mean"]) / gap
        lines.append({"kind": "targets", "method": method, "worse_cells": worse,
                      "behind_twin": behind, "helped": helped, "gap_closed": closed})
    return lines


def study_settings(folder: Path) -> dict[str, Any]:
    """The evidence's `study` record from the study's `config.json`."""
    config = json.loads((folder / "config.json").read_text("utf-8"))
    base, cases = config["settings"], config["cases"]
    texts = list(dict.fromkeys(text_name(c.get("text", base["text"])) for c in cases))
    lr = {c.get("optimiser", base["optimiser"]): c.get("lr", base["lr"]) for c in cases}
    return {"steps": base["steps"], "warmup": base["calibrate_at"],
            "probe_steps": base["probe_steps"],
            "seeds": list(range(base["seed"], base["seed"] + config["seeds"])),
            "texts": texts, "lr": dict(sorted(lr.items())), "width": base["width"],
            "n_heads": base["n_heads"], "n_blocks": base["n_blocks"],
            "seq_len": base["max_len"], "batch": base["batch"], "jax": config["jax"]}


def evidence_from(folder: Path) -> dict[str, Any]:
    """The evidence file's contents from the finished study in `folder`."""
    summary = summarise(final_runs(folder))
    return {"study": study_settings(folder),
            "cells": [{k: v for k, v in s.items() if k != "kind"} for s in summary],
            "targets": targets(summary)}


def markdown_table(evidence: dict[str, Any]) -> str:
    """docs/calibration.md's table: per cell `none`, `probe`, the gain and the twin, **bold**
    where `probe` is lower than `none` by more than the spread (the larger seed standard
    deviation), "(worse)" where higher by more than it."""
    cells = {(c["text"], c["learning_kind"], c["learn"], c["optimiser"], c["method"]): c
             for c in evidence["cells"]}
    lines = ["| text | kind | learn | optimiser | `none` | `probe` (`--calibrate auto`) | gain "
             "| backprop twin |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (text, kind, learn, optimiser, method), none in cells.items():
        probe = cells.get((text, kind, learn, optimiser, "probe"))
        if method != "none" or probe is None:
            continue
        spread = max(none["val_loss_std"], probe["val_loss_std"])
        shown = f"{probe['val_loss_mean']:.3f} ± {probe['val_loss_std']:.3f}"
        if probe["val_loss_mean"] < none["val_loss_mean"] - spread:
            shown = f"**{shown}**"
        elif probe["val_loss_mean"] > none["val_loss_mean"] + spread:
            shown += " (worse)"
        twin = cells.get((text, "backprop", "all", optimiser, "backprop_twin"))
        lines.append(
            f"| {text} | {kind} | {learn} | {optimiser} | {none['val_loss_mean']:.3f} ± "
            f"{none['val_loss_std']:.3f} | {shown} | "
            f"{none['val_loss_mean'] - probe['val_loss_mean']:+.3f} | "
            f"{twin['val_loss_mean']:.3f} |" if learn == "all" and twin else
            f"| {text} | {kind} | {learn} | {optimiser} | {none['val_loss_mean']:.3f} ± "
            f"{none['val_loss_std']:.3f} | {shown} | "
            f"{none['val_loss_mean'] - probe['val_loss_mean']:+.3f} | – |")
    return "\n".join(lines)


def write_evidence(folder: Path, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(evidence_from(folder), handle, indent=1)
        handle.write("\n")


def plot(summary: list[dict], path: Path) -> None:
    """Validation loss per cell and method, bars at the seed mean with the seed range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = list(dict.fromkeys(s["text"] for s in summary))
    methods = ["none", "probe", "backprop_twin"]
    figure, axes = plt.subplots(len(texts), 1, figsize=(12, 4.5 * len(texts)), squeeze=False)
    for axis, text in zip(axes[:, 0], texts, strict=True):
        rows = [s for s in summary if s["text"] == text]
        cells = sorted({(s["learning_kind"], s["learn"], s["optimiser"]) for s in rows},
                       key=lambda c: (c[0] == "backprop", c))
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            found = {(s["learning_kind"], s["learn"], s["optimiser"]): s for s in rows
                     if s["method"] == method}
            at = [i for i, c in enumerate(cells) if c in found]
            if not at:
                continue
            means = [found[cells[i]]["val_loss_mean"] for i in at]
            error = [[found[cells[i]]["val_loss_mean"] - found[cells[i]]["val_loss_min"]
                      for i in at],
                     [found[cells[i]]["val_loss_max"] - found[cells[i]]["val_loss_mean"]
                      for i in at]]
            axis.bar([i + (j - 1) * width for i in at], means, width, yerr=error, capsize=2,
                     color=f"C{j}", label=method)
        axis.set_xticks(range(len(cells)))
        axis.set_xticklabels(["\n".join(c) for c in cells], fontsize=7)
        axis.set_ylabel("validation loss at the budget")
        axis.set_title(f"{text}: mean over seeds, bars to the seed range")
        values = [v for s in rows for v in (s["val_loss_min"], s["val_loss_max"])
                  if math.isfinite(v)]
        if values:
            axis.set_ylim(min(values) - 0.1, max(values) + 0.1)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(out: Path, quick: bool) -> None:
    """`fusedpc study --config configs/calibration_study.toml --out OUT`; `quick`: the
    bundled text's `precision_weighted` / `all` cells only, 2 seeds, 300 steps."""
    seeds, vary, cases = study_table(CONFIG)
    config = _config_file.resolve_config(CONFIG, other_sections=("study",))
    if quick:
        import dataclasses

        cases = [c for c in cases if c["text"] == "hamlet" and c["learn"] == "all"
                 and c["learning_kind"] == "precision_weighted"]
        config = dataclasses.replace(config, steps=300, calibrate_at=60, probe_steps=20,
                                     eval_every=100)
        seeds = 2
    run_study(config, seeds or 3, vary, out, cases=cases,
              say=lambda text: print(text, file=sys.stderr, flush=True))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--evidence-from"]:  # a finished study's folder, nothing run
        if len(argv) != 3:
            raise SystemExit("usage: calibration_study.py --evidence-from STUDY_DIR OUT.json")
        write_evidence(Path(argv[1]), argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a new folder for the study")
    parser.add_argument("--quick", action="store_true", help="a sample of the study")
    parser.add_argument("--evidence", default=None, metavar="PATH",
                        help="also write the evidence here (besides OUT/calibration_evidence"
                        ".json)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    run(out, args.quick)
    for path in filter(None, (out / "calibration_evidence.json", args.evidence)):
        write_evidence(out, path)
    summary = summarise(final_runs(out))
    plot(summary, out / "calibration.png")
    for line in (*summary, *targets(summary)):
        print(json.dumps(line))
    print(markdown_table(evidence_from(out)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
