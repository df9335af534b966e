"""From a prepared DATA_DIR and a resolved run config to a trained RUN_DIR: what ``aiayn train``
calls.

Checks that the config fits the data (:mod:`aiayn.training.run_config` resolves it), joins the
torchrun process group if there is one, builds the model, the batches and the validation set,
resumes from the newest readable checkpoint when there is one (or starts from
``train.init_from``: :mod:`aiayn.training.pretrained`), writes the config to
``RUN_DIR/config.toml``, runs the :class:`~aiayn.training.trainer.Trainer` and averages the
last checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aiayn.accel import accelerate
from aiayn.config import RunConfig, config_to_toml
from aiayn.data.batching import TokenBatchSampler
from aiayn.data.corpus import Corpus, load_manifest, tokenizer_path
from aiayn.data.sampling import BpeDropoutPairs, check_bpe_dropout
from aiayn.data.tokenizer import Tokenizer
from aiayn.devices import busy_cpu_slowdown, describe_host
from aiayn.errors import ConfigError
from aiayn.inference import loading
from aiayn.lock import LOCK_NAME, RunDirectoryBusy, run_lock
from aiayn.model.families import build_model
from aiayn.progress import counted
from aiayn.training import checkpoint as ckpt
from aiayn.training.averaging import average_files, average_run
from aiayn.training.distributed import (
    DistInfo,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown_distributed,
)
from aiayn.training.pretrained import load_pretrained_encoder, pretrained_weights
from aiayn.training.run_config import check_fits_data
from aiayn.training.storage import writing
from aiayn.training.tasks import TextValidSet, text_examples
from aiayn.training.trainer import (
    ExampleSource,
    TokenizerMismatch,
    Trainer,
    TrainingError,
    TrainResult,
)
from aiayn.training.validation import ValidSet

CONFIG_NAME = "config.toml"
RUN_INFO_NAME = "run.json"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _valid_set(data_dir: Path, tokenizer: Any) -> ValidSet:
    corpus = Corpus.open(data_dir, "valid")
    references = corpus.tgt_texts()
    if len(references) != len(corpus):
        raise ConfigError(
            f"{corpus.tgt_text_path()} has {counted(len(references), 'line')} for "
            f"{counted(len(corpus), 'pair')}; "
            "prepare the data again"
        )
    return ValidSet(corpus, corpus.src_lengths, references, tokenizer.decode)


# Threads this many times slower than one thread: another process holds the cores.
BUSY_SLOWDOWN = 1.5


def _warn_if_cpu_busy() -> None:
    """Say so when other work on the machine makes PyTorch's threads slower than one thread
    (on a small CPU shared with a busy process, PyTorch's threads wait on each other:
    docs/training.md)."""
    threads = torch.get_num_threads()
    slowdown = busy_cpu_slowdown()
    if slowdown > BUSY_SLOWDOWN:
        print(
            f"warning: the CPU is busy with other work: {threads} threads ran a test product "
            f"{slowdown:.1f}x slower than 1 thread; training will likely be faster with "
            "--threads 1, torch.set_num_threads(1) from Python (or fewer threads than cores "
            "are free)",
            file=sys.stderr,
        )


def _bpe_dropout_pairs(
    manifest: dict[str, Any], pairs: Corpus, tokenizer: Tokenizer, config: RunConfig
) -> BpeDropoutPairs:
    """The training pairs segmented with ``data.bpe_dropout`` (aiayn.data.sampling);
    ``manifest``: their data directory's."""
    check_bpe_dropout(config.data.bpe_dropout, tokenizer)
    # No sample longer than prepare let through, nor than the positions hold (+ BOS/EOS).
    prepared = int(manifest.get("filters", {}).get("max_len", config.data.max_len))
    return BpeDropoutPairs(
        pairs,
        tokenizer,
        config.data.bpe_dropout,
        seed=config.train.seed,
        max_len=min(prepared, config.model.max_positions - 1),
    )


