"""What a long job tells the user while it runs: messages, and meters for counted stages.

On a terminal a meter redraws one line in place (count, rate, time left); elsewhere (a log
file, a pipe) it writes nothing until its stage ends, then one summary line with the count,
the time and the rate. A job that is given a plain function instead of a :class:`Report`
passes its messages and the stages' summary lines to it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

Log = Callable[[str], None]

_REDRAW_SECONDS = 0.1


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` with thousands separators and ``noun`` in the number ``n`` takes: "1 line",
    "2,000 lines" (``plural``, where it is not ``noun`` + "s")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def parameter_count(n: int) -> str:
    """ "44.1M parameters"; below a million, the count itself ("45,952 parameters")."""
    return f"{n / 1e6:.1f}M parameters" if n >= 1_000_000 else counted(n, "parameter")


def clock(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Report:
    """Messages and meters, written to ``stream`` (each line after ``prefix``), or handed to
    ``log``; with neither, nothing is written."""

    def __init__(
        self, prefix: str = "", stream: TextIO | None = None, log: Log | None = None
    ) -> None:
        self.prefix = prefix
        self.stream = stream
        self.log = log
        self.tty = stream is not None and bool(getattr(stream, "isatty", lambda: False)())
        self._drawn = False

    def __call__(self, message: str) -> None:
        self.write(message)

    def write(self, message: str, transient: bool = False) -> None:
        """A line; a transient one is redrawn in place on a terminal and dropped elsewhere."""
        if transient and not self.tty:
            return
        if self.stream is not None:
            erase = "\r\033[K" if self.tty and self._drawn else ""
            end = "" if transient else "\n"
            self.stream.write(erase + self.prefix + message + end)
            self.stream.flush()
            self._drawn = transient
        elif self.log is not None:
            self.log(message)

    def meter(self, label: str, total: int, unit: str = "lines", scale: int = 1) -> Meter:
        """A meter for a stage of ``total`` items (0: unknown), shown in ``unit`` of ``scale``
        items (bytes in MB: ``unit="MB", scale=10**6``)."""
        return Meter(self, label, total, unit, scale)

    @contextlib.contextmanager
    def stage(self, message: str) -> Iterator[None]:
        """Say ``message`` now and how long the stage took when it ends (not when it fails)."""
        self.write(message)
        start = time.monotonic()
        yield
        self.write(f"{message}: done in {time.monotonic() - start:.1f} s")


class Meter:
    """The progress of one stage counted in ``unit``; see :class:`Report`."""

    def __init__(self, report: Report, label: str, total: int, unit: str, scale: int = 1) -> None:
        self.report = report
        self.label = label
        self.total = total
        self.unit = unit
        self.scale = scale
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.report.tty:
            return
        now = time.monotonic()
        if now - self._last_draw < _REDRAW_SECONDS and self.done < self.total:
            return
        self._last_draw = now
        rate = self.done / max(now - self.start, 1e-9)
        count, unit = self._count, self.unit
        if self.total > 0:
            left = (self.total - self.done) / max(rate, 1e-9)
            share = 100.0 * self.done / self.total
            line = (
                f"{self.label}: {count(self.done)}/{count(self.total)} {unit} ({share:.0f}%), "
                f"{count(rate)} {unit}/s, {clock(left)} left"
            )
        else:
            line = f"{self.label}: {count(self.done)} {unit}, {count(rate)} {unit}/s"
        self.report.write(line, transient=True)

    def _count(self, n: float) -> str:
        return f"{n:,.0f}" if self.scale == 1 else f"{n / self.scale:,.1f}"

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start

    def finish(self, message: str | None = None) -> None:
        """End the stage with ``message``, by default the count, the time and the rate."""
        if message is None:
            seconds = self.seconds
            rate = self.done / max(seconds, 1e-9)
            message = (
                f"{self.label}: {self._count(self.done)} {self.unit} in {seconds:.1f} s "
                f"({self._count(rate)} {self.unit}/s)"
            )
        self.report.write(message)


def as_report(log: Log | Report | None) -> Report:
    """``log`` as a :class:`Report` (a plain function gets the messages and summary lines)."""
    if isinstance(log, Report):
        return log
    return Report(log=log)


def stderr_report(prefix: str = "") -> Report:
    return Report(prefix, sys.stderr)
