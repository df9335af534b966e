"""The training loop: token-budget updates with gradient accumulation, validation, checkpoints.

One *update* (one optimizer step, one schedule step) sees about ``train.update_tokens`` target
tokens summed over every device and accumulation step (§5.1). Before each micro-batch the
ranks agree (one all-reduce of a scalar) on the global number of target tokens gathered so
far, so every rank runs the same number of micro-batches and the last one is the only one
whose backward synchronises gradients. The gradient is that of the summed loss divided by the
global number of target tokens, whatever the device count.

The loop knows nothing of files of text: it reads index batches from a *sampler* and tensors
from a *corpus* (see the protocols below), so tests drive it with in-memory data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from aiayn.accel import Acceleration, accelerate, cpu_has_bfloat16
from aiayn.config import ModelConfig, RunConfig, config_from_dict, model_changes
from aiayn.data.collate import Batch, LabelBatch, TokenBatch
from aiayn.errors import ConfigError, ResumeMismatch, UserError
from aiayn.inference import loading
from aiayn.model.transformer import set_activation_checkpointing
from aiayn.progress import counted
from aiayn.training import checkpoint as ckpt
from aiayn.training.distributed import (
    DistInfo,
    all_gather_objects,
    all_reduce_sum,
    barrier,
    reduce_device,
)
from aiayn.training.metrics import MetricsLog, Progress, perplexity
from aiayn.training.optim import (
    LinearTimeLR,
    build_optimizer,
    build_schedule,
    describe_schedule,
    schedule_progress,
)
from aiayn.training.tasks import TextValidSet, batch_loss, evaluate_text
from aiayn.training.validation import Indices, ValidSet, autocast, evaluate


class TokenizerMismatch(ResumeMismatch):
    """A checkpoint trained with another tokenizer than the data's
    (:meth:`Trainer.load_state_dict`)."""


class TrainingError(UserError):
    """Training cannot go on (e.g. the loss stayed non-finite for ``max_bad_steps`` updates)."""


class ExampleSource(Protocol):
    """What training needs of a split: padded batches by index (sentence pairs for
    translation, :class:`TokenBatch` or :class:`LabelBatch` for the other tasks)."""

    def batch(self, indices: Indices) -> Batch | TokenBatch | LabelBatch: ...


class BatchSampler(Protocol):
    """Index batches of one rank's shard; iteration resumes from the position in its state."""

    def set_epoch(self, epoch: int) -> None: ...

    def __iter__(self) -> Iterator[Indices]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainResult:
    """How a call of :meth:`Trainer.train` ended."""

    step: int
    epoch: int
    reason: str
    interrupted: bool = False
    # The SIGINT or SIGTERM received while the run trained or finished (its last validation,
    # save and average), whether or not it interrupted the updates; None: none.
    signal: int | None = None
    checkpoint: Path | None = None
    averaged: Path | None = None
    best_value: float | None = None
    best_step: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    rank: int = 0


def resolve_precision(config: RunConfig, device: torch.device, announce: bool = True) -> RunConfig:
    """``config`` with ``train.precision = "auto"`` replaced by what ``device`` runs fastest:
    bf16 on a CPU with bfloat16 instructions (AVX512-BF16 or AMX) or a GPU that supports it,
    else fp32; said on stderr when ``announce``. Other precisions are returned unchanged."""
    if config.train.precision != "auto":
        return config
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
        reason = "this GPU supports bfloat16" if native else "this GPU lacks bfloat16"
    elif device.type == "cpu":
        native = cpu_has_bfloat16()
        has = "multiplies bfloat16 natively" if native else "has no bfloat16 instructions"
        reason = f"this CPU {has}: AVX512-BF16 or AMX"
    else:
        native, reason = False, f"bfloat16 speed on {device.type} is not known"
    chosen: Literal["bf16", "fp32"] = "bf16" if native else "fp32"
    if announce:
        print(f"train.precision=auto: {chosen} ({reason})", file=sys.stderr)
    return replace(config, train=replace(config.train, precision=chosen))