def train_run(
    config: RunConfig,
    data_dir: str | Path,
    run_dir: str | Path,
    *,
    device: str = "auto",
    show_progress: bool = True,
    start_over: bool = False,
    process_settings: bool = False,
) -> TrainResult:
    """Train (or resume) ``run_dir`` on ``data_dir``; the same call on every torchrun rank.
    ``config`` as :func:`~aiayn.training.run_config.resolve_config` makes it from a config file
    and the data (the vocabulary size and a classifier's classes taken from the data); one that
    does not fit the data is refused (:func:`~aiayn.training.run_config.check_fits_data`)
    before anything is written."""

    data_dir, run_dir = Path(data_dir), Path(run_dir)
    manifest = load_manifest(data_dir)
    check_fits_data(config, data_dir, manifest)
    info: DistInfo = init_distributed(device)
    # A run refused before it wrote anything leaves no directory holding only its lock.
    fresh = info.is_main and not (run_dir.is_dir() and any(run_dir.iterdir()))
    try:
        with contextlib.ExitStack() as held:
            # One process at a time in a run directory (under torchrun: rank 0 holds it).
            refusal = None
            if info.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    held.enter_context(run_lock(run_dir))
                except RunDirectoryBusy as err:
                    refusal = str(err)
                else:
                    for path in ckpt.remove_stale_temporaries(run_dir):
                        print(f"removed {path.name}, left by an interrupted save", file=sys.stderr)
            refusal = broadcast_object(refusal, info)
            if refusal is not None:
                raise RunDirectoryBusy(refusal)
            if info.world_size == 1 and info.device.type == "cpu":
                _warn_if_cpu_busy()
            barrier(info)
            tok_path = tokenizer_path(data_dir)
            tokenizer = Tokenizer.load(tok_path)  # a missing or broken file: a UserError naming it
            tokenizer_bytes = tok_path.read_bytes()
            validating = config.train.valid_interval > 0
            corpus: ExampleSource
            valid: ValidSet | TextValidSet | None = None
            labels: list[str] | None = None
            if config.model.task == "translation":
                pairs = Corpus.open(data_dir, "train")
                corpus, lengths = pairs, (pairs.src_lengths, pairs.tgt_lengths)
                if config.data.bpe_dropout > 0:
                    corpus = _bpe_dropout_pairs(manifest, pairs, tokenizer, config)
                valid = _valid_set(data_dir, tokenizer) if validating else None
            else:
                if config.data.bpe_dropout > 0:
                    raise ConfigError("data.bpe_dropout is an option of the translation task")
                examples = text_examples(data_dir, "train", config)
                corpus, lengths = examples, (examples.lengths, examples.lengths)
                if validating:
                    n_classes = config.model.n_classes if config.model.task == "classify" else 0
                    valid = TextValidSet(text_examples(data_dir, "valid", config), n_classes)
                if config.model.task == "classify":
                    labels = list(manifest["labels"])
            try:
                sampler = TokenBatchSampler(
                    *lengths,
                    config.data.max_tokens,
                    seed=config.train.seed,
                    shuffle=True,
                    rank=info.rank,
                    world_size=info.world_size,
                )
            except ValueError as err:
                raise ConfigError(str(err)) from None
            _seed_everything(config.train.seed)
            model = build_model(config.model)
            if info.rank > 0:  # different dropout masks on every rank
                torch.manual_seed(config.train.seed + info.rank)
            trainer = Trainer(
                config,
                model,
                corpus,
                sampler,
                run_dir,
                valid=valid,
                tokenizer_bytes=tokenizer_bytes,
                labels=labels,
                dist_info=info,
                show_progress=show_progress,
                process_settings=process_settings,
            )
            # Rank 0 reads the checkpoint and sends it: no shared filesystem needed.
            state, refusal = None, None
            found = None  # rank 0's: the checkpoint resumed from, and its state
            if info.is_main:
                # Checkpoints set aside as unreadable count too: a run that has lost them all
                # stops each time until it is told to start over.
                had = loading.list_step_checkpoints(run_dir) or ckpt.set_aside_checkpoints(run_dir)
                passed_over: list[Path] = []
                found = ckpt.resume_point(run_dir, passed_over=passed_over)
                trainer.passed_over = set(passed_over)
                if found is not None:
                    print(f"resuming from {found[0]}", file=sys.stderr)
                    if config.data.bpe_dropout > 0:
                        print(
                            "note: data.bpe_dropout: sentencepiece samples other segmentations "
                            "in each process, whatever the seed: the resumed run does not "
                            "repeat the uninterrupted one exactly",
                            file=sys.stderr,
                        )
                    state = found[1]
                elif had and not start_over:
                    # Those set aside, now or by an earlier attempt (then `had` lists them),
                    # and those left where they are because they cannot be read right now.
                    aside = [p for p in had if p.suffix == ckpt.BROKEN_SUFFIX or not p.exists()]
                    why = [f"{len(aside)} set aside as *.broken"] if aside else []
                    if passed_over:
                        why.append(f"{len(passed_over)} that cannot be read now left in place")
                    refusal = (
                        f"{run_dir / loading.CHECKPOINT_DIR} holds "
                        f"{counted(len(had), 'checkpoint')} and none can be read "
                        f"({'; '.join(why)}); to start this run over, pass --start-over (or "
                        "train into a new directory)"
                    )
                elif had:
                    print(f"no readable checkpoint in {run_dir}: starting over", file=sys.stderr)
            refusal = broadcast_object(refusal, info)
            if refusal is not None:
                raise TrainingError(refusal)
            state = broadcast_object(state, info)
            if state is not None:
                # Refuses another [model] section or tokenizer.
                try:
                    trainer.load_state_dict(state, found[0] if found is not None else None)
                except TokenizerMismatch:
                    _other_data(run_dir, data_dir)
                    raise
            elif config.train.init_from:
                # Rank 0 reads and checks the file; every rank raises its error alike.
                found_weights: dict[str, torch.Tensor] | str | None = None
                if info.is_main:
                    try:
                        found_weights = pretrained_weights(config, tokenizer_bytes)
                    except (ConfigError, loading.CheckpointError) as err:
                        found_weights = str(err)
                found_weights = broadcast_object(found_weights, info)
                if isinstance(found_weights, str) or found_weights is None:
                    raise ConfigError(found_weights or "train.init_from: nothing to load")
                if config.model.task == "classify":
                    load_pretrained_encoder(trainer.model, found_weights)
                else:
                    trainer.model.load_state_dict(found_weights)
                if info.is_main:
                    part = "encoder" if config.model.task == "classify" else "model"
                    print(f"{part} initialised from {config.train.init_from}", file=sys.stderr)
            if info.is_main:  # only once the config is known to fit the data and the checkpoint
                (run_dir / CONFIG_NAME).write_text(config_to_toml(config), encoding="utf-8")
                run_info = {
                    "data": str(data_dir.resolve()),
                    "world_size": info.world_size,
                    "host": describe_host(info.device),  # of the run's latest start
                    "schedule": trainer.schedule_description,
                    "average": trainer.average_description,
                }
                (run_dir / RUN_INFO_NAME).write_text(json.dumps(run_info, indent=2) + "\n")
            return train_and_average(trainer)
    except BaseException:
        if fresh and run_dir.is_dir() and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
            (run_dir / LOCK_NAME).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    finally:
        shutdown_distributed()


