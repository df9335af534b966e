"""n-best lists of aiayn's PyTorch engine and of its CTranslate2 engine on the same checkpoint:
beam 4 by the fairseq rule (the rule the CTranslate2 engine decodes by), 4 hypotheses a line,
one thread each. Counts the lines whose best hypothesis is identical, the n-best entries that
are identical (tokens, position by position), lists of another length, scores that are not
finite, and lists each line that differs with both engines' hypotheses.

    .venv/bin/python -m experiments.ct2_nbest --checkpoint runs/multi30k \\
        --source data/multi30k/valid.en [--name ct2-nbest-<host>]

Writes ``experiments/results/NAME.json`` and ``.md`` (or into ``--out``; NAME by default
``ct2-nbest-<host>``, :func:`benchmarks.common.host_slug`). ``--quick``: the first 10 lines,
into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import host_slug, json_text, machine  # noqa: E402

from experiments import add_output_options, output_folders  # noqa: E402

BEAM = 4
QUICK_LINES = 10


def compare(checkpoint: Path, source: Path) -> dict[str, Any]:
    import torch

    from aiayn.inference.textio import read_lines
    from aiayn.inference.translator import Translator
    from aiayn.interop.ct2_translator import Ct2Translator

    torch.set_num_threads(1)
    lines = read_lines(source)
    settings = {"beam_size": BEAM, "beam_rule": "fairseq"}
    ours, _ = Translator.from_checkpoint(checkpoint, decode_overrides=settings, nbest=BEAM)
    theirs, _ = Ct2Translator.from_checkpoint(
        checkpoint, decode_overrides=settings, nbest=BEAM, threads=1
    )
    a, b = ours.translate_nbest(lines), theirs.translate_nbest(lines)
    decode = ours.decode
    differing = []
    for number, (mine, other) in enumerate(zip(a, b, strict=True), 1):
        if [h.tokens for h in mine] != [h.tokens for h in other]:
            length = len(ours.tokenizer.encode(lines[number - 1]))
            differing.append(
                {
                    "line": number,
                    "limit": math.floor(length * decode.max_len_a + decode.max_len_b),
                    "aiayn": [(len(h.tokens), round(h.score, 5)) for h in mine],
                    "ctranslate2": [(len(h.tokens), round(h.score, 5)) for h in other],
                }
            )
    return {
        "lines": len(lines),
        "best_identical": sum(x[0].tokens == y[0].tokens for x, y in zip(a, b, strict=True)),
        "entries": sum(len(x) for x in a),
        "entries_identical": sum(
            p.tokens == q.tokens
            for x, y in zip(a, b, strict=True)
            for p, q in zip(x, y, strict=False)
        ),
        "lists_of_another_length": sum(len(x) != len(y) for x, y in zip(a, b, strict=True)),
        "scores_not_finite": sum(not math.isfinite(q.score) for y in b for q in y),
        "differing": differing,
    }


def markdown(result: dict[str, Any]) -> str:
    m, r = result["machine"], result["result"]
    lines = [
        "## n-best lists of aiayn's PyTorch engine and its CTranslate2 engine",
        "",
        f"{result['date']} · {m['cpu']} · checkpoint `{result['checkpoint']}` · "
        f"`{result['source']}` · beam {BEAM}, fairseq rule, {BEAM} hypotheses a line",
        "",
        "| lines | best identical | n-best entries identical | lists of another length | "
        "scores not finite |",
        "|---:|---:|---:|---:|---:|",
        f"| {r['lines']:,} | {r['best_identical']:,} | {r['entries_identical']:,} of "
        f"{r['entries']:,} | {r['lists_of_another_length']} | {r['scores_not_finite']} |",
        "",
    ]
    for d in r["differing"]:
        lines.append(
            f"- line {d['line']} (output limit {d['limit']}): aiayn (length, score) "
            f"{d['aiayn']}; CTranslate2 {d['ctranslate2']}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--name", help="results file name (default: ct2-nbest-<host>)")
    add_output_options(parser, f"the first {QUICK_LINES} lines")
    args = parser.parse_args(argv)
    folder, _ = output_folders(args)
    name = args.name or f"ct2-nbest-{host_slug()}"
    source = args.source
    if args.quick:
        lines = source.read_text(encoding="utf-8").splitlines()[:QUICK_LINES]
        source = folder / f"quick{source.suffix}"
        source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "checkpoint": args.checkpoint.name,
        "source": args.source.name,
        "result": compare(args.checkpoint, source),
    }
    (folder / f"{name}.json").write_text(json_text(result))
    text = markdown(result)
    (folder / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
