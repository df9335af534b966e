"""``aiayn train``: a prepared DATA_DIR and a run config to a trained RUN_DIR.

Runs unchanged under ``torchrun --nproc-per-node N``. Running again into a RUN_DIR that holds
checkpoints resumes from the newest readable one (``--resume`` says so explicitly).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from aiayn.cli.paths import check_output_dir
from aiayn.cli.process import PROCESS_SETTINGS
from aiayn.errors import CLIError
from aiayn.recipes import recipe_names, resolve_recipe

if TYPE_CHECKING:
    from aiayn.config import RunConfig


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model with the paper's recipe (resumable; runs under torchrun)",
        description="Train a Transformer on a prepared data directory (see `aiayn prepare`). "
        "The config is a TOML file naming a preset and overrides; KEY=VALUE arguments override "
        "it further (e.g. train.max_steps=1000 model.dropout=0.3). Progress goes to stderr, "
        "one JSON line per log interval to RUN_DIR/metrics.jsonl. SIGINT/SIGTERM save a "
        "checkpoint and exit 0. The same command runs under `torchrun --nproc-per-node N`.",
        epilog=PROCESS_SETTINGS,
    )
    parser.add_argument(
        "--config",
        metavar="RECIPE_OR_TOML",
        help="run config: a shipped recipe by name (" + ", ".join(recipe_names()) + "; CPU: "
        "multi30k, finetune, bible_*, tiny; GPU: base, big) or a TOML file; required for a new "
        "run, by default RUN_DIR/config.toml when resuming",
    )
    parser.add_argument(
        "--data", type=Path, help="prepared data directory; default when resuming: the run's"
    )
    parser.add_argument("--out", type=Path, required=True, metavar="RUN_DIR", help="run directory")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest readable checkpoint in RUN_DIR (also the default when "
        "RUN_DIR has checkpoints)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for PyTorch (default: its own, one per core); 1 is faster when "
        "other work holds the cores (the run warns when it measures that)",
    )
    parser.add_argument(
        "--start-over",
        action="store_true",
        help="when RUN_DIR holds checkpoints of which none can be read: train from scratch "
        "instead of stopping",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where to train (auto: CUDA when available; under torchrun cuda:LOCAL_RANK)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress line on stderr (metrics still)"
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from aiayn.inference import loading
    from aiayn.training.checkpoint import set_aside_checkpoints
    from aiayn.training.launch import CONFIG_NAME, train_run
    from aiayn.training.run_config import resolve_config

    run_dir: Path = args.out
    check_output_dir(run_dir, "--out")
    threads = torch.get_num_threads()  # what a plain translate runs with
    if args.threads is not None:
        if args.threads < 1:
            raise CLIError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    # Checkpoints set aside as unreadable count: the run then stops until --start-over.
    has_checkpoints = bool(loading.list_step_checkpoints(run_dir) or set_aside_checkpoints(run_dir))
    started = (run_dir / CONFIG_NAME).is_file()  # a run killed before its first checkpoint
    if args.resume and not has_checkpoints and not started and args.config is None:
        where = "does not exist" if not run_dir.exists() else "holds no checkpoint"
        raise CLIError(f"--resume: {run_dir} {where}; start a run there with --config and --data")
    config_path = resolve_recipe(args.config) if args.config is not None else None
    data_dir = args.data
    resuming = has_checkpoints or args.resume or args.start_over
    if resuming:
        if config_path is None and (run_dir / CONFIG_NAME).is_file():
            config_path = run_dir / CONFIG_NAME
        if config_path is None:
            raise CLIError(
                f"--config is required: {run_dir / CONFIG_NAME}, the config a resumed run "
                "reads, is missing; pass the run's config file with --config"
            )
        if data_dir is None:
            data_dir = _saved_data(run_dir)
        if has_checkpoints and not args.resume and os.environ.get("RANK", "0") == "0":
            # Under torchrun, the first process says it for all.
            print(f"{run_dir} holds checkpoints: resuming (as with --resume)", file=sys.stderr)
    if config_path is None:
        raise CLIError("--config is required (except when resuming a run directory)")
    if data_dir is None:
        raise CLIError("--data is required (except when resuming a run directory)")
    config = resolve_config(config_path, data_dir, args.overrides, run_dir if resuming else None)
    result = train_run(
        config,
        data_dir,
        run_dir,
        device=args.device,
        show_progress=not args.no_progress,
        start_over=args.start_over,
        process_settings=True,
    )
    if result.rank != 0:  # under torchrun, rank 0 reports
        return 0
    if result.interrupted:
        # The trainer has said the stop, the update and the checkpoint: only how to go on here.
        again = ["aiayn", "train", "--out", str(run_dir), "--resume"]
        print(
            f"Resume with: {shlex.join(again)} (under torchrun: the same torchrun command)",
            file=sys.stderr,
        )
        return 0
    print(f"done: {result.reason} at update {result.step} (epoch {result.epoch})")
    if result.best_value is not None:
        metric = "bleu" if "bleu" in result.last_metrics else "loss"
        print(f"best valid {metric}: {result.best_value:.2f} at update {result.best_step}")
    print(f"last checkpoint: {result.checkpoint}")
    if result.averaged is not None:
        print(f"averaged model: {result.averaged}")
    if config.train.compile_step:
        from aiayn.devices import pick_device

        if result.signal is not None:  # asked to stop while the run finished: not a minute more
            print(
                f"train.compile_step: skipped ({signal.Signals(result.signal).name} received); "
                f"{_COMPILED_LATER}",
                file=sys.stderr,
            )
            return 0
        _compile_step(run_dir, config, pick_device(args.device).type, threads)
    return 0


# What becomes of the compiled step that a stop skips.
_COMPILED_LATER = (
    "the run is saved; translate decodes without the compiled step until one is compiled "
    "(translate --compiled-step compiles it)"
)


class _CompileStopped(BaseException):
    """SIGINT or SIGTERM while the decoder step compiles (a BaseException, as
    KeyboardInterrupt is: what catches a failed compile lets it through)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM end the block with :class:`_CompileStopped` (the defaults again
    after it)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _CompileStopped(signum)

    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, stop) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _saved_data(run_dir: Path) -> Path:
    """The data directory that a run directory's ``run.json`` names, checked: a missing or
    unreadable file, or a directory that is gone, is a CLIError that says to pass --data."""
    from aiayn.training.launch import RUN_INFO_NAME, saved_run_info

    info = run_dir / RUN_INFO_NAME
    data = saved_run_info(run_dir).get("data")
    if not data:
        state = "unreadable" if info.is_file() else "missing"
        raise CLIError(
            f"--data is required: {info}, which names the data a resumed run reads, is {state}; "
            "pass the run's data directory with --data"
        )
    if not Path(data).is_dir():
        raise CLIError(
            f"the data directory {data} that {info} names does not exist (moved?); pass its "
            "new place with --data"
        )
    return Path(data)


