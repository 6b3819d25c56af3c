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
import hashlib
import io
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

from fusedpc.execution._checkpoint import (
    CheckpointError,
    naming_the_file,
    read_checkpoint_manifest,
)
from fusedpc.execution._sharding import make_global_batch
from fusedpc.training import _plots, data
from fusedpc.training._config import (
    RENAMED,
    SETTINGS,
    TrainConfig,
    coerce_settings,
    config_settings,
)
from fusedpc.training._config_file import (
    CHECKPOINT_NAME,
    CONFIG_NAME,
    RESUMABLE,
    config_to_toml,
)
from fusedpc.training._evaluate import batch_losses, evaluate, host_array
from fusedpc.training._log import LOG_NAME, RunLog, read_log
from fusedpc.training._memory import check_run_memory
from fusedpc.training._probe import probe_rates
from fusedpc.training._progress import Progress, format_duration
from fusedpc.training._rates import rate_multipliers, set_rate_multipliers
from fusedpc.training._run_folder import RunFolder, default_out
from fusedpc.training._runtime import StopRequest, device_info, join_processes
from fusedpc.training._setup import (
    build_pipeline,
    call_size,
    config_schedule,
    load_tokens,
    make_mesh,
    parameter_count,
)
from fusedpc.training._table import format_rows
from fusedpc.training._tensorboard import TENSORBOARD_DIR, TensorBoardSink
from fusedpc.transformer._generate import generate


def _in_step(pipeline, step: int) -> bool:
    """Whether the pipeline's state is alive and at `step` (what the log has recorded)."""
    try:
        return pipeline.steps == step
    except RuntimeError:  # the state was donated to a call that never returned
        return False


def _changed_settings(saved: dict[str, Any], config: TrainConfig) -> dict[str, list[Any]]:
    """Settings outside `RESUMABLE` whose value differs from the one a checkpoint was trained
    with: `{name: [trained, now]}`. Settings the checkpoint predates count as their default."""
    with warnings.catch_warnings():  # a 0.1 checkpoint's old names: renamed silently here
        warnings.simplefilter("ignore", DeprecationWarning)
        known = coerce_settings(
            {k: v for k, v in saved.items() if k in SETTINGS or k in RENAMED},
            "the checkpoint's config",
        )
    trained = {**SETTINGS, **known}
    now = config_settings(config)
    return {
        name: [trained[name], now[name]]
        for name in now
        if name not in RESUMABLE and trained[name] != now[name]
    }


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