def train_and_average(trainer: Trainer) -> TrainResult:
    """Train (SIGINT and SIGTERM stop after the current update, with a checkpoint), then, if
    the run was not interrupted, average its last ``train.average_last`` checkpoints (or those
    that ``train.average_from`` chooses) into ``averaged.pt`` (§6.1) and validate the average;
    record how the run ended in ``run.json``; finally :meth:`Trainer.close`. The same call on
    every rank."""
    try:
        averaging: dict[str, Any] = {}
        with trainer.signals_handled():  # a signal during averaging lets it finish too
            result = trainer.train()
            cfg = trainer.config.train
            if not result.interrupted and result.step > 0:
                if cfg.average_from > 0:
                    result.averaged, averaging = _average_from(trainer)
                elif cfg.average_last > 0:
                    result.averaged = _average(trainer, cfg.average_last)
                    averaging = {"checkpoints": trainer.average_description}
        result.signal = trainer.signal_received
        if trainer.info.is_main:
            _record_end(trainer, result, averaging)
        return result
    finally:
        trainer.close()


def _record_end(trainer: Trainer, result: TrainResult, averaging: dict[str, Any]) -> None:
    """Add to ``RUN_DIR/run.json`` (where the run wrote one) how the training ended: why, the
    updates made, the minutes, the last learning rate and the checkpoints averaged."""
    path = trainer.run_dir / RUN_INFO_NAME
    info = saved_run_info(trainer.run_dir)
    if not info:
        return
    info["end"] = {
        "reason": result.reason,
        "updates": result.step,
        "minutes": round(trainer.minutes, 2),
        "lr": trainer.lr,
        **({"averaged": averaging} if averaging else {}),
    }
    text = json.dumps(info, indent=2) + "\n"
    temporary = path.with_name(path.name + ".tmp")  # a resumed run reads it: never torn
    with writing(path, "the run's record", len(text)):
        temporary.write_text(text, encoding="utf-8")
        temporary.replace(path)