def _compile_step(run_dir: Path, config: RunConfig, device: str, threads: int) -> None:
    """train.compile_step: the decoder step of the model ``translate RUN_DIR`` decodes with,
    compiled for this machine and the thread count a plain ``translate`` takes (``threads``),
    where it can be: skipped quietly for a model it does not serve and for a run on CUDA or
    under torchrun (whose processes run on fewer threads), in one line where this machine
    cannot compile it."""
    import os
    import time

    import torch

    from aiayn.accel.compiled import cannot_build, config_unsupported
    from aiayn.inference.translator import Translator

    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device != "cpu" or config_unsupported(config.model) is not None or processes > 1:
        return
    reason = cannot_build()
    if reason is not None:
        print(f"train.compile_step: {reason}; translate decodes without it", file=sys.stderr)
        return
    from aiayn.accel.store import compiled_dir
    from aiayn.cli.cache import inductor_cache_dir

    folder = compiled_dir()
    print(
        f"compiling the decoder step that translate decodes with on this machine ({threads} "
        f"threads): a minute or more, and tens to hundreds of MB of libraries in {folder} "
        f"besides PyTorch's files in {inductor_cache_dir()} (train.compile_step = false skips "
        "this; aiayn cache shows and clears both)",
        file=sys.stderr,
        flush=True,
    )
    held = _folder_bytes(folder)
    start = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _stopped_by_signals():
            translator, _ = Translator.from_checkpoint(
                run_dir, compiled_step=True, pack_weights=False
            )
    except _CompileStopped as stop:  # the compile is abandoned (its file never in place)
        print(f"train.compile_step: stopped by {stop}; {_COMPILED_LATER}", file=sys.stderr)
        return
    except Exception as error:  # the run is done and saved: a failure here only says so
        print(f"train.compile_step: {error}; translate decodes without it", file=sys.stderr)
        return
    finally:
        torch.set_num_threads(before)
    if translator.acceleration is not None and "compiled decoder step" in (
        translator.acceleration.levers
    ):
        seconds = time.perf_counter() - start
        added = max(_folder_bytes(folder) - held, 0)
        print(
            f"decoder step compiled for translate on this machine ({threads} threads, "
            f"{seconds:.0f} s, {added / 1e6:,.0f} MB in {folder}; train.compile_step = false "
            "skips this, aiayn cache --clear compiled removes it)"
        )


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 where there is none)."""
    total = 0
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            total += path.lstat().st_size if path.is_file() else 0
        except OSError:
            pass
    return total
