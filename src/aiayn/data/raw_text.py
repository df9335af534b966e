"""Raw text files as ``aiayn prepare`` reads them, for every task: refused with a message
naming the file when they cannot be read as text (missing, a directory, gzip-compressed, UTF-16
or UTF-32), decoded line by line as strict UTF-8 (file, line and byte named on error) or with
replacement characters, and counted as ``for line in file`` counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Literal

from aiayn.errors import UserError

EncodingErrors = Literal["strict", "replace"]

# Characters Python's str.splitlines() treats as line ends: inside a sentence they would break
# the one-sentence-per-line text files for any reader that splits that way.
LINE_BREAKS = str.maketrans(dict.fromkeys("\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))

_GZIP_MAGIC = b"\x1f\x8b"
_WIDE_MARKS = (
    ("UTF-32", b"\xff\xfe\x00\x00"),
    ("UTF-32", b"\x00\x00\xfe\xff"),
    ("UTF-16", b"\xff\xfe"),
    ("UTF-16", b"\xfe\xff"),
)


def open_input(path: Path) -> BinaryIO:
    """``path`` open for reading bytes; a :class:`UserError` naming it where it is missing, not
    a file, unreadable, gzip-compressed or UTF-16/UTF-32 text."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a text file") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    start = handle.peek(4)[:4]
    if start[:2] == _GZIP_MAGIC:
        handle.close()
        raise UserError(f"{path}: the file is gzip-compressed: decompress it first (gunzip)")
    # UTF-32's marks first: UTF-32LE's starts with UTF-16LE's.
    wide = next((name for name, mark in _WIDE_MARKS if start.startswith(mark)), None)
    if wide is not None:
        handle.close()
        raise UserError(
            f"{path}: the file is {wide} text (it starts with that byte order mark); convert "
            f"it to UTF-8 first (iconv -f {wide} -t UTF-8)"
        )
    return handle


def decode_line(raw: bytes, path: Path, line_no: int, errors: EncodingErrors) -> tuple[str, bool]:
    """One line as text; ``(text, replaced)``. A byte order mark that starts the file is
    dropped. Strict mode names file, line and column of bytes that are not UTF-8 and of a
    NUL (a binary file?); ``replace`` mode makes each a U+FFFD."""
    try:
        text, replaced = raw.decode("utf-8"), False
    except UnicodeDecodeError as err:
        if errors == "strict":
            raise UserError(
                f"{path}, line {line_no}: invalid UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                f"{err.start + 1} of the line); fix the file or pass --encoding-errors replace"
            ) from None
        text, replaced = raw.decode("utf-8", errors="replace"), True
    if line_no == 1:
        text = text.removeprefix("\ufeff")
    if "\x00" in text:
        if errors == "strict":
            raise UserError(
                f"{path}, line {line_no}: a NUL byte (at byte {raw.index(0) + 1} of the line): "
                "is it a text file? Fix it or pass --encoding-errors replace"
            )
        text, replaced = text.replace("\x00", "\ufffd"), True
    return text, replaced


def count_lines(path: Path) -> int:
    """Lines as ``for line in file`` sees them: a last line without a newline counts too."""
    count = 0
    last = b"\n"
    with open_input(path) as handle:
        while block := handle.read(1 << 22):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")