class _Session:
    """One `train` call: the pipeline, the data streams, the log and the clock."""

    def __init__(
        self,
        config: TrainConfig,
        out: str | os.PathLike | None,
        resume_from: str | os.PathLike | None,
        stream: TextIO | None,
        interactive: bool | None,
        tokenizer: data.Tokenizer | None,
        allow_config_change: bool = False,
    ) -> None:
        self.config = config
        self.leader = jax.process_index() == 0
        self.processes = jax.process_count()
        self.folder: RunFolder | None = None
        created = out is None and resume_from is None
        if created:
            # created exclusively: two runs started in the same second get two folders
            self.out = default_out() if self.leader else Path("runs") / "unused"
        else:
            self.out = Path(out if out is not None else resume_from)  # type: ignore[arg-type]
        here = resume_from is not None and os.path.abspath(self.out) == os.path.abspath(
            resume_from
        )
        self.resumed_here = here
        if self.leader:  # claimed before anything is read or written; held for the run
            self.folder = RunFolder(self.out, resuming=here, created=created)
        # what was there before: a failed start removes only what it wrote (`discard_start`)
        self.found = set() if self.folder is None else {p.name for p in self.out.iterdir()}
        try:
            self._open(config, resume_from, stream, interactive, tokenizer, allow_config_change)
        except BaseException:
            if self.folder is not None:
                self.folder.abandon()  # a run refused at its start leaves no empty folder
                self.folder = None
            raise

    def discard_start(self) -> None:
        """For a run that failed before its first step: remove what its start wrote (its
        config, log, best checkpoint and TensorBoard files, none of which was there before,
        and the folder if the run made it), as for a run refused at its start. A run
        resumed in its own folder keeps everything there."""
        if self.folder is None or self.resumed_here:
            return
        self.log.close()
        for name in {CONFIG_NAME, LOG_NAME, BEST_NAME, TENSORBOARD_DIR} - self.found:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        self.folder.abandon()
        self.folder = None

    def release(self) -> None:
        """Give the run folder up (its lock), at the end of the run or on an error."""
        if self.folder is not None:
            self.folder.release()
            self.folder = None

    def _open(
        self,
        config: TrainConfig,
        resume_from: str | os.PathLike | None,
        stream: TextIO | None,
        interactive: bool | None,
        tokenizer: data.Tokenizer | None,
        allow_config_change: bool,
    ) -> None:
        checkpoint = None if resume_from is None else Path(resume_from) / CHECKPOINT_NAME
        metadata: dict[str, Any] = {}
        changed: dict[str, list[Any]] = {}
        self.torn_log_message: str | None = None
        if checkpoint is not None:
            metadata = read_checkpoint_manifest(checkpoint)["metadata"]
            if not isinstance(metadata, dict) or "tokenizer" not in metadata:
                raise ValueError(f"{str(checkpoint)!r} was not written by fusedpc train.")
            if isinstance(metadata.get("config"), dict):
                changed = _changed_settings(metadata["config"], config)
            if changed and not allow_config_change:
                listed = ", ".join(f"{k} ({v[0]!r} -> {v[1]!r})" for k, v in changed.items())
                raise ValueError(
                    f"--resume: the run's config differs from the one its checkpoint was "
                    f"trained with: {listed}; restore {CONFIG_NAME}, or pass "
                    "--allow-config-change to continue with the change (it is logged)."
                )
        init = None
        if checkpoint is None and config.init_from:
            init = Path(config.init_from) / CHECKPOINT_NAME
            if not init.is_file():
                raise FileNotFoundError(
                    f"--init-from: no checkpoint at {str(init)!r}; give the folder of a run "
                    "that fusedpc train wrote."
                )
            init_manifest = read_checkpoint_manifest(init)
            init_metadata = init_manifest["metadata"]
            if not isinstance(init_metadata, dict) or "tokenizer" not in init_metadata:
                raise ValueError(f"--init-from: {str(init)!r} was not written by fusedpc train.")
            saved_tokenizer = init_metadata["tokenizer"]  # the vocabulary the weights know
        else:
            saved_tokenizer = metadata.get("tokenizer")
        text, self.tokenizer, train_ids, self.val_ids = load_tokens(
            config, saved_tokenizer, tokenizer
        )
        self.text_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if metadata and metadata.get("text_sha256") != self.text_hash:
            raise ValueError(
                f"the text {config.text!r} differs from the one the run was trained on (its "
                "SHA-256 changed); resume with the same text."
            )
        # before anything is built or compiled: a config too large for memory is one line
        self.parameters = parameter_count(config, self.tokenizer.vocab_size)
        self.memory = check_run_memory(config, self.tokenizer.vocab_size, self.parameters)
        self.mesh = make_mesh(config)
        self.pipeline = build_pipeline(config, self.tokenizer.vocab_size, self.mesh)
        # Each process draws its own rows; batch k depends only on (seed, k).
        self.batches = data.BatchIterator(
            train_ids, config.batch, config.model.max_len, seed=config.seed + jax.process_index()
        )
        self.step, self.elapsed_before = 0, 0.0
        best = metadata.get("best_val_loss")
        self.best_val_loss = math.inf if best is None else float(best)
        self.init_step: int | None = None
        if init is not None:
            try:
                self.pipeline.load(init)
            except CheckpointError as err:
                raise ValueError(
                    f"--init-from: {err} (the new run's model and optimiser must match the "
                    "run it starts from; its learning rate, schedule and data may change)"
                ) from None
            self.init_step = int(init_metadata["step"])
            self.pipeline.set_state(self.pipeline.state)  # a new run: counters from 0
        if checkpoint is not None:
            self.pipeline.load(checkpoint)
            self.step = int(metadata["step"])
            self.elapsed_before = float(metadata.get("elapsed_s", 0.0))
            self.batches.load_state_dict({**metadata["data"], "seed": self.batches.seed})
            if self.batches.step != self.step:
                raise ValueError(
                    f"{str(checkpoint)!r}: its data position ({self.batches.step}) and step "
                    f"({self.step}) disagree; the checkpoint was not written by fusedpc train."
                )
            if config.steps <= self.step:
                raise ValueError(
                    f"--steps {config.steps} is not beyond the checkpoint's step {self.step}; "
                    "pass a larger --steps (the total to reach) to continue."
                )
        self.start_step = self.step
        # optimiser updates applied so far (committed steps; with --init-from, also those of
        # the run it starts from, whose optimiser state and count it keeps)
        self.applied = self.pipeline.steps - self.pipeline.skipped_steps
        if init is not None:
            self.applied = int(init_manifest["steps"]) - int(init_manifest["skipped_steps"])
        self.schedule = config_schedule(config)
        # Validation: the same batches at every evaluation, identical on every process.
        val_iter = data.BatchIterator(
            self.val_ids, config.batch * self.processes, config.model.max_len, seed=config.seed
        )
        self.val_x, self.val_y = val_iter.next_batches(config.eval_batches)
        if config.calibrate != "none":
            # the calibration's trials are scored on other windows of the validation split
            probe_iter = data.BatchIterator(
                self.val_ids, config.batch * self.processes, config.model.max_len,
                seed=config.seed + 1,
            )
            self.probe_x, self.probe_y = probe_iter.next_batches(config.eval_batches)
        self.tokens_per_step = config.batch * config.model.max_len * self.processes

        history = []
        if self.leader:
            self.out.mkdir(parents=True, exist_ok=True)
            with naming_the_file(self.out / CONFIG_NAME):
                (self.out / CONFIG_NAME).write_text(config_to_toml(config), encoding="utf-8")
            previous = None if resume_from is None else Path(resume_from) / LOG_NAME
            if previous is not None and previous.exists():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", RuntimeWarning)
                    records = read_log(previous, drop_torn_tail=True)
                history = [r for r in records if int(r.get("step", 0)) <= self.step]
                for warning in caught:
                    self.torn_log_message = str(warning.message)
        sinks: tuple[TensorBoardSink, ...] = ()
        if config.tensorboard and self.leader:
            sinks = (TensorBoardSink(self.out / TENSORBOARD_DIR),)
        self.log = RunLog(self.out / LOG_NAME, history, write=self.leader, sinks=sinks)
        if init is not None:
            self.log.emit({"kind": "init_from", "step": 0, "run": config.init_from,
                           "run_step": self.init_step})
        self.device = {**device_info(), "parameters": self.parameters}
        self.log.emit({"kind": "run", "step": self.step, **self.device})
        self.calibration_step = (
            None if config.calibrate == "none" else config.calibration_step()
        )
        if self.calibration_step is not None:
            self.log.emit({"kind": "rates", "step": self.step,
                           "multipliers": rate_multipliers(self.pipeline.state)})
        if changed:
            self.log.emit({"kind": "config_change", "step": self.step, "changed": changed})
        self.progress = Progress(
            config.steps, self.step, stream=stream if self.leader else io.StringIO(),
            interactive=interactive,
        )
        self.began = time.perf_counter()
        self.compile_s, self.steady_s, self.steady_tokens = 0.0, 0.0, 0
        self.calibration_s = 0.0
        self.val_loss, self.val_step = float("nan"), -1
        model = config.model
        self.say(
            f"fusedpc train: {model.n_blocks} blocks, width {model.width}, {model.n_heads} "
            f"heads, vocabulary {self.tokenizer.vocab_size}, learning {model.learn!r}, "
            f"{config.optimiser} lr {config.lr:g}; {len(train_ids):,} training tokens -> "
            f"{self.out}"
        )
        d = self.device
        self.say(
            f"running on {d['devices']} {d['platform']} device(s) ({d['device_kind']}) in "
            f"{d['processes']} process(es); jax {d['jax']}, jaxlib {d['jaxlib']}; "
            f"{d['parameters']:,} parameters"
        )
        if resume_from is not None:
            self.say(f"resuming from step {self.step} of {resume_from}")
        if self.torn_log_message is not None:
            self.say(f"warning: {self.torn_log_message}")
        for name, (trained, now) in changed.items():
            self.say(f"config change (--allow-config-change): {name} {trained!r} -> {now!r}")
        if self.calibration_step is not None and self.calibration_step >= config.steps:
            self.say(
                f"note: the calibration is at step {self.calibration_step}, not before this "
                f"run's end (--steps {config.steps}): it happens when the run is resumed "
                "with more steps"
            )

    def _rate(self, count: int) -> float:
        """The base learning rate at optimiser count `count` (slot scales multiply it)."""
        if callable(self.schedule):
            return float(self.schedule(count))
        return float(self.schedule)

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.began

    def say(self, text: str) -> None:
        if self.leader:
            self.progress.message(text)

    def evaluate(self) -> None:
        probabilities = self.config.model.head_kind == "categorical"
        loss = evaluate(self.pipeline, self.val_x, self.val_y, probabilities)
        self.val_loss, self.val_step = loss, self.step
        perplexity = float(np.exp(loss))
        self.log.emit({"kind": "eval", "step": self.step, "val_loss": loss,
                       "val_perplexity": perplexity})
        self.say(f"step {self.step}: validation loss {loss:.4f}, perplexity {perplexity:.2f}")
        if loss < self.best_val_loss:  # the best checkpoint so far, next to the last one
            self.best_val_loss = loss
            if self.leader:
                self.pipeline.save(self.out / BEST_NAME, self.metadata())
            self.log.emit({"kind": "best", "step": self.step, "val_loss": loss})

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint of this run records besides the state."""
        return {
            "config": config_settings(self.config),
            "tokenizer": self.tokenizer.to_dict(),
            "data": self.batches.state_dict(),
            "step": self.step,
            "elapsed_s": self.elapsed(),
            "text_sha256": self.text_hash,
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
        }

    def save(self) -> None:
        if self.leader:
            self.pipeline.save(self.out / CHECKPOINT_NAME, self.metadata())
        self.log.flush()

    def call(self) -> float:
        """One compiled call of `run` (up to the next multiple of `steps_per_call`) and its
        records; returns the last step's loss."""
        config = self.config
        k = call_size(self.step, config.steps, config.steps_per_call)
        if self.calibration_step is not None:
            if self.step == self.calibration_step:
                self.calibrate()
            elif self.step < self.calibration_step:  # a call ends where it happens
                k = min(k, self.calibration_step - self.step)
        xs: np.ndarray | jax.Array
        ys: np.ndarray | jax.Array
        xs, ys = self.batches.next_batches(k)
        if self.processes > 1:
            xs, ys = make_global_batch(xs, self.mesh, 1), make_global_batch(ys, self.mesh, 1)
        # the parts' report norms only on the steps that log a report (and the call's last)
        report_at = (self.step + 1 + np.arange(k)) % config.report_every == 0
        t0 = time.perf_counter()
        _, _, metrics = self.pipeline.run(xs, ys, keep_outputs=False, report_at=report_at)
        losses, committed = host_array(metrics.loss), host_array(metrics.committed)
        dt = time.perf_counter() - t0
        if self.step == self.start_step:
            self.compile_s = dt
        else:
            self.steady_s += dt
            self.steady_tokens += k * self.tokens_per_step
        now = self.elapsed()
        for i in range(k):
            step = self.step + i + 1
            # the rate this step used: the schedule at the optimisers' own count, which
            # advances with committed steps only
            lr = self._rate(self.applied)
            self.applied += int(bool(committed[i]))
            self.log.emit({"kind": "train", "step": step, "loss": float(losses[i]),
                           "time": now - dt * (k - 1 - i) / k,
                           "tokens_per_s": k * self.tokens_per_step / dt,
                           "committed": bool(committed[i]), "lr": lr})
            if not committed[i]:
                skip = self.pipeline.skip_reason(index=i)
                if skip is not None:
                    self.log.emit({"kind": "skip", "step": step, "reason": skip.reason,
                                   "part": skip.part, "message": skip.message})
                    self.say(f"step {step} not committed ({skip.reason}): {skip.message}")
            if step % config.report_every == 0:
                for row in self.pipeline.report(index=i):
                    self.log.emit({"kind": "report", "step": step, **row})
        self.step += k
        self.progress.update(self.step, float(losses[-1]), k * self.tokens_per_step)
        if _crossed(config.eval_every, self.step - k, self.step):
            self.evaluate()
        if _crossed(config.save_every, self.step - k, self.step):
            self.save()
        return float(losses[-1])

    def calibrate(self) -> None:
        """Probe every calibrated slot's rate on the next `probe_steps` batches (which the
        run then trains on as usual: the data position does not move) and apply the
        choice; logged as a `calibration` and a `rates` record."""
        config = self.config
        t0 = time.perf_counter()
        position = self.batches.step
        xs: np.ndarray | jax.Array
        ys: np.ndarray | jax.Array
        xs, ys = self.batches.next_batches(config.probe_steps)
        self.batches.step = position
        if self.processes > 1:
            xs, ys = make_global_batch(xs, self.mesh, 1), make_global_batch(ys, self.mesh, 1)
        self.say(
            f"step {self.step}: calibrating the rates of {', '.join(config.calibrated_slots())} "
            f"by trial runs of {config.probe_steps} steps"
        )
        probabilities = config.model.head_kind == "categorical"
        result = probe_rates(
            self.pipeline, xs, ys, groups=config.calibrated_slots(),
            per_call=config.steps_per_call,
            score=lambda p: batch_losses(p, self.probe_x, self.probe_y, probabilities),
        )
        self.pipeline.set_state(
            set_rate_multipliers(self.pipeline.state, result.multipliers),
            counters=self.pipeline.counters,
        )
        wall = time.perf_counter() - t0
        self.calibration_s += wall
        self.log.emit({"kind": "calibration", "step": self.step, **result.record(),
                       "wall_s": wall})
        self.log.emit({"kind": "rates", "step": self.step,
                       "multipliers": rate_multipliers(self.pipeline.state)})
        if result.changed:
            changed = ", ".join(f"{g} x{f:g}" for g, f in result.changed.items())
            self.say(
                f"calibrated in {format_duration(wall)} ({result.steps} trial steps): {changed}"
                f"; trial loss {result.baseline:.4f} -> {result.score:.4f}"
            )
        else:
            self.say(
                f"calibrated in {format_duration(wall)} ({result.steps} trial steps): no "
                f"change lowered the trial loss ({result.baseline:.4f}); the rates stay"
            )

    def sample(self) -> tuple[str, str]:
        """`(prompt, whole text)`: the start of the validation text and its continuation."""
        prompt = self.val_ids[: max(1, min(16, self.config.model.max_len // 2))]
        key = jax.random.fold_in(jax.random.key(self.config.seed), self.step)
        ids = generate(self.pipeline, prompt[None], self.config.sample_tokens,
                       self.config.temperature, key)
        return self.tokenizer.decode(prompt), self.tokenizer.decode(np.asarray(ids)[0])

    def finish(self, interrupted: bool) -> TrainResult:
        """The last evaluation, the checkpoint, the sample, the summary and the plots."""
        if interrupted:
            self.say(f"interrupted at step {self.step}: saving the checkpoint and the files")
            self.say(
                f"resume with: fusedpc train --resume {self.out} --steps {self.config.steps}"
            )
        if self.val_step != self.step:
            self.evaluate()
        self.save()
        self.progress.close()
        sample, prompt = "", ""
        if not interrupted and self.config.sample_tokens > 0 and self.processes == 1:
            prompt, sample = self.sample()
        losses = [r["loss"] for r in self.log.records if r.get("kind") == "train"]
        tail = [x for x in losses[-10:] if math.isfinite(x)]
        result = TrainResult(
            out=self.out,
            config=self.config,
            step=self.step,
            train_loss=float(np.mean(tail)) if tail else float("nan"),
            val_loss=self.val_loss,
            val_perplexity=float(np.exp(self.val_loss)),
            tokens_per_s=self.steady_tokens / self.steady_s if self.steady_s else float("nan"),
            elapsed_s=self.elapsed(),
            compile_s=self.compile_s,
            skipped_steps=self.pipeline.skipped_steps,
            skips=self.pipeline.skip_counts,
            interrupted=interrupted,
            sample=sample,
            pipeline=self.pipeline,
            tokenizer=self.tokenizer,
            files=[],
            sample_prompt=prompt,
            calibration_s=self.calibration_s,
        )
        self.log.emit({"kind": "summary", "step": self.step, "train_loss": result.train_loss,
                       "val_loss": result.val_loss, "val_perplexity": result.val_perplexity,
                       "tokens_per_s": result.tokens_per_s, "elapsed_s": result.elapsed_s,
                       "compile_s": result.compile_s, "skipped_steps": result.skipped_steps,
                       "skips": result.skips, "calibration_s": result.calibration_s,
                       "interrupted": interrupted})
        self.log.close()
        if self.leader:
            plots = []
            if _plots.plots_available():
                plots = _plots.render_all(self.log.records, self.out)
            else:
                self.say(_plots.PLOTS_MISSING)
            result.files = [self.out / CONFIG_NAME, self.out / LOG_NAME,
                            self.out / CHECKPOINT_NAME, *plots]
            summary = self.log.records[-1]
            _write_atomically(self.out / SUMMARY_NAME, json.dumps(summary, indent=1) + "\n")
            result.files.append(self.out / SUMMARY_NAME)
            if sample:
                _write_atomically(self.out / SAMPLE_NAME, sample)
                result.files.append(self.out / SAMPLE_NAME)
        return result


BEST_NAME = "best.fpc"
SUMMARY_NAME = "summary.json"
SAMPLE_NAME = "sample.txt"


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename (never half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def _crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of `every` (> 0) lies in `(before, after]`."""
    return every > 0 and after // every > before // every


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
    return session.finish(interrupted=stop.requested)
