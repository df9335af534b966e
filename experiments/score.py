"""``aiayn score`` of a file of pairs, and its speed beside translate's: the first N pairs of a
source and reference file scored by the PyTorch engine (what ``aiayn score RUN --src --tgt``
computes, in this one process so that loading is not timed), and the same source lines
translated greedily and by beam search, with the same batch settings (the run's
``decode.batch_tokens``) and threads; ``translate --word-scores``'s extra pass timed too.
Rounds alternate the calls; sentences/s is the median round's. Also the agreement the docs
state: the model's greedy output (alpha 0), scored as text, against the log-probability
greedy search reported, over the lines whose text tokenises back to the tokens emitted.

    .venv/bin/python -m experiments.score --checkpoint runs/X/averaged.pt \\
        --source data/multi30k/val.en --target data/multi30k/val.de [--lines 1000]

Writes ``experiments/results/NAME.json`` and ``.md`` (or into ``--out``; NAME by default
``score-<host>``, :func:`benchmarks.common.host_slug`). ``--ctranslate2``: CTranslate2's
engine too (scores and greedy search), on a copy of the checkpoint exported in a temporary
folder. ``--quick``: 50 pairs, one round, into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host_slug, json_text, load_average, machine, versions  # noqa: E402

from experiments import add_output_options, output_folders  # noqa: E402

QUICK_LINES = 50


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(
    checkpoint: Path,
    source: Path,
    target: Path,
    lines: int,
    rounds: int,
    threads: int,
    ctranslate2: bool = False,
) -> dict[str, Any]:
    import torch

    from aiayn.inference.textio import read_lines
    from aiayn.inference.translator import Translator

    torch.set_num_threads(threads)
    src_lines, tgt_lines = read_lines(source)[:lines], read_lines(target)[:lines]
    greedy, _ = Translator.from_checkpoint(
        checkpoint, decode_overrides={"beam_size": 1, "alpha": 0.0}, process_settings=True
    )
    beam, _ = Translator.from_checkpoint(checkpoint, process_settings=True)
    sources = [greedy.encode_source(line) for line in src_lines]
    calls: dict[str, Callable[[], Any]] = {
        "score": lambda: greedy.score_pairs(src_lines, tgt_lines),
        "translate greedy": lambda: greedy.translations(greedy.search_ids(sources)),
        f"translate beam {beam.decode.beam_size}": lambda: beam.search_ids(sources),
    }
    ct2 = None
    if ctranslate2:  # exported beside a copy of the checkpoint: its folder stays as it is
        import shutil
        import tempfile

        from aiayn.interop.ct2_translator import Ct2Translator

        copy = Path(tempfile.mkdtemp(prefix="aiayn-score-")) / checkpoint.name
        shutil.copyfile(checkpoint, copy)
        ct2, _ = Ct2Translator.from_checkpoint(
            copy, decode_overrides={"beam_size": 1, "alpha": 0.0}, threads=threads
        )
        calls["score, CTranslate2"] = lambda: ct2.score_pairs(src_lines, tgt_lines)
        calls["translate greedy, CTranslate2"] = lambda: ct2.search_ids(sources)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    seconds["word scores of the greedy output"] = []
    results: dict[str, Any] = {}
    for name, call in calls.items():  # a warm-up of each score: first calls allocate
        if name.startswith("score"):
            call()
    for _ in range(rounds):
        for name, call in calls.items():
            took, results[name] = timed(call)
            seconds[name].append(took)
        took, results["word scores"] = timed(
            lambda: greedy.with_word_scores(sources, results["translate greedy"])
        )
        seconds["word scores of the greedy output"].append(took)
    speed = {
        name: {
            "seconds": [round(s, 3) for s in values],
            "sentences_per_s": round(len(src_lines) / statistics.median(values), 1),
        }
        for name, values in seconds.items()
    }
    # Agreement: greedy's own output scored as text, where it tokenises back to its tokens.
    outputs = [hyps[0] for hyps in results["translate greedy"]]
    back = [
        i for i, h in enumerate(outputs) if h.text and greedy.tokenizer.encode(h.text) == h.tokens
    ]
    rescored = greedy.score_pairs([src_lines[i] for i in back], [outputs[i].text for i in back])
    diffs = [abs(s.log_prob - outputs[i].log_prob) for i, s in zip(back, rescored, strict=True)]
    relative = [d / max(abs(outputs[i].log_prob), 1e-9) for i, d in zip(back, diffs, strict=True)]
    word_sums = [
        abs(sum(h[0].token_log_probs or []) - h[0].log_prob) for h in results["word scores"] if h
    ]
    refs = results["score"]
    engines = None
    if ct2 is not None:
        theirs = results["score, CTranslate2"]
        engines = max(
            abs(a - b)
            for x, y in zip(refs, theirs, strict=True)
            for a, b in zip(x.token_log_probs, y.token_log_probs, strict=True)
        )
    tokens = sum(len(s.token_log_probs) for s in refs)
    own = [s.mean for s in rescored]
    weakest = sorted(range(len(refs)), key=lambda i: refs[i].mean)[:5]
    return {
        "pairs": len(src_lines),
        "threads": threads,
        "batch_tokens": greedy.decode.batch_tokens,
        "beam": {"size": beam.decode.beam_size, "alpha": beam.decode.alpha},
        "speed": speed,
        "reference_tokens": tokens,
        "reference_log_prob_per_token": round(sum(s.log_prob for s in refs) / tokens, 4),
        "greedy_output_log_prob_per_token": round(statistics.fmean(own), 4) if own else None,
        "agreement": {
            "greedy_outputs": len(outputs),
            "tokenise_back": len(back),
            "max_abs_difference": max(diffs, default=0.0),
            "max_relative_difference": max(relative, default=0.0),
            "word_scores_max_abs_sum_difference": max(word_sums, default=0.0),
            "ctranslate2_max_abs_token_difference": engines,
        },
        "weakest_references": [
            {"line": i + 1, "mean": round(refs[i].mean, 3), "log_prob": round(refs[i].log_prob, 2)}
            for i in weakest
        ],
    }


def markdown(result: dict[str, Any]) -> str:
    r, a = result["result"], result["result"]["agreement"]
    rows = [
        f"| {name} | {v['sentences_per_s']:,.1f} | {' / '.join(f'{s:.2f}' for s in v['seconds'])} |"
        for name, v in r["speed"].items()
    ]
    weakest = ", ".join(f"line {w['line']} ({w['mean']:.2f})" for w in r["weakest_references"])
    return "\n".join(
        [
            "## `aiayn score` of Multi30k pairs, beside translate",
            "",
            f"{result['date']} · {result['machine']['cpu']} · {r['threads']} thread(s) · "
            f"load average before {result['load_before']}, after {result['load_after']} "
            f"(a shared machine) · torch {result['versions']['torch']} · checkpoint "
            f"`{result['checkpoint']}` · `{result['source']}` / `{result['target']}`, the "
            f"first {r['pairs']:,} pairs · batches of at most {r['batch_tokens']:,} padded "
            "tokens, as the run decodes",
            "",
            "| call (the same sentences) | sentences/s | seconds per round |",
            "|---|---:|---:|",
            *rows,
            "",
            f"`score`: the {r['pairs']:,} reference pairs ({r['reference_tokens']:,} target "
            "tokens with EOS), teacher-forced. `translate`: the same source lines, searched "
            f"(greedy; beam {r['beam']['size']}, α {r['beam']['alpha']}). `word scores`: the "
            "extra pass of `translate --word-scores` over the greedy outputs. `CTranslate2`: "
            "the checkpoint's float32 export, the same batches (`--engine ctranslate2`).",
            "",
            f"Log-probability per token: references {r['reference_log_prob_per_token']}, "
            f"the model's greedy outputs {r['greedy_output_log_prob_per_token']}. Weakest "
            f"references by mean log-probability: {weakest}.",
            "",
            f"Agreement: of {a['greedy_outputs']:,} greedy outputs (α 0), "
            f"{a['tokenise_back']:,} tokenise back to the tokens emitted; scored as text, "
            f"their log-probability differs from greedy search's by at most "
            f"{a['max_abs_difference']:.2e} (relative {a['max_relative_difference']:.2e}); "
            "the word scores of `translate --word-scores` sum to the search's log-probability "
            f"within {a['word_scores_max_abs_sum_difference']:.2e}."
            + (
                ""
                if a.get("ctranslate2_max_abs_token_difference") is None
                else " CTranslate2's token log-probabilities of the references differ from "
                f"PyTorch's by at most {a['ctranslate2_max_abs_token_difference']:.2e}."
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=1000, help="pairs (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="threads (default 1)")
    parser.add_argument(
        "--ctranslate2",
        action="store_true",
        help="also score and translate greedily with CTranslate2 (a copy of the checkpoint "
        "exported in a temporary folder)",
    )
    parser.add_argument("--name", help="results file name (default: score-<host>)")
    add_output_options(parser, f"{QUICK_LINES} pairs, one round")
    args = parser.parse_args(argv)
    folder, _ = output_folders(args)
    name = args.name or f"score-{host_slug()}"
    lines, rounds = (QUICK_LINES, 1) if args.quick else (args.lines, args.rounds)
    before = load_average()
    measured = measure(
        args.checkpoint, args.source, args.target, lines, rounds, args.threads, args.ctranslate2
    )
    result = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "versions": versions(),
        "load_before": before,
        "load_after": load_average(),
        "cpus": os.cpu_count(),
        "checkpoint": str(args.checkpoint),
        "source": args.source.name,
        "target": args.target.name,
        "result": measured,
    }
    (folder / f"{name}.json").write_text(json_text(result))
    text = markdown(result)
    (folder / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
