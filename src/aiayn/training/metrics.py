"""What a person and a plot read: ``metrics.jsonl``, TensorBoard events, a stderr progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from aiayn.progress import clock
from aiayn.training.storage import writing

METRICS_NAME = "metrics.jsonl"


def perplexity(nll_per_token: float) -> float:
    """exp(NLL per token), capped to stay finite in JSON."""
    return math.exp(min(nll_per_token, 100.0))


class MetricsLog:
    """Appends one JSON object per line to ``RUN_DIR/metrics.jsonl`` (and TensorBoard events
    under ``RUN_DIR/tensorboard`` when the ``tensorboard`` package is installed).

    Every record has ``kind`` (``"train"`` or ``"valid"``) and ``step``; numbers only besides.
    On ranks other than 0 it writes nothing.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_NAME
        self._writer: Any = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self._writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict[str, Any], replace: bool = False) -> None:
        """Append ``record``; with ``replace``, first drop the records of the same kind and
        step (a result computed again, e.g. the average of a finished run that is run again)."""
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in record.items()}
        if replace:
            kind, step = clean.get("kind"), int(clean.get("step", 0))
            self._keep_only(lambda r: r.get("kind") != kind or int(r.get("step", 0)) != step)
        line = json.dumps(clean, sort_keys=False) + "\n"
        with writing(self.path, "the metrics log", len(line)):
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(line)
        if self._writer is not None:
            kind, step = clean.get("kind", "train"), int(clean.get("step", 0))
            for key, value in clean.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)):
                    self._writer.add_scalar(f"{kind}/{key}", value, step)
            self._writer.flush()

    def drop_after(self, step: int) -> int:
        """Forget the records of updates after ``step`` (a resumed run redoes them); returns
        how many were dropped."""
        return self._keep_only(lambda r: int(r.get("step", 0)) <= step)

    def _keep_only(self, keep: Callable[[dict[str, Any]], bool]) -> int:
        """Rewrite the file (atomically) with the records that ``keep`` accepts, dropping torn
        lines too (a torn last line would swallow the next record); returns how many went."""
        if not self.enabled or not self.path.is_file():
            return 0
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            if keep(record):
                kept.append(line)
        if len(kept) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w", encoding="utf-8") as handle:
                handle.write("".join(k + "\n" for k in kept))
                handle.flush()
                os.fsync(handle.fileno())
            tmp.replace(self.path)
        return len(lines) - len(kept)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (a torn last line is skipped)."""
    path = Path(run_dir) / METRICS_NAME
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Progress:
    """A one-line progress display on stderr: a bar, loss, learning rate, tokens/s, ETA;
    and messages (validation results, checkpoints) between the progress lines.

    The bar follows whichever limit is nearer: ``total_steps`` updates or ``total_minutes``
    of training (0 = no such limit). On a terminal the line is redrawn in place; otherwise
    (a log file) one line per call.
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None = None,
        enabled: bool = True,
        bar: bool = True,
        total_minutes: float = 0.0,
    ) -> None:
        self.total = total_steps
        self.total_minutes = total_minutes
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled  # False: nothing at all (ranks other than 0)
        self.bar = bar  # False: messages only, no progress lines
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.begin(0)

    def begin(self, step: int) -> None:
        """Start the ETA's clock now, at update ``step`` (0, or where a run resumes): the ETA
        is the time per update done since then."""
        self.start = time.monotonic()
        self.start_step = step

    def update(
        self,
        step: int,
        epoch: int,
        loss: float,
        nll: float,
        lr: float,
        tps: float,
        minutes: float | None = None,
    ) -> None:
        """Draw the line; ``minutes`` is the run's training time so far (resumes included)."""
        if not (self.enabled and self.bar):
            return
        elapsed = time.monotonic() - self.start
        run_seconds = minutes * 60.0 if minutes is not None else elapsed
        done = step - self.start_step
        fracs, etas = [], []
        if self.total > 0:
            fracs.append(step / self.total)
            if done > 0:
                etas.append(elapsed / done * max(self.total - step, 0))
        if self.total_minutes > 0:
            fracs.append(run_seconds / (60.0 * self.total_minutes))
            etas.append(max(60.0 * self.total_minutes - run_seconds, 0.0))
        frac = min(1.0, max(fracs)) if fracs else 0.0
        eta = min(etas) if etas else 0.0
        width = 20
        filled = int(frac * width)
        of_total = f"/{self.total}" if self.total > 0 else ""
        line = (
            f"[{'#' * filled}{'-' * (width - filled)}] {step}{of_total} ep {epoch} | "
            f"loss {loss:.3f} nll {nll:.3f} ppl {perplexity(nll):.1f} | lr {lr:.2e} | "
            f"{tps:,.0f} tok/s | {clock(run_seconds)} eta {clock(eta)}"
        )
        self.write(line, transient=True)

    def write(self, message: str, transient: bool = False) -> None:
        """A line; a transient one is redrawn in place on a terminal."""
        if not self.enabled:
            return
        if self.tty and transient:
            self.stream.write("\r\033[K" + message)
        elif self.tty:
            self.stream.write("\r\033[K" + message + "\n")
        else:
            self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.bar and self.tty:
            self.stream.write("\n")
            self.stream.flush()
