"""Regenerate the list of speed levers in docs/performance.md from ``aiayn.accel.levers``.

Usage: .venv/bin/python scripts/lever_list.py [--check]

The list lives in one place, the code; the document shows it between two marker lines. With
--check it only verifies that the document is up to date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiayn.accel.levers import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import rewrite

DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
BEGIN = "<!-- levers:begin (scripts/lever_list.py) -->"
END = "<!-- levers:end -->"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the document")
    args = parser.parse_args()
    body = markdown_table().rstrip("\n")
    return rewrite(DOC, BEGIN, END, body, check=args.check, script="scripts/lever_list.py")


if __name__ == "__main__":
    sys.exit(main())
