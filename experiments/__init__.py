"""Experiments: the scripts that reproduce the figures of the paper and of docs/, one a file,
each listed in experiments/README.md with its command, what it writes and how long it takes.
Run them from the repository root as ``.venv/bin/python -m experiments.NAME``.

Each writes its results into ``experiments/results`` (figures into ``docs/images``), or into
``--out``; ``--quick`` runs it at its smallest settings into a new temporary folder, so that a
smoke run never overwrites the committed results.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
IMAGES = ROOT / "docs" / "images"


def add_output_options(parser: argparse.ArgumentParser, quick: str) -> None:
    """``--out`` and ``--quick`` (``quick``: what the smallest settings are)."""
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the results and figures (default: experiments/results and "
        "docs/images; with --quick, a new temporary folder)",
    )
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")


def output_folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """The folders for the results and for the figures, made if missing: ``--out`` for both
    where given, a new temporary folder for a ``--quick`` run, else the committed ones."""
    if args.out is None and args.quick:
        args.out = Path(tempfile.mkdtemp(prefix="aiayn-experiment-"))
        print(f"--quick: writing into {args.out}", file=sys.stderr, flush=True)
    results, images = (args.out, args.out) if args.out is not None else (RESULTS, IMAGES)
    results.mkdir(parents=True, exist_ok=True)
    images.mkdir(parents=True, exist_ok=True)
    return results, images


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker process: this checkout's sources first, ``threads`` threads."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), out.get("PYTHONPATH", "")])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        out[name] = str(threads)
    return out


def bleu(hypotheses: Path, reference: Path) -> tuple[float, float]:
    """sacreBLEU and chrF as ``aiayn bleu`` prints them."""
    done = subprocess.run(
        [sys.executable, "-m", "aiayn", "bleu", str(hypotheses), str(reference)],
        capture_output=True, text=True, env=worker_env(1), check=True,
    )  # fmt: skip
    # "BLEU|... = 31.05 64.5/39.2/... (BP = ...)", then "chrF2|... = 53.82"
    scores = [float(line.split(" = ")[1].split()[0]) for line in done.stdout.splitlines()[:2]]
    return scores[0], scores[1]


def head(path: Path, out: Path, lines: int) -> Path:
    """The first ``lines`` lines of ``path``, written to ``out``."""
    kept = path.read_text(encoding="utf-8").splitlines()[:lines]
    out.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return out


def open_engine(
    checkpoint: str | Path,
    engine: str,
    quantize: str | None,
    threads: int,
    overrides: dict[str, Any],
    process_settings: bool = False,
) -> Any:
    """A translator of ``checkpoint`` on the CPU: aiayn's own (``engine`` ``"torch"``) on
    ``threads`` threads, or CTranslate2's (``"ctranslate2"``) with its ``quantize`` weights."""
    if engine == "torch":
        import torch

        from aiayn.inference.translator import Translator

        torch.set_num_threads(threads)
        return Translator.from_checkpoint(
            checkpoint,
            device="cpu",
            decode_overrides=overrides,
            process_settings=process_settings,
        )[0]
    from aiayn.interop.ct2_translator import Ct2Translator

    return Ct2Translator.from_checkpoint(
        checkpoint, decode_overrides=overrides, quantize=quantize, threads=threads
    )[0]