def _compared(model: ModelConfig) -> ModelConfig:
    """``model`` as a resume compares it: ``n_classes`` only where the task is classify
    (a run of another task once took it from labelled data, and ignores it)."""
    if model.task == "classify":
        return model
    return dataclasses.replace(model, n_classes=ModelConfig.n_classes)


class Trainer:
    """Trains ``model`` on batches of ``corpus`` drawn by ``sampler`` into ``run_dir``.

    Every rank builds its own Trainer (same config, its own sampler shard). ``tokenizer_bytes``
    (the sentencepiece model) is stored in every checkpoint so that a checkpoint translates text
    on its own; so are a classifier's class names (``labels``).

    ``model`` is the model of ``config.model.task`` (:func:`aiayn.model.families.build_model`)
    and ``corpus`` gives that task's batches.
    """

    def __init__(
        self,
        config: RunConfig,
        model: nn.Module,
        corpus: ExampleSource,
        sampler: BatchSampler,
        run_dir: str | Path,
        *,
        valid: ValidSet | TextValidSet | None = None,
        tokenizer_bytes: bytes = b"",
        labels: list[str] | None = None,
        dist_info: DistInfo | None = None,
        show_progress: bool = True,
        tensorboard: bool = True,
        accelerated: bool = True,
        process_settings: bool = False,
    ) -> None:
        self.info = dist_info or DistInfo()
        self.device = self.info.device
        # train.precision=auto resolved here: the checkpoints record what ran.
        config = resolve_precision(config, self.device, announce=self.info.is_main)
        self.config = config
        self.train_cfg = config.train
        precision = self.train_cfg.precision
        if precision == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.precision=fp16 needs CUDA; use fp32 (or bf16) on the CPU")
        if self.train_cfg.update_tokens <= 0:
            raise ConfigError("train.update_tokens must be positive")
        self.model = model.to(self.device)
        set_activation_checkpointing(self.model, self.train_cfg.activation_checkpointing)
        # On the CPU, the faster modules of aiayn.accel (the plain model's results, see its
        # docstring); ``accelerated=False`` trains the plain model. ``process_settings``: also
        # its process-wide malloc thresholds, for a program that owns the process (aiayn train).
        self.acceleration: Acceleration | None = None
        if accelerated:
            self.acceleration = accelerate(
                self.model, "train", precision=self.precision, process_settings=process_settings
            )
        self.corpus = corpus
        self.sampler = sampler
        self.valid = valid
        self.run_dir = Path(run_dir)
        self.tokenizer = ckpt.bytes_to_tensor(tokenizer_bytes)
        self.labels = list(labels) if labels else None
        # Step checkpoints that could not be read when the run resumed and were left in place
        # (a newer format, an I/O error): never pruned, never counted in keep_last.
        self.passed_over: set[Path] = set()
        self.optimizer = build_optimizer(self.model, self.train_cfg)
        self.schedule = build_schedule(self.optimizer, config.model.d_model, self.train_cfg)
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
        self.train_module: nn.Module = self.model
        if self.info.distributed:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_module = DistributedDataParallel(self.model, device_ids=device_ids)
        if self.train_cfg.compile:
            self.train_module = torch.compile(self.train_module)  # type: ignore[assignment]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Accelerated on the CPU: the projection and the loss fused (aiayn.accel.loss), in
        # bfloat16 products under bf16, for the tasks that predict tokens. Otherwise the plain
        # loss over the logits.
        self._fused_loss = (
            self.acceleration is not None
            and self.acceleration.fused_loss
            and config.model.task != "classify"
            and not config.model.final_logits_bias  # the fused product has no bias
        )
        self._loss_dtype = torch.bfloat16 if precision == "bf16" else None
        # Progress, saved in every checkpoint.
        self.step = 0
        self.epoch = 0
        self.best_value: float | None = None
        self.best_step = 0
        self.bad_evals = 0
        self.skipped = 0
        self.tokens_seen = 0
        self.minutes_before = 0.0
        # The schedule's progress (optim.schedule_progress) when each step checkpoint was
        # saved: train.average_from chooses by it.
        self.checkpoint_progress: dict[int, float] = {}
        self.last_metrics: dict[str, float] = {}
        self._bad_in_row = 0
        self._batches: Iterator[Indices] | None = None
        self._fresh = True
        self._signal: int | None = None
        self._start = time.monotonic()
        self._last_save_time = self._start
        self._saved_step = -1
        self._validated_step = -1
        # What the updates since the last logged one sum to (saved with a checkpoint, so that
        # a resumed run logs what the uninterrupted one does).
        self._interval = {"loss": 0.0, "nll": 0.0, "tokens": 0.0}
        # Whether the checkpoint the run is about to write is a stop by a signal's; and the
        # file of the one this run resumed from, where it was: once the run writes a
        # checkpoint of its own, that file goes (it is off the save grid, which the
        # uninterrupted run never writes), and until then it takes no keep_last slot.
        self._interrupted = False
        self.interruption: Path | None = None
        self.metrics = MetricsLog(self.run_dir, self.info.is_main, tensorboard)
        self.progress = Progress(
            self.train_cfg.max_steps,
            enabled=self.info.is_main,
            bar=show_progress,
            total_minutes=self.train_cfg.max_minutes,
        )
        if precision == "bf16" and self.device.type == "cpu" and not cpu_has_bfloat16():
            self.log(
                "warning: train.precision=bf16 on a CPU without bfloat16 instructions "
                "(AVX512-BF16 or AMX): its products are emulated, slower than fp32"
            )

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """``train.precision`` as the run trains (``"auto"`` resolved)."""
        precision = self.train_cfg.precision
        assert precision != "auto", "resolved in __init__"
        return precision

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run updates until a limit, early stopping or a signal; validate and save at the end.
        Averaging the last checkpoints, and closing: ``training.launch.train_and_average``."""
        cfg = self.train_cfg
        interval = self._interval
        # Resumed: the time the sums took before the checkpoint, so that tokens/s is right.
        interval["time"] = time.monotonic() - interval.pop("seconds", 0.0)
        reason = self._limit_reached()
        if reason is None and 0 < cfg.max_minutes <= self.minutes_before:
            reason = f"reached train.max_minutes={cfg.max_minutes:g}"  # before this resume
        if self.step == 0 and self.info.is_main:
            changes = model_changes(self.config)  # the preset's name alone would not say
            changed = f" with {', '.join(changes[:4])}{', ...' if len(changes) > 4 else ''}"
            self.log(
                f"training {self.config.preset}{changed if changes else ''} "
                f"({sum(p.numel() for p in self.params):,} parameters) on "
                f"{self.info.world_size} × {self.device.type}, "
                f"~{cfg.update_tokens:,} target tokens per update"
            )
        elif reason is None:
            self.log(f"resuming at update {self.step} (epoch {self.epoch})")
        if reason is None:
            self.log(f"learning rate: {self.schedule_description}")
            self.log(f"averaging at the end: {self.average_description}")
        interrupted = False
        # Updates after this one that a dead process logged are redone: one record per step.
        self.metrics.drop_after(self.step)
        self.progress.begin(self.step)
        while reason is None:
            stats = self._update()
            interval["loss"] += stats["loss_sum"]
            interval["nll"] += stats["nll_sum"]
            interval["tokens"] += stats["tgt_tokens"]
            if stats["finite"] and self.step % max(cfg.log_interval, 1) == 0:
                self._log_train(interval, stats)
            stop_early = False
            if cfg.valid_interval > 0 and stats["finite"] and self.step % cfg.valid_interval == 0:
                stop_early = self._after_validation(self.validate())
            reason = self._limit_reached()
            if stop_early:
                reason = f"no improvement in {cfg.patience} validations (train.patience)"
            elif stats["out_of_time"]:
                reason = f"reached train.max_minutes={cfg.max_minutes:g}"
            if stats["signal"] and reason is None:
                name = signal.Signals(self._signal).name if self._signal else "a signal"
                reason = f"stopped by {name}"
                interrupted = True
            due = cfg.save_interval_steps > 0 and self.step % cfg.save_interval_steps == 0
            if reason is None and stats["finite"] and (due or stats["save_due"]):
                self.save()
        self.progress.close()
        return self._finish(reason, interrupted)

    def _limit_reached(self) -> str | None:
        cfg = self.train_cfg
        if cfg.max_steps > 0 and self.step >= cfg.max_steps:
            return f"reached train.max_steps={cfg.max_steps}"
        if cfg.max_epochs > 0 and self.epoch >= cfg.max_epochs:
            return f"reached train.max_epochs={cfg.max_epochs}"
        return None

    def _time_to_save(self) -> bool:
        minutes = self.train_cfg.save_interval_minutes
        return minutes > 0 and (time.monotonic() - self._last_save_time) / 60.0 >= minutes

    def _out_of_time(self) -> bool:
        return self.train_cfg.max_minutes > 0 and self.minutes >= self.train_cfg.max_minutes

    def _finish(self, reason: str, interrupted: bool) -> TrainResult:
        # Marked only off the save grid: a checkpoint on it is one the uninterrupted run keeps.
        every = self.train_cfg.save_interval_steps
        self._interrupted = interrupted and not (every > 0 and self.step % every == 0)
        if not interrupted:
            if self.valid is not None and self._validated_step != self.step and self.step > 0:
                self._after_validation(self.validate())
        path = self.save() if self._saved_step != self.step else None
        if path is None and self.info.is_main:
            path = loading.step_checkpoint_path(self.run_dir, self.step)
        self.log(f"learning rate {self.lr:.3g} after update {self.step}, minute {self.minutes:.1f}")
        self.log(f"{reason} at update {self.step}, epoch {self.epoch}; checkpoint {path}")
        return TrainResult(
            step=self.step,
            epoch=self.epoch,
            reason=reason,
            interrupted=interrupted,
            checkpoint=path,
            best_value=self.best_value,
            best_step=self.best_step,
            last_metrics=dict(self.last_metrics),
            rank=self.info.rank,
        )

    # -- one update ----------------------------------------------------------------------------

    def _update(self) -> dict[str, float]:
        """One optimizer update over ~update_tokens global target tokens; returns its stats."""
        cfg = self.train_cfg
        self.train_module.train()
        self.optimizer.zero_grad(set_to_none=True)
        budget = float(cfg.update_tokens)
        global_tokens = 0.0
        # Summed on the device: no synchronisation per micro-batch (single process).
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)  # loss_sum, nll_sum
        src_tokens = 0
        while True:
            batch, n_tgt, n_src = self._next_batch()
            src_tokens += n_src
            if self.info.distributed:
                count = torch.tensor([float(n_tgt)], dtype=torch.float64)
                global_tokens += float(
                    all_reduce_sum(count.to(reduce_device(self.info)), self.info)
                )
            else:
                global_tokens += n_tgt
            last = global_tokens >= budget
            sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if self.info.distributed and not last:
                sync = self._no_sync()
            with sync:
                loss_sum, nll_sum = self._loss(batch)
                # Scaled by the (constant) budget for a well-ranged gradient; the exact global
                # normalisation happens below, once the global token count is known.
                self.scaler.scale(loss_sum / budget).backward()
            sums += torch.stack([loss_sum.detach(), nll_sum.detach()])
            if last:
                break
        # One all-reduce for the update's statistics and the run-wide decisions.
        flags = [
            float(self._signal is not None),
            float(self.info.is_main and self._time_to_save()),
            float(self.info.is_main and self._out_of_time()),
            # The first process's clock: every process sets the same time-fitted rate. Last:
            # the schedule reads it as stats[-1].
            self.minutes if self.info.is_main else 0.0,
        ]
        local = [*sums.double().cpu().tolist(), float(src_tokens)]
        stats = torch.tensor(local + flags, dtype=torch.float64)
        stats = all_reduce_sum(stats.to(reduce_device(self.info)), self.info).cpu()
        total_loss, total_nll, total_src = (float(x) for x in stats[:3])
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        # DDP averaged the gradients over ranks: grad = Σ_ranks Σ_micro ∇loss / (budget · W).
        factor = budget * self.info.world_size / global_tokens
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(factor)
        grad_norm = self._grad_norm()
        finite = math.isfinite(total_loss) and (
            self.scaler.is_enabled() or math.isfinite(grad_norm)
        )
        if finite:
            if self.scaler.is_enabled():
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                stepped = self.scaler.get_scale() >= scale  # a lowered scale = skipped step
            else:
                self.optimizer.step()
                stepped = True
            if stepped:
                if isinstance(self.schedule, LinearTimeLR):
                    self.schedule.record(float(stats[-1]))  # rank 0's clock, the last flag
                self.schedule.step()
                self.step += 1
            self._bad_in_row = 0
            self.tokens_seen += int(global_tokens)
        else:
            if self.scaler.is_enabled():
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            self._bad_in_row += 1
            self.log(
                f"warning: non-finite loss or gradient after update {self.step}; update skipped "
                f"({self._bad_in_row} in a row)"
            )
            if self._bad_in_row >= cfg.max_bad_steps:
                raise TrainingError(
                    f"the loss was NaN or infinite for {self._bad_in_row} updates in a row, after "
                    f"update {self.step} (step {self.step + 1} never succeeded); stopping. Try a "
                    "lower train.lr_scale, train.clip_norm > 0, or fp32 precision"
                )
        return {
            "loss_sum": total_loss,
            "nll_sum": total_nll,
            "tgt_tokens": global_tokens,
            "src_tokens": total_src,
            "grad_norm": grad_norm,
            "finite": float(finite),
            "signal": float(stats[3]),
            "save_due": float(stats[4]),
            "out_of_time": float(stats[5]),
        }

    def _loss(self, batch: Batch | TokenBatch | LabelBatch) -> tuple[Tensor, Tensor]:
        """Summed label-smoothed loss and NLL of one micro-batch (through DDP/compile)."""
        # the fused loss takes the decoder output, unprojected
        weight = self.model.get_parameter("out_proj.weight") if self._fused_loss else None
        return batch_loss(
            self.train_module,
            batch,
            self.train_cfg.label_smoothing,
            weight,
            self._loss_dtype,
            autocast(self.train_cfg.precision, self.device),
        )

    def _next_batch(self) -> tuple[Batch | TokenBatch | LabelBatch, int, int]:
        """The next batch on the device, with its target and source token counts (counted on
        the CPU, so that no device synchronisation is needed)."""
        empty_epochs = 0
        while True:
            if self._batches is None:
                if self._fresh:
                    self.sampler.set_epoch(self.epoch)
                    self._fresh = False
                self._batches = iter(self.sampler)
            try:
                indices = next(self._batches)
            except StopIteration:
                empty_epochs += 1
                if empty_epochs > 1:
                    raise TrainingError("the training data yields no batches") from None
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
                self._batches = iter(self.sampler)
                continue
            set_epoch = getattr(self.corpus, "set_epoch", None)
            if set_epoch is not None:  # a source whose batches depend on the epoch
                set_epoch(self.epoch)
            batch = self.corpus.batch(indices)
            return batch.to(self.device), batch.n_tgt_tokens, batch.n_src_tokens

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        module = self.train_module
        module = getattr(module, "_orig_mod", module)  # torch.compile wrapper
        return module.no_sync()  # type: ignore[operator]

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        if self.train_cfg.clip_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.params, self.train_cfg.clip_norm))
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        return float(torch.linalg.vector_norm(norms))

    # -- validation ----------------------------------------------------------------------------

    def validate(self, model: nn.Module | None = None) -> dict[str, float]:
        """:func:`aiayn.training.validation.evaluate` (translation) or
        :func:`aiayn.training.tasks.evaluate_text` of ``model`` (default: the one being
        trained) on the valid set; ``{}`` without one. Collective under DDP."""
        if self.valid is None:
            return {}
        model = model if model is not None else self.model
        if isinstance(self.valid, TextValidSet):
            return evaluate_text(model, self.valid, self.config, self.info)
        return evaluate(model, self.valid, self.config, self.info)  # type: ignore[arg-type]

    def _after_validation(self, metrics: dict[str, float]) -> bool:
        """Record the metrics, keep the best model; True when patience has run out."""
        self.last_metrics = metrics
        self._validated_step = self.step
        self.metrics.write({"kind": "valid", "step": self.step, "minutes": self.minutes, **metrics})
        by_bleu = "bleu" in metrics
        value = metrics["bleu"] if by_bleu else metrics["loss"]
        better = self.best_value is None or (
            value > self.best_value if by_bleu else value < self.best_value
        )
        text = " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        self.log(f"valid @ {self.step}: {text}" + (" (best)" if better else ""))
        if better:
            self.best_value, self.best_step, self.bad_evals = value, self.step, 0
            if self.info.is_main:
                ckpt.save_atomic(
                    ckpt.model_checkpoint(
                        self.config,
                        ckpt.model_state(self.model),
                        self.tokenizer,
                        self.step,
                        self.epoch,
                        metrics,
                        self.labels,
                    ),
                    self.run_dir / loading.BEST_NAME,
                )
            barrier(self.info)
            return False
        self.bad_evals += 1
        patience = self.train_cfg.patience
        return patience > 0 and self.bad_evals >= patience

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Write a step checkpoint (rank 0) and prune old ones; collective under DDP."""
        progress = schedule_progress(self.train_cfg, self.step, self.minutes)
        if progress is not None:
            self.checkpoint_progress[self.step] = progress
        state = self.state_dict()
        path = None
        if self.info.is_main:
            path = loading.step_checkpoint_path(self.run_dir, self.step)
            cfg = self.train_cfg
            # With train.average_from, the checkpoints it averages are kept besides (_prune).
            keep = max(cfg.keep_last, 1 if cfg.average_from > 0 else cfg.average_last, 1)
            # Room first for the new file, beyond the newest keep - 1 (a lowered keep_last
            # frees space before the save); never the newest one, which a failed save needs.
            self._prune(max(keep - 1, 1), exclude=path)
            ckpt.save_atomic(state, path)
            self._prune(keep)
            if self.interruption is not None and self.interruption != path:
                self.interruption.unlink(missing_ok=True)
                self.checkpoint_progress.pop(loading.step_of(self.interruption), None)
                self.interruption = None
        barrier(self.info)
        self._saved_step = self.step
        self._last_save_time = time.monotonic()
        return path

    def _prune(self, keep: int, exclude: Path | None = None) -> None:
        """Delete this run's step checkpoints beyond the newest ``keep`` (those passed over at
        resume are not the run's: never counted, never deleted), except those that
        ``train.average_from`` averages."""
        mine = [
            p
            for p in loading.list_step_checkpoints(self.run_dir)
            if p not in self.passed_over and p != exclude and p != self.interruption
        ]
        for old in mine[:-keep]:
            if not self._averaged_from(old):
                old.unlink(missing_ok=True)
                self.checkpoint_progress.pop(loading.step_of(old), None)

    def _averaged_from(self, path: Path) -> bool:
        """Whether ``train.average_from`` averages the step checkpoint ``path``: saved at or
        after that fraction of the schedule's progress (as recorded when it was saved; for
        the step-counted "linear" schedule, its step tells)."""
        cfg = self.train_cfg
        if cfg.average_from <= 0:
            return False
        step = loading.step_of(path)
        progress = self.checkpoint_progress.get(step)
        if progress is None and cfg.lr_schedule == "linear":
            progress = schedule_progress(cfg, step, 0.0)
        return progress is not None and progress >= cfg.average_from

    def average_span(self) -> tuple[list[Path], str]:
        """The step checkpoints that ``train.average_from`` averages, oldest first, and in
        words why those (rank 0: the files are its)."""
        chosen = [
            p
            for p in loading.list_step_checkpoints(self.run_dir)
            if p not in self.passed_over and p != self.interruption and self._averaged_from(p)
        ]
        rule = f"saved at or after {self._average_point()}"
        if not chosen:
            return [], f"no checkpoint was {rule}"
        first, last = loading.step_of(chosen[0]), loading.step_of(chosen[-1])
        updates = f"update {last}" if first == last else f"updates {first}-{last}"
        return chosen, f"{counted(len(chosen), 'checkpoint')} {rule}: {updates}"

    def _average_point(self) -> str:
        """Where ``train.average_from``'s span begins, in words."""
        cfg = self.train_cfg
        given = f"train.average_from={cfg.average_from:g}"
        if cfg.lr_schedule == "linear_time":
            minute = cfg.average_from * cfg.max_minutes
            budget = f"train.max_minutes={cfg.max_minutes:g}"
            return f"{cfg.average_from:.0%} of {budget} (minute {minute:.1f}, {given})"
        update = math.ceil(cfg.average_from * cfg.max_steps)
        return (
            f"{cfg.average_from:.0%} of train.max_steps={cfg.max_steps} (update {update}, {given})"
        )

    @property
    def schedule_description(self) -> str:
        """The learning-rate schedule in words (optim.describe_schedule)."""
        return describe_schedule(self.config.model.d_model, self.train_cfg)

    @property
    def average_description(self) -> str:
        """Which checkpoints the run averages at its end, in words."""
        cfg = self.train_cfg
        if cfg.average_from > 0:
            point = self._average_point()
            return f"every checkpoint saved at or after {point}, kept whatever train.keep_last"
        if cfg.average_last > 0:
            return f"the last {counted(cfg.average_last, 'checkpoint')} (train.average_last)"
        return "none (train.average_last=0)"

    def state_dict(self) -> dict[str, Any]:
        """The full resumable state (collective under DDP: every rank must call it)."""
        rngs = all_gather_objects(ckpt.capture_rng(), self.info)
        samplers = all_gather_objects(dict(self.sampler.state_dict()), self.info)
        return {
            "format": loading.CHECKPOINT_FORMAT,
            "format_version": loading.CHECKPOINT_VERSION,
            "kind": "train",
            "config": self.config.to_dict(),
            "model": ckpt.model_state(self.model),
            "tokenizer": self.tokenizer,
            **({"labels": self.labels} if self.labels else {}),
            "step": self.step,
            "epoch": self.epoch,
            "metrics": dict(self.last_metrics),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "sampler": samplers,
            "rng": rngs,
            "progress": {
                "best_value": self.best_value,
                "best_step": self.best_step,
                "bad_evals": self.bad_evals,
                "minutes": self.minutes,
                "checkpoint_progress": dict(self.checkpoint_progress),
                "tokens": self.tokens_seen,
                "skipped": self.skipped,
                "interval": {
                    **{k: self._interval[k] for k in ("loss", "nll", "tokens")},
                    "seconds": time.monotonic() - self._interval.get("time", time.monotonic()),
                },
                "interrupted": self._interrupted,
            },
        }

    def load_state_dict(self, state: dict[str, Any], source: Path | None = None) -> None:
        """Continue from a train checkpoint (read from the file ``source``, where given); the
        model section of the config and the tokenizer must match (``ResumeMismatch``
        otherwise)."""
        if state.get("kind") != "train":
            raise loading.CheckpointError(
                "a model-only checkpoint cannot be resumed (no optimizer)"
            )
        saved = config_from_dict(state["config"], stored=True)
        # The tokenizer first: data prepared again is the likelier cause of other differences.
        saved_tokenizer = state.get("tokenizer")
        if saved_tokenizer is not None and not torch.equal(saved_tokenizer, self.tokenizer):
            raise TokenizerMismatch(
                "the checkpoint was trained with another tokenizer than the data's (the data was "
                "prepared again since); resuming would scramble the vocabulary. Train into a new "
                "run directory, or prepare the data as before"
            )
        mine, theirs = _compared(self.config.model), _compared(saved.model)
        if theirs != mine:
            diffs = [
                f"{name}: checkpoint {getattr(theirs, name)!r} vs now {getattr(mine, name)!r}"
                for name in theirs.__dataclass_fields__
                if getattr(theirs, name) != getattr(mine, name)
            ]
            raise ResumeMismatch(
                "the model config differs from the checkpoint's: " + "; ".join(diffs)
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.last_metrics = dict(state.get("metrics", {}))
        progress = state["progress"]
        self.best_value = progress["best_value"]
        self.best_step = int(progress["best_step"])
        self.bad_evals = int(progress["bad_evals"])
        self.minutes_before = float(progress["minutes"])
        saved = progress.get("checkpoint_progress", {})  # absent from older checkpoints
        self.checkpoint_progress = {int(k): float(v) for k, v in saved.items()}
        self.tokens_seen = int(progress["tokens"])
        self.skipped = int(progress["skipped"])
        interval = progress.get("interval", {})  # absent from older checkpoints
        self._interval = {
            k: float(interval.get(k, 0.0)) for k in ("loss", "nll", "tokens", "seconds")
        }
        if progress.get("interrupted") and source is not None:
            self.interruption = Path(source)
        samplers, rngs = state["sampler"], state["rng"]
        same_world = len(samplers) == self.info.world_size
        if not same_world:
            self.log(
                f"note: checkpoint written by {len(samplers)} process(es), resuming with "
                f"{self.info.world_size}: the data order restarts at epoch {self.epoch}"
            )
            self.sampler.set_epoch(self.epoch)
        else:
            self.sampler.load_state_dict(samplers[self.info.rank])
        ckpt.restore_rng(rngs[self.info.rank] if same_world else rngs[0])
        self._batches = None
        self._fresh = False
        self._saved_step = self._validated_step = self.step
        self._start = self._last_save_time = time.monotonic()

    # -- signals -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        """SIGINT and SIGTERM ask the loop to stop cleanly after the current update."""
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def signal_received(self) -> int | None:
        """The SIGINT or SIGTERM received while :meth:`signals_handled` was in force, or None."""
        return self._signal

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self._signal = signum
        if not self.info.is_main:  # under torchrun, the first process says it for all
            return
        name = signal.Signals(signum).name
        print(
            f"\n{name} received: finishing the current update, then saving a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
        )

    # -- progress ------------------------------------------------------------------------------

    @property
    def minutes(self) -> float:
        return self.minutes_before + (time.monotonic() - self._start) / 60.0

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def log(self, message: str) -> None:
        """Print ``message`` above the progress line (rank 0 only)."""
        if self.info.is_main:
            self.progress.write(message)

    def _log_train(self, interval: dict[str, float], stats: dict[str, float]) -> None:
        now = time.monotonic()
        tokens = max(interval["tokens"], 1.0)
        loss, nll = interval["loss"] / tokens, interval["nll"] / tokens
        tps = interval["tokens"] / max(now - interval["time"], 1e-9)
        self.metrics.write(
            {
                "kind": "train",
                "step": self.step,
                "epoch": self.epoch,
                "loss": loss,
                "nll": nll,
                "ppl": perplexity(nll),
                "lr": self.lr,
                "grad_norm": stats["grad_norm"],
                "tgt_tokens_per_s": tps,
                "tokens": self.tokens_seen,
                "minutes": self.minutes,
                "skipped": self.skipped,
            }
        )
        self.progress.update(self.step, self.epoch, loss, nll, self.lr, tps, self.minutes)
        interval.update(loss=0.0, nll=0.0, tokens=0.0, time=now)

    def close(self) -> None:
        """Close the metrics log (its TensorBoard writer) and undo the acceleration: the model
        is the plain one again, and the process's malloc setting (``process_settings``) released."""
        self.metrics.close()
        if self.acceleration is not None:
            self.acceleration.undo()
