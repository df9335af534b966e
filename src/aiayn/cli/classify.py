"""``aiayn classify``: class probabilities of texts with an encoder-only classifier, or its
accuracy, macro-F1 and confusion matrix on a prepared split."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.cli.paths import add_checkpoint_argument, check_output_file
from aiayn.errors import CLIError

if TYPE_CHECKING:
    from aiayn.inference.classifier import TextClassifier


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "classify",
        help="classify texts, or score a classifier on a prepared split",
        description="With texts (one a line, from --input or stdin): print "
        "'label<TAB>probability' per line (--top K: the K best as label:probability pairs; an "
        "empty line gives an empty line). "
        "With --data: classify a split of a directory prepared by `aiayn prepare --task "
        "classify`, print accuracy, macro-F1 and per-class scores, and with --confusion write "
        "the confusion matrix as a PNG.",
    )
    add_checkpoint_argument(parser)
    parser.add_argument(
        "--input", "-i", metavar="FILE", help="texts, one a line (default, or -: stdin)"
    )
    parser.add_argument("--top", type=int, metavar="K", help="classes shown per text (default 1)")
    parser.add_argument("--data", metavar="DATA_DIR", help="score on a prepared split")
    parser.add_argument("--split", help="the split of --data (default test)")
    parser.add_argument("--confusion", metavar="PNG", help="with --data: confusion-matrix picture")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.devices import pick_device
    from aiayn.inference.classifier import TextClassifier
    from aiayn.inference.textio import read_input

    if args.data:
        given = [f"--{name}" for name in ("input", "top") if getattr(args, name) is not None]
        if given:
            verb = "go" if len(given) > 1 else "goes"
            raise CLIError(f"{' and '.join(given)} {verb} with texts to classify, not --data")
        if args.confusion:
            check_output_file(Path(args.confusion), "--confusion")
    else:
        given = [f"--{name}" for name in ("split", "confusion") if getattr(args, name) is not None]
        if given:
            raise CLIError(
                f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with --data"
            )
    top = 1 if args.top is None else args.top
    if top < 1:
        raise CLIError(f"--top must be at least 1, got {top}")
    classifier = TextClassifier.from_checkpoint(args.checkpoint, pick_device(args.device or "auto"))
    if args.data:
        return _score(classifier, Path(args.data), args.split or "test", args.confusion)
    lines = read_input(args.input)
    # Empty lines (white space only) give empty output lines, as translate's do.
    numbers = [number for number, line in enumerate(lines, start=1) if line.strip()]
    texts = [lines[number - 1] for number in numbers]
    rows = iter(classifier.probabilities(texts, numbers)) if texts else iter(())
    k = min(top, len(classifier.labels))
    for line in lines:
        if not line.strip():
            print()
            continue
        best = next(rows).topk(k)
        pairs = [(classifier.labels[int(i)], float(p)) for p, i in zip(*best, strict=True)]
        if k == 1:
            print(f"{pairs[0][0]}\t{pairs[0][1]:.4f}")
        else:
            print("\t".join(f"{name}:{p:.4f}" for name, p in pairs))
    return 0


def _score(classifier: TextClassifier, data_dir: Path, split: str, confusion: str | None) -> int:
    from aiayn.data.text import TextCorpus
    from aiayn.evaluation.classification import (
        classification_scores,
        confusion_matrix,
        plot_confusion,
    )

    corpus = TextCorpus.open(data_dir, split)
    if corpus.labels is None:
        raise CLIError(f"{data_dir} has no labels (prepare it with --task classify)")
    if list(corpus.label_names) != classifier.labels:
        raise CLIError(
            f"the classes of {data_dir} ({', '.join(corpus.label_names)}) are not the "
            f"model's ({', '.join(classifier.labels)})"
        )
    predicted = classifier.probabilities(corpus.texts()).argmax(dim=-1).tolist()
    matrix = confusion_matrix(corpus.labels.tolist(), predicted, len(classifier.labels))
    scores = classification_scores(matrix)
    print(
        f"{split}: {len(predicted):,} texts, accuracy {scores.accuracy:.4f}, "
        f"macro-F1 {scores.macro_f1:.4f}"
    )
    print(f"{'class':<16} {'precision':>9} {'recall':>9} {'F1':>9} {'support':>8}")
    for name, p, r, f, n in zip(
        classifier.labels, scores.precision, scores.recall, scores.f1, scores.support, strict=True
    ):
        print(f"{name:<16} {p:>9.4f} {r:>9.4f} {f:>9.4f} {n:>8,}")
    if confusion:
        title = f"{data_dir.name} {split}: accuracy {scores.accuracy:.3f}, "
        title += f"macro-F1 {scores.macro_f1:.3f}"
        path = plot_confusion(matrix, classifier.labels, confusion, title)
        print(f"confusion matrix: {path}", file=sys.stderr)
    return 0
