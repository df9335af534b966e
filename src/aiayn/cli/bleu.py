"""``aiayn bleu``: sacreBLEU and chrF of a hypothesis file against reference files."""

from __future__ import annotations

import argparse

from aiayn.errors import CLIError, UserError


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bleu",
        help="score translations with sacreBLEU and chrF",
        description="Corpus BLEU and chrF (sacreBLEU, on detokenised text) of HYPOTHESES "
        "(a file, or - for stdin) against one or more REFERENCES files, one sentence a line, "
        "with their signatures. "
        "--tokenized adds the paper-style tokenised BLEU (13a tokens, hyphenated compounds "
        "split, no smoothing), which is not comparable with sacreBLEU.",
    )
    parser.add_argument(
        "hypotheses", metavar="HYPOTHESES", help="translations, one a line; - reads stdin"
    )
    parser.add_argument(
        "references", metavar="REFERENCES", nargs="+", help="reference translations, one a line"
    )
    parser.add_argument(
        "--tokenized",
        action="store_true",
        help="also print the paper-style tokenised BLEU, labelled as such",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.evaluation.bleu import score_corpus
    from aiayn.inference.textio import read_input, read_lines
    from aiayn.progress import counted

    if "-" in args.references:
        raise CLIError("the references are files; only HYPOTHESES may be - (stdin)")
    hypotheses = read_input(args.hypotheses)
    name = "stdin" if args.hypotheses == "-" else args.hypotheses
    if not hypotheses:
        raise UserError(f"{name} has no lines: nothing to score")
    references = []
    for path in args.references:
        lines = read_lines(path)
        if len(lines) != len(hypotheses):
            raise UserError(
                f"{path} has {counted(len(lines), 'line')} but {name} has {len(hypotheses):,}"
            )
        references.append(lines)
    for score in score_corpus(hypotheses, references, tokenized=args.tokenized):
        print(score.line)
    return 0
