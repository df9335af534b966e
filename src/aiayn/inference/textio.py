"""Reading plain UTF-8 text, one sentence a line, with errors that name the line."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from aiayn.errors import UserError


def split_lines(data: bytes, name: str) -> list[str]:
    """The lines of ``data``: split at ``\\n`` only (a trailing newline ends the last line, it
    does not start a new one), a final ``\\r`` dropped, a byte order mark at the start
    dropped; invalid UTF-8 names its line."""
    if not data:
        return []
    raw = data.split(b"\n")
    if raw[-1] == b"":
        raw.pop()
    return [decode_line(line, name, number) for number, line in enumerate(raw, start=1)]


def decode_line(line: bytes, name: str, number: int) -> str:
    """Line ``number`` of ``name``, without its ``\\n`` and a final ``\\r`` (and, the first, a
    byte order mark); UserError naming the line and byte where it is not UTF-8."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{name}: line {number} is not valid UTF-8 (byte {err.start + 1}: "
            f"{line[err.start : err.start + 1]!r})"
        ) from None
    text = text.removesuffix("\n")
    if number == 1:
        text = text.removeprefix("\ufeff")  # a byte order mark that starts the file
    return text[:-1] if text.endswith("\r") else text


def read_input(path: str | Path | None) -> list[str]:
    """The lines of the file ``path``, or of stdin where it is None or ``-``."""
    if path is None or str(path) == "-":
        return split_lines(sys.stdin.buffer.read(), "stdin")
    return read_lines(path)


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (see :func:`split_lines`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror}") from None
    return split_lines(data, str(path))


def checked_lines(lines: Iterable[object], call: str) -> list[str]:
    """The lines of a method that takes a sequence of them, as a list (an iterator is read
    once); a TypeError where it is one string (each of its characters would be a line) or a
    line is no string (bytes, None)."""
    if isinstance(lines, (str, bytes, bytearray)):
        kind = "one string" if isinstance(lines, str) else type(lines).__name__
        raise TypeError(f"{call} takes a list of lines, not {kind}: {call}([text])")
    out = list(lines)
    for number, line in enumerate(out, 1):
        if not isinstance(line, str):
            raise TypeError(f"{call}: line {number} is {type(line).__name__}, not str")
    return out  # type: ignore[return-value]


def one_line(text: str) -> str:
    """``text`` with line breaks turned into spaces, so that one output stays one line."""
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


# The share of non-empty source lines whose translation is empty above which a command says so:
# a trained model almost never ends a translation at once; a briefly trained one often does.
EMPTY_SHARE = 0.2


def empty_translation_advice(asked: int, empty: int, beam_size: int) -> str | None:
    """What to say when ``empty`` of ``asked`` non-empty source lines got an empty translation
    and that is more than :data:`EMPTY_SHARE` of them (None otherwise)."""
    if asked == 0 or empty <= EMPTY_SHARE * asked:
        return None
    beam = (
        f"; beam search (beam {beam_size}) prefers ending at once to a long uncertain "
        "translation: --beam 1 (or decode.beam_size=1) shows what the model emits"
        if beam_size > 1
        else ""
    )
    return (
        f"{empty:,} of {asked:,} non-empty lines have an empty translation: the model ends "
        f"them at once, as one trained too briefly does; train longer{beam}"
    )
