"""Checks of output paths before a command starts work: a file where a directory is wanted
(or the reverse) is a one-line error, not a traceback after minutes of training."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.errors import CLIError


def _nearest_existing_parent(path: Path) -> Path | None:
    for parent in path.parents:
        if parent.exists():
            return parent
    return None


def check_output_dir(path: Path, option: str) -> None:
    """``path`` is a directory or can be made one."""
    if path.exists() and not path.is_dir():
        raise CLIError(f"{option} {path} is a file, not a directory")
    _check_parent(path, option)


def check_output_file(path: Path, option: str) -> None:
    """``path`` is a file or can be made one."""
    if path.is_dir():
        raise CLIError(f"{option} {path} is a directory; give a file name")
    _check_parent(path, option)


def _check_parent(path: Path, option: str) -> None:
    parent = _nearest_existing_parent(path)
    if parent is not None and not parent.is_dir():
        raise CLIError(f"{option} {path}: {parent} is a file, not a directory")


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """The CHECKPOINT_OR_RUN argument of the commands that load a model
    (:func:`aiayn.inference.loading.resolve_checkpoint`)."""
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_OR_RUN",
        help="a checkpoint file; a run directory (averaged.pt, else the newest readable "
        "checkpoint); or a run's checkpoints/ folder (its newest readable checkpoint)",
    )
