"""The training loop behind `fusedpc train`, usable from Python as well.

    from fusedpc.training import TrainConfig, train
    result = train(TrainConfig(steps=200), "runs/mine")
    print(result.val_loss, result.sample)

One run trains a hybrid predictive-coding GPT (`fusedpc.build_gpt`) on a text (the bundled
one by default) with `FusedPipeline.run`, `steps_per_call` steps per compiled call, and writes
into its folder:

* `config.toml`: the resolved `TrainConfig` (`config_to_toml`), written first;
* `log.jsonl`: one JSON object a line: `{"kind": "train", "step", "loss", "time",
  "tokens_per_s", "committed"}` for every step, `{"kind": "skip", "step", "reason", "part",
  "message"}` for every step not committed (also printed), `{"kind": "eval", "step", "val_loss",
  "val_perplexity"}` at every evaluation, `{"kind": "report", "step", **row}` for every row of
  `pipeline.report()` every `report_every` steps, and a `{"kind": "summary", ...}` at the end;
  with `calibrate`, `{"kind": "rates", "step", "multipliers"}` when the run starts and after
  the calibration, and `{"kind": "calibration", "step", ...}` with every trial's score
  (`ProbeResult.record()`);
* `checkpoint.fpc`: `pipeline.save(path, metadata)` with the config, the tokeniser, the data
  position, the step and the elapsed time;
* `loss.png`, `update_norm.png`, `update_ratio.png`, with `calibrate`
  `rate_multipliers.png`, and with `learning_kind="iterative"` `energy.png` (see
  `fusedpc.training._plots`).

Resuming (`resume_from=`) reloads the checkpoint and the data position; batch `k` of the run
depends only on `(seed, k)` (see `fusedpc.training.data.BatchIterator`), so a resumed run draws the
batches an uninterrupted one would, whatever `steps_per_call` is, and its losses are the same
at every later step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

from fusedpc.training import _plots, data
from fusedpc.training._config import TrainConfig
from fusedpc.training._config_file import CHECKPOINT_NAME, CONFIG_NAME
from fusedpc.training._infill import infill_score
from fusedpc.training._log import LOG_NAME
from fusedpc.training._progress import format_duration
from fusedpc.training._runtime import StopRequest, join_processes
from fusedpc.training._session import _Session
from fusedpc.training._table import format_rows

SUMMARY_NAME = "summary.json"
SAMPLE_NAME = "sample.txt"


@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the run's folder, final figures and the live pipeline."""

    out: Path
    config: TrainConfig
    step: int
    train_loss: float
    val_loss: float
    val_perplexity: float
    tokens_per_s: float
    elapsed_s: float
    compile_s: float
    skipped_steps: int
    interrupted: bool
    sample: str
    pipeline: Any
    tokenizer: Any
    files: list[Path]
    skips: dict[str, int] = dataclasses.field(default_factory=dict)
    sample_prompt: str = ""
    calibration_s: float = 0.0
    """Seconds of this session's calibration trials (`--calibrate`); 0 without."""
    infill: dict[str, Any] | None = None
    """The end-of-run fill-in (`infill_hide_every`, `training._infill.infill_score`), or None."""

    def marked_sample(self) -> str:
        """The sample with its prompt in brackets: `[prompt]continuation`."""
        if self.sample_prompt and self.sample.startswith(self.sample_prompt):
            return f"[{self.sample_prompt}]{self.sample[len(self.sample_prompt):]}"
        return self.sample

    def summary_rows(self) -> list[tuple[str, str]]:
        """`(label, value)` rows of the end-of-run table."""
        return [
            ("steps", f"{self.step}" + (" (interrupted)" if self.interrupted else "")),
            ("train loss (last 10 steps)", f"{self.train_loss:.4f}"),
            ("validation loss", f"{self.val_loss:.4f}"),
            ("validation perplexity", f"{self.val_perplexity:.2f}"),
            ("tokens/s (after compiling)",
             f"{self.tokens_per_s:,.0f}" if math.isfinite(self.tokens_per_s) else "-"),
            ("time (all sessions)", format_duration(self.elapsed_s)),
            ("first call (compiling)", f"{self.compile_s:.1f} s"),
            *([("calibration trials", format_duration(self.calibration_s))]
              if self.calibration_s else []),
            *([("fill-in / causal readout", f"{self.infill['infill_accuracy']:.3f} / "
                f"{self.infill['causal_accuracy']:.3f} (every {self.infill['hide_every']}th "
                "token hidden)")] if self.infill else []),
            ("skipped steps", _format_skips(self.skipped_steps, self.skips)),
            ("output folder", str(self.out)),
        ]