def _average_from(trainer: Trainer) -> tuple[Path | None, dict[str, Any]]:
    """Average the checkpoints that ``train.average_from`` chooses into ``averaged.pt`` and
    validate the average; returns it (None where no checkpoint is in the span) and which
    checkpoints it averaged, and why."""
    averaged: Path | None = None
    why, steps = "", []
    if trainer.info.is_main:
        paths, why = trainer.average_span()
        if paths:
            chosen = average_files(trainer.run_dir, paths, in_run=True)
            if len(chosen) < len(paths):  # some could not be read
                why = f"{why}; {len(chosen)} of them readable"
            steps = [loading.step_of(p) for p in chosen]
            averaged = trainer.run_dir / loading.AVERAGED_NAME
        else:
            trainer.log(f"{why}: nothing averaged")
    averaged = broadcast_object(averaged, trainer.info)
    if averaged is not None:
        _validate_average(trainer, averaged, why)
    return averaged, {"checkpoints": why, "steps": steps}


def _average(trainer: Trainer, last: int) -> Path:
    info = trainer.info
    averaged = average_run(trainer.run_dir, last, in_run=True) if info.is_main else None
    averaged = broadcast_object(averaged, info)
    _validate_average(trainer, averaged, "")
    return averaged


def _validate_average(trainer: Trainer, averaged: Path, why: str) -> None:
    """Validate the model of ``averaged`` and record it (``why``: which checkpoints it is, for
    the log; else their count)."""
    info = trainer.info
    if trainer.valid is None:
        if why:
            trainer.log(f"averaged {why} -> {averaged}")
        return
    # Rank 0 reads the file and sends the weights: no shared filesystem needed.
    weights, count = None, 0
    if info.is_main:
        state = loading.load_checkpoint(averaged)
        weights, count = state["model"], int(state["metrics"]["averaged"])
    model = build_model(trainer.config.model, info.device)
    model.load_state_dict(broadcast_object(weights, info))
    if trainer.acceleration is not None:  # validated as the trained model was
        accelerate(model, "train", precision=trainer.precision)
    metrics = trainer.validate(model)
    # replace: a finished run run again averages again, and keeps one record.
    record = {"kind": "averaged", "step": trainer.step, "minutes": trainer.minutes, **metrics}
    trainer.metrics.write(record, replace=True)
    text = " ".join(f"{k} {v:.3f}" for k, v in metrics.items())
    what = why if why else f"last {count}"
    trainer.log(f"averaged {what}: {text} -> {averaged}")


def _other_data(run_dir: Path, data_dir: Path) -> None:
    """Where the run's checkpoint has another tokenizer than ``data_dir``'s and the run was
    trained on another directory, a ResumeMismatch that names it (rather than "the data was
    prepared again since", which holds where it is the same directory)."""
    before = saved_run_info(run_dir).get("data")
    if before and Path(before) != data_dir.resolve():
        raise TokenizerMismatch(
            f"the run in {run_dir} was trained on {before}, and {data_dir} has another "
            f"tokenizer; resume it with --data {before}, or train into a new run directory"
        ) from None


def saved_run_info(run_dir: str | Path) -> dict[str, Any]:
    """``RUN_DIR/run.json`` (the data directory of an earlier run), or ``{}``."""
    path = Path(run_dir) / RUN_INFO_NAME
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}
