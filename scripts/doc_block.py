"""Rewrite (or check) the generated block between two marker lines of a document."""

from __future__ import annotations

import sys
from pathlib import Path


def rewrite(doc: Path, begin: str, end: str, body: str, *, check: bool, script: str) -> int:
    """Put ``body`` between the lines ``begin`` and ``end`` of ``doc``. With ``check``, write
    nothing and return 1 (saying which ``script`` regenerates it) where the block differs."""
    text = doc.read_text(encoding="utf-8")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    updated = f"{head}{begin}\n{body}\n{end}{tail}"
    if check:
        if updated != text:
            print(f"{doc} is out of date: run {script}", file=sys.stderr)
            return 1
        return 0
    doc.write_text(updated, encoding="utf-8")
    return 0