def _format_skips(total: int, skips: dict[str, int]) -> str:
    """`0`, or `3 (non-finite 1, update ratio 2)`."""
    parts = [f"{reason} {count}" for reason, count in skips.items() if count]
    return f"{total}" + (f" ({', '.join(parts)})" if parts else "")


def format_summary(result: TrainResult) -> str:
    """The end-of-run table of `result.summary_rows()`, framed by rules (`format_rows`)."""
    rows = [{"label": label, "value": value} for label, value in result.summary_rows()]
    return format_rows(rows, [("label",), ("value",)], header=False)


def _in_step(pipeline, step: int) -> bool:
    """Whether the pipeline's state is alive and at `step` (what the log has recorded)."""
    try:
        return pipeline.steps == step
    except RuntimeError:  # the state was donated to a call that never returned
        return False


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (never half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def _finish(session: _Session, interrupted: bool) -> TrainResult:
    """The end of a run: the last evaluation, the checkpoint, the sample, the summary and the
    plots."""
    if interrupted:
        session.say(f"interrupted at step {session.step}: saving the checkpoint and the files")
        session.say(
            f"resume with: fusedpc train --resume {session.out} --steps {session.config.steps}"
        )
    if session.val_step != session.step:
        session.evaluate()
    session.save()
    session.progress.close()
    sample, prompt = "", ""
    if not interrupted and session.config.sample_tokens > 0 and session.processes == 1:
        prompt, sample = session.sample()
    infill = None
    if not interrupted and session.config.infill_hide_every and session.processes == 1:
        infill = infill_score(session.pipeline, session.config, session.tokenizer,
                              session.val_ids, hide_every=session.config.infill_hide_every)
    losses = [r["loss"] for r in session.log.records if r.get("kind") == "train"]
    tail = [x for x in losses[-10:] if math.isfinite(x)]
    result = TrainResult(
        out=session.out,
        config=session.config,
        step=session.step,
        train_loss=float(np.mean(tail)) if tail else float("nan"),
        val_loss=session.val_loss,
        val_perplexity=float(np.exp(session.val_loss)),
        tokens_per_s=(
            session.steady_tokens / session.steady_s if session.steady_s else float("nan")
        ),
        elapsed_s=session.elapsed(),
        compile_s=session.compile_s,
        skipped_steps=session.pipeline.skipped_steps,
        skips=session.pipeline.skip_counts,
        interrupted=interrupted,
        sample=sample,
        pipeline=session.pipeline,
        tokenizer=session.tokenizer,
        files=[],
        sample_prompt=prompt,
        calibration_s=session.calibration_s,
        infill=infill,
    )
    session.log.emit({"kind": "summary", "step": session.step, "train_loss": result.train_loss,
                      "val_loss": result.val_loss, "val_perplexity": result.val_perplexity,
                      "tokens_per_s": result.tokens_per_s, "elapsed_s": result.elapsed_s,
                      "compile_s": result.compile_s, "skipped_steps": result.skipped_steps,
                      "skips": result.skips, "calibration_s": result.calibration_s,
                      "interrupted": interrupted,
                      **({"infill": {k: v for k, v in infill.items() if k != "example"}}
                         if infill else {})})
    session.log.close()
    if session.leader:
        plots = []
        if _plots.plots_available():
            plots = _plots.render_all(session.log.records, session.out)
        else:
            session.say(_plots.PLOTS_MISSING)
        result.files = [session.out / CONFIG_NAME, session.out / LOG_NAME,
                        session.out / CHECKPOINT_NAME, *plots]
        summary = session.log.records[-1]
        _write_atomically(session.out / SUMMARY_NAME, json.dumps(summary, indent=1) + "\n")
        result.files.append(session.out / SUMMARY_NAME)
        if sample:
            _write_atomically(session.out / SAMPLE_NAME, sample)
            result.files.append(session.out / SAMPLE_NAME)
    return result


class RunStartError(RuntimeError):
    """A run whose first step failed inside XLA (an allocation that the memory estimate let
    through, say): what its start wrote is removed, and the message is one line."""


def train(
    config: TrainConfig,
    out: str | os.PathLike | None = None,
    *,
    resume_from: str | os.PathLike | None = None,
    stream: TextIO | None = None,
    interactive: bool | None = None,
    callback: Callable[[int, float], bool | None] | None = None,
    tokenizer: data.Tokenizer | None = None,
    allow_config_change: bool = False,
) -> TrainResult:
    """Train (or continue) a run; see the module docstring for the files it writes.

    The first Ctrl-C (or a `KeyboardInterrupt` raised by `callback`) stops after the current
    call, then saves the checkpoint and writes every file; `TrainResult.interrupted` is then
    True. A second Ctrl-C aborts at once without saving (the last checkpoint stays intact).

    Args:
        config: the run's settings (`resolve_config` / `resume_config` make one).
        out: the output folder (default `runs/<timestamp>`; with `resume_from`, that folder).
        resume_from: a run folder to continue from (its `checkpoint.fpc` and log).
        stream: where the progress line and messages go (default `sys.stderr`).
        interactive: force the in-place progress line on or off (default: `stream.isatty()`).
        callback: called after every compiled call with `(step, last loss)`; returning True
            stops the run as Ctrl-C would (checkpoint and files written).
        tokenizer: a tokeniser of your own (any object with `encode`, `decode`, `vocab_size`
            and `to_dict`: `fusedpc.training.data.Tokenizer`) instead of the one
            `config.tokenizer` names; give it again to resume such a run.
        allow_config_change: on resume, accept settings outside `RESUMABLE` that differ from
            those the checkpoint was trained with (an edited `config.toml`); the change is
            logged (`{"kind": "config_change", ...}`). Without it such a difference is refused.

    The run folder is claimed for the run's life (`fusedpc.training._run_folder`): a second
    run into it is refused, and a new run never writes into a folder holding another run.
    SIGTERM is handled like the first Ctrl-C (stop after the call, save, write the files).

    Returns:
        The `TrainResult`: final figures, the live pipeline and the files written.
    """
    config.validate()
    if config.lr_schedule == "cosine" and config.lr_decay_steps == 0 and resume_from is None:
        # recorded as a number: a resumed run that goes further keeps this schedule
        config = dataclasses.replace(config, lr_decay_steps=config.steps)
    if config.calibrate != "none" and config.calibrate_at == 0 and resume_from is None:
        # recorded as a number too: a resumed run with more steps calibrates where it did
        config = dataclasses.replace(config, calibrate_at=config.calibration_step())
    if config.distributed:
        join_processes()
    session = _Session(
        config, out, resume_from, stream, interactive, tokenizer, allow_config_change
    )
    try:
        return _train_session(session, config, callback)
    except jax.errors.JaxRuntimeError as err:
        if session.step != session.start_step:
            raise  # the run had trained: its last checkpoint is what it leaves
        session.discard_start()
        first = " ".join(str(err).split())[:240]
        raise RunStartError(
            f"the run failed before its first step completed ({first}); if memory is short "
            "(a capped address space, a small machine), lower --batch, --width or --max-len."
        ) from err
    finally:
        session.progress.close()  # never a progress line left redrawing after an error
        session.release()


def _train_session(
    session: _Session,
    config: TrainConfig,
    callback: Callable[[int, float], bool | None] | None,
) -> TrainResult:
    if session.step == 0:
        session.evaluate()  # the untrained model: the first point of the validation curve
    stop = StopRequest(
        lambda: session.say("stopping after this call (Ctrl-C again to abort at once)")
    )
    try:
        with stop:
            while session.step < config.steps and not stop.requested:
                loss = session.call()
                if callback is not None and callback(session.step, loss):
                    stop.requested = True
    except KeyboardInterrupt:
        # Saving needs the pipeline and the log at the same step: an interrupt inside a
        # call (a second Ctrl-C) aborts without saving.
        if stop.aborted or not _in_step(session.pipeline, session.step):
            session.progress.close()
            session.log.close()
            raise
        stop.requested = True
    return _finish(session, interrupted=stop.requested)
