"""One `train` call's session (`_Session`): the run folder it holds, the pipeline, the data
streams, the log and the clock, from the run's start to its last compiled call.

`fusedpc.training._loop.train` drives it; see that module for the files a run writes.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

from fusedpc.execution._checkpoint import CheckpointError, naming_the_file
from fusedpc.execution._sharding import make_global_batch
from fusedpc.training import data
from fusedpc.training._config import TrainConfig
from fusedpc.training._config_file import CHECKPOINT_NAME, CONFIG_NAME, config_to_toml
from fusedpc.training._evaluate import batch_losses, evaluate, host_array
from fusedpc.training._log import LOG_NAME, RunLog, read_log
from fusedpc.training._memory import check_run_memory
from fusedpc.training._probe import probe_rates
from fusedpc.training._progress import Progress, format_duration
from fusedpc.training._rates import rate_multipliers, set_rate_multipliers
from fusedpc.training._run_folder import RunFolder, default_out
from fusedpc.training._runtime import device_info
from fusedpc.training._settings import config_settings
from fusedpc.training._setup import (
    build_pipeline,
    call_size,
    config_schedule,
    load_tokens,
    make_mesh,
    parameter_count,
)
from fusedpc.training._start_point import StartPoint, read_start_point
from fusedpc.training._tensorboard import TENSORBOARD_DIR, TensorBoardSink
from fusedpc.transformer._generate import generate

BEST_NAME = "best.fpc"


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
        start = read_start_point(config, resume_from, allow_config_change)
        train_ids = self._load_text(config, start, tokenizer)
        self._build(config, train_ids)
        self._restore(config, start)
        self._held_out_batches(config)
        self._open_log(config, start, resume_from)
        self.progress = Progress(
            config.steps, self.step, stream=stream if self.leader else io.StringIO(),
            interactive=interactive,
        )
        self.began = time.perf_counter()
        self.compile_s, self.steady_s, self.steady_tokens = 0.0, 0.0, 0
        self.calibration_s = 0.0
        self.val_loss, self.val_step = float("nan"), -1
        self._announce(config, resume_from, len(train_ids), start.changed)

    def _load_text(
        self, config: TrainConfig, start: StartPoint, tokenizer: data.Tokenizer | None
    ) -> np.ndarray:
        """The tokeniser and the validation ids; returns the training ids."""
        text, self.tokenizer, train_ids, self.val_ids = load_tokens(
            config, start.saved_tokenizer, tokenizer
        )
        self.text_hash = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if start.metadata and start.metadata.get("text_sha256") != self.text_hash:
            what = f"the corpus {config.data!r}" if config.data else f"the text {config.text!r}"
            raise ValueError(
                f"{what} differs from the one the run was trained on (its SHA-256 changed); "
                "resume with the same data."
            )
        return train_ids

    def _build(self, config: TrainConfig, train_ids: np.ndarray) -> None:
        """The memory check, the mesh, the pipeline and the training batches."""
        # before anything is built or compiled: a config too large for memory is one line
        self.parameters = parameter_count(config, self.tokenizer.vocab_size)
        self.memory = check_run_memory(config, self.tokenizer.vocab_size, self.parameters)
        self.mesh = make_mesh(config)
        self.pipeline = build_pipeline(config, self.tokenizer.vocab_size, self.mesh)
        # Each process draws its own rows; batch k depends only on (seed, k).
        self.batches = data.BatchIterator(
            train_ids, config.batch, config.model.max_len, seed=config.seed + jax.process_index()
        )

    def _restore(self, config: TrainConfig, start: StartPoint) -> None:
        """The state, the step, the clock and the data position of the run's start."""
        self.step, self.elapsed_before = 0, 0.0
        best = start.metadata.get("best_val_loss")
        self.best_val_loss = math.inf if best is None else float(best)
        self.init_step: int | None = None
        if start.init is not None:
            self._load_init(start.init, start.init_manifest)
        if start.checkpoint is not None:
            self._load_resumed(config, start.checkpoint, start.metadata)
        self.start_step = self.step
        # optimiser updates applied so far (committed steps; with --init-from, also those of
        # the run it starts from, whose optimiser state and count it keeps)
        self.applied = self.pipeline.steps - self.pipeline.skipped_steps
        if start.init is not None:
            manifest = start.init_manifest
            self.applied = int(manifest["steps"]) - int(manifest["skipped_steps"])
        self.schedule = config_schedule(config)

    def _load_init(self, init: Path, manifest: dict[str, Any]) -> None:
        try:
            self.pipeline.load(init)
        except CheckpointError as err:
            raise ValueError(
                f"--init-from: {err} (the new run's model and optimiser must match the "
                "run it starts from; its learning rate, schedule and data may change)"
            ) from None
        self.init_step = int(manifest["metadata"]["step"])
        self.pipeline.set_state(self.pipeline.state)  # a new run: counters from 0

    def _load_resumed(
        self, config: TrainConfig, checkpoint: Path, metadata: dict[str, Any]
    ) -> None:
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

    def _held_out_batches(self, config: TrainConfig) -> None:
        """The validation batches and, with a calibration, the batches its trials are scored
        on."""
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

    def _open_log(
        self, config: TrainConfig, start: StartPoint, resume_from: str | os.PathLike | None
    ) -> None:
        """`config.toml` written, the log opened (with the records of the run it resumes)
        and the run's first records."""
        history = self._write_config_and_read_history(config, resume_from)
        sinks: tuple[TensorBoardSink, ...] = ()
        if config.tensorboard and self.leader:
            sinks = (TensorBoardSink(self.out / TENSORBOARD_DIR),)
        self.log = RunLog(self.out / LOG_NAME, history, write=self.leader, sinks=sinks)
        if start.init is not None:
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
        if start.changed:
            self.log.emit({"kind": "config_change", "step": self.step,
                           "changed": start.changed})

    def _write_config_and_read_history(
        self, config: TrainConfig, resume_from: str | os.PathLike | None
    ) -> list[dict[str, Any]]:
        """On the leader: `config.toml` written and the records of the log it resumes, up to
        its step (a torn last line dropped, `torn_log_message` saying so)."""
        self.torn_log_message: str | None = None
        history: list[dict[str, Any]] = []
        if not self.leader:
            return history
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
        return history

    def _announce(
        self,
        config: TrainConfig,
        resume_from: str | os.PathLike | None,
        train_tokens: int,
        changed: dict[str, list[Any]],
    ) -> None:
        """The run's opening lines: the model, the devices, the resume and the notes."""
        model = config.model
        self.say(
            f"fusedpc train: {model.n_blocks} blocks, width {model.width}, {model.n_heads} "
            f"heads, vocabulary {self.tokenizer.vocab_size}, learning {model.learn!r}, "
            f"{config.optimiser} lr {config.lr:g}; {train_tokens:,} training tokens -> "
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


def _crossed(every: int, before: int, after: int) -> bool:
    """Whether a multiple of `every` (> 0) lies in `(before, after]`."""
    return every > 0 and after // every > before // every
