"""Terminology constraints on a trained model and real text, as Post & Vilar (2018) evaluate
them: for each line, one or two words of its reference that the unconstrained translation
misses become that line's constraints (``aiayn translate --constraints``). Reports the share of
constraints met, BLEU and chrF with and without them (``aiayn.evaluation.bleu``, sacreBLEU),
and sentences/s in batches of 64 lines with and without them, in interleaved rounds, at beam 4
and greedily (beam 1).

    .venv/bin/python -m experiments.constraints --checkpoint CKPT --source val.en \\
        --reference val.de [--rounds 2] [--threads 1] [--wait-quiet 60]

One process: the checkpoint is loaded as ``aiayn translate`` loads it (PyTorch engine, the run's
decode settings, ``--threads`` threads); the terms are drawn from its translations at beam 4.
Then for beam 4 and beam 1, warmed up on the first 32 lines, each round translates the whole
source in batches of 64 lines (one decoding batch each) without and then with the
constraints; the first round's translations are scored. A word is a
whitespace-separated word of the reference without the punctuation around it, at least two
letters, not a word of the unconstrained translation; a line whose reference has none gets no
constraint (and is translated as without the option). Met: the word's tokens appear in the
translation's tokens, as the search guarantees; also counted: the word as a whole word of the
translation's text (a constraint's last piece may be followed by more of a longer word).
Writes ``experiments/results/constraints-<host>.json`` and ``.md`` (``<host>``:
:func:`benchmarks.common.host_slug`; or into ``--out``). ``--quick``: the first 128 lines, one
round, into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    cpu_model,
    host_slug,
    json_text,
    load_average,
    versions,
    wait_for_quiet,
)

from experiments import add_output_options, open_engine, output_folders  # noqa: E402

WARMUP_LINES = 32
BATCH = 64
BEAM = 4  # the terms are drawn from this beam's unconstrained translations
BEAMS = (4, 1)
QUICK_LINES = 128
SEED = 0
_PUNCTUATION = "\"'.,;:!?()[]{}«»„“”‚‘’-–—/"


def words(text: str) -> list[str]:
    """The words of ``text``: split at whitespace, the punctuation around each dropped."""
    return [w for w in (raw.strip(_PUNCTUATION) for raw in text.split()) if w]


def pick_terms(reference: str, translation: str, rng: random.Random) -> list[str]:
    """One or two words of ``reference`` (at least two letters each) that ``translation``
    lacks, at random; none where it lacks none."""
    have = set(words(translation))
    missed = sorted(
        {w for w in words(reference) if w not in have and sum(c.isalpha() for c in w) >= 2}
    )
    if not missed:
        return []
    return rng.sample(missed, min(len(missed), rng.choice([1, 2])))


def contains(tokens: list[int], phrase: list[int]) -> bool:
    n = len(phrase)
    return any(tokens[i : i + n] == phrase for i in range(len(tokens) - n + 1))


def translate_in_batches(
    translator: Any, lines: list[str], constraints: list[list[str]] | None
) -> tuple[list[Any], float]:
    """The best hypothesis of each line, translated BATCH lines at a time, and the seconds."""
    out: list[Any] = []
    start = time.perf_counter()
    for first in range(0, len(lines), BATCH):
        chunk = lines[first : first + BATCH]
        given = constraints[first : first + BATCH] if constraints is not None else None
        for hyps in translator.translate_nbest(chunk, first + 1, constraints=given):
            out.append(hyps[0] if hyps else None)
    return out, time.perf_counter() - start


def met_counts(
    translator: Any, found: list[Any], texts: list[str], terms: list[list[str]]
) -> tuple[int, int]:
    """Constraints whose tokens are in the output, and those that are whole words of it."""
    tokens = whole = 0
    for hyp, text, line_terms in zip(found, texts, terms, strict=True):
        for term in line_terms:
            tokens += hyp is not None and contains(hyp.tokens, translator.encode_target(term))
            whole += term in words(text)
    return tokens, whole


def measure(args: argparse.Namespace, lines: list[str], references: list[str]) -> dict[str, Any]:
    from aiayn.config import replace
    from aiayn.evaluation.bleu import sacrebleu_bleu, sacrebleu_chrf

    warnings: list[str] = []
    overrides = {"beam_size": BEAM, "batch_tokens": 1 << 20}
    translator = open_engine(
        args.checkpoint, "torch", None, args.threads, overrides, process_settings=True
    )
    translator.warn = warnings.append
    translator.translate(lines[:WARMUP_LINES])
    first, _ = translate_in_batches(translator, lines, None)
    rng = random.Random(SEED)
    terms = [
        pick_terms(r, h.text if h else "", rng) for r, h in zip(references, first, strict=True)
    ]
    refs = [references]
    result: dict[str, Any] = {
        "beam_rule": translator.decode.beam_rule,
        "lines": len(lines),
        "lines_constrained": sum(bool(t) for t in terms),
        "constraints": sum(len(t) for t in terms),
        "words_per_line": {str(n): sum(len(t) == n for t in terms) for n in (0, 1, 2)},
        "beams": {},
    }
    for beam in BEAMS:
        translator.decode = replace(translator.decode, beam_size=beam)
        translator.translate(lines[:WARMUP_LINES], constraints=terms[:WARMUP_LINES])
        times: dict[str, list[float]] = {"without": [], "with": []}
        texts: dict[str, list[str]] = {}
        for round_ in range(args.rounds):
            for kind, given in (("without", None), ("with", terms)):
                found, seconds = translate_in_batches(translator, lines, given)
                times[kind].append(seconds)
                if round_ == 0:
                    texts[kind] = [h.text if h else "" for h in found]
                    if given is not None:
                        met_tokens, met_words = met_counts(translator, found, texts[kind], terms)
        speed = {k: [len(lines) / s for s in v] for k, v in times.items()}
        result["beams"][str(beam)] = {
            "met_tokens": met_tokens,
            "met_words": met_words,
            "unconstrained_lines_unchanged": sum(
                a == b
                for a, b, t in zip(texts["without"], texts["with"], terms, strict=True)
                if not t
            ),
            "bleu": {k: sacrebleu_bleu(v, refs).score for k, v in texts.items()},
            "chrf": {k: sacrebleu_chrf(v, refs).score for k, v in texts.items()},
            "sentences_per_s": {k: statistics.median(v) for k, v in speed.items()},
            "rounds": {k: [round(x, 2) for x in v] for k, v in speed.items()},
            "examples": [
                {"line": i + 1, "terms": terms[i], **{k: v[i] for k, v in texts.items()}}
                for i in [j for j, t in enumerate(terms) if t][:4]
            ],
        }
    result["warnings"] = len(warnings)
    return result


def markdown(report: dict[str, Any]) -> str:
    r = report["result"]
    n = max(1, r["constraints"])
    lines = [
        "## Terminology constraints: met, BLEU and speed",
        "",
        f"{report['date']} · {report['cpu']} · {report['threads']} thread(s) · PyTorch "
        f"{report['versions'].get('torch', '?')} · checkpoint `{report['checkpoint']}` · "
        f"`{report['source']}` against `{report['reference']}` · the run's beam rule "
        f"(`{r['beam_rule']}`), batches of {BATCH} lines · {report['rounds']} round(s) · "
        f"load average {report['load_before']} before, {report['load_after']} after (a "
        f"shared machine: {report['load_note']})",
        "",
        f"Constraints: {r['constraints']:,} words on {r['lines_constrained']:,} of "
        f"{r['lines']:,} lines (lines with 0 / 1 / 2 words: {r['words_per_line']['0']:,} / "
        f"{r['words_per_line']['1']:,} / {r['words_per_line']['2']:,}), each a word of the "
        f"line's reference that the unconstrained translation at beam {BEAM} lacks.",
        "",
        "| beam | constraints met (tokens) | met as whole words | BLEU without → with | "
        f"chrF without → with | sentences/s, batches of {BATCH}: without → with |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for beam, b in r["beams"].items():
        speed = b["sentences_per_s"]
        lines.append(
            f"| {beam} | {b['met_tokens']:,} of {r['constraints']:,} "
            f"({100 * b['met_tokens'] / n:.1f}%) | {b['met_words']:,} "
            f"({100 * b['met_words'] / n:.1f}%) | {b['bleu']['without']:.2f} → "
            f"{b['bleu']['with']:.2f} | {b['chrf']['without']:.2f} → {b['chrf']['with']:.2f} | "
            f"{speed['without']:.1f} → {speed['with']:.1f} "
            f"({speed['with'] / speed['without']:.2f}×) |"
        )
    lines += [
        "",
        "Sentences/s are the median of the rounds; by round: "
        + "; ".join(
            f"beam {beam} without {b['rounds']['without']}, with {b['rounds']['with']}"
            for beam, b in r["beams"].items()
        )
        + ". Lines without constraints whose translation is unchanged: "
        + ", ".join(
            f"{b['unconstrained_lines_unchanged']:,} of "
            f"{r['lines'] - r['lines_constrained']:,} at beam {beam}"
            for beam, b in r["beams"].items()
        )
        + f". Warnings (constraints beyond a line's length limit): {r['warnings']}.",
        "",
        "Examples:",
        "",
    ]
    for beam, b in r["beams"].items():
        for e in b["examples"]:
            lines.append(
                f"- beam {beam}, line {e['line']}, constraints {e['terms']}: without "
                f"«{e['without']}», with «{e['with']}»"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    parser.add_argument(
        "--load-note",
        default="2 cores, other sessions' tests and a training run beside it",
        help="what else ran on the machine, for the report",
    )
    parser.add_argument("--name", help="results file name (default: constraints-<host>)")
    add_output_options(parser, f"the first {QUICK_LINES} lines, one round")
    args = parser.parse_args(argv)
    folder, _ = output_folders(args)
    from aiayn.inference.textio import read_lines

    lines, references = read_lines(args.source), read_lines(args.reference)
    if args.quick:
        lines, references, args.rounds = lines[:QUICK_LINES], references[:QUICK_LINES], 1
    waited = wait_for_quiet(args.wait_quiet) if args.wait_quiet else 0.0
    load_before = load_average()
    result = measure(args, lines, references)
    report = {
        "date": dt.date.today().isoformat(),
        "cpu": cpu_model(),
        "threads": args.threads,
        "versions": versions(),
        "checkpoint": str(args.checkpoint),
        "source": args.source.name,
        "reference": args.reference.name,
        "rounds": args.rounds,
        "waited_s": waited,
        "load_before": load_before,
        "load_after": load_average(),
        "load_note": args.load_note,
        "result": result,
    }
    name = args.name or f"constraints-{host_slug()}"
    saved = json_text(report)
    (folder / f"{name}.json").write_text(saved)
    text = markdown(json.loads(saved))  # what the committed JSON renders to
    (folder / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
