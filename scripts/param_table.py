"""Regenerate the Table 3 parameter-count table in docs/faithfulness.md.

Usage: .venv/bin/python scripts/param_table.py [--check]

Counts every Table 3 preset with a shared 37,000-token vocabulary (on the meta device, so
nothing is allocated) and rewrites the block between the two marker lines of the document.
With --check it only verifies that the document is up to date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from aiayn.config import load_config
from aiayn.model import Transformer, count_parameters
from aiayn.presets import PAPER_PARAMS_M, TABLE3_ROWS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_block import rewrite

DOC = Path(__file__).resolve().parent.parent / "docs" / "faithfulness.md"
BEGIN = "<!-- param-table:begin (scripts/param_table.py) -->"
END = "<!-- param-table:end -->"
VOCAB = 37000


def table() -> str:
    lines = [
        "| preset | N | d_model | d_ff | h | d_k | d_v | P_drop | ε_ls | positions "
        "| ours (M) | paper (M) | ours − paper (M) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in TABLE3_ROWS:
        config = load_config(overrides=[f"preset={name}", f"model.vocab_size={VOCAB}"])
        m = config.model
        with torch.device("meta"):
            count = count_parameters(Transformer(m))
        paper = PAPER_PARAMS_M.get(name)
        diff = f"{count / 1e6 - paper:+.2f}" if paper is not None else "–"
        lines.append(
            f"| `{name}` | {m.n_layers} | {m.d_model} | {m.d_ff} | {m.n_heads} | {m.head_dim_k} "
            f"| {m.head_dim_v} | {m.dropout} | {config.train.label_smoothing} | {m.positional} "
            f"| {count / 1e6:.2f} | {paper if paper is not None else '–'} | {diff} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the document")
    args = parser.parse_args()
    return rewrite(DOC, BEGIN, END, table(), check=args.check, script="scripts/param_table.py")


if __name__ == "__main__":
    sys.exit(main())
