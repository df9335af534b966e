"""A trained model exported to Hugging Face transformers (``aiayn export-hf``) against aiayn's
own engine on real text: lines identical, token for token and as text, with greedy search and
beam 4, the BLEU and chrF of each, and the teacher-forced logits' largest difference.

    .venv/bin/python -m experiments.hf_export --checkpoint runs/X/averaged.pt \\
        --source val.en --reference val.de

The checkpoint is exported (with ``--evaluate SOURCE REFERENCE``, so the model card carries
aiayn's scores on them) into a scratch folder; ``MarianMTModel.from_pretrained`` and
``MarianTokenizer.from_pretrained`` load it. aiayn translates with ``Translator`` (the run's
decode settings, overridden per mode); transformers with ``generate``, one batch per source
length so that every sentence gets aiayn's output limit (``max_len_a`` · source tokens +
``max_len_b``, as ``max_new_tokens``, EOS forced after it as aiayn forces it). Three modes:

- greedy: both searches pick the most probable token;
- beam 4 as each library's settings say: aiayn's run settings (its length penalty α and
  beam rule) against the exported ``generation_config.json`` (``length_penalty`` α,
  ``early_stopping=False``): not the same rule;
- beam 4 where the rules agree: aiayn with α = 0 and the fairseq rule, transformers with
  ``length_penalty=0``, ``early_stopping=True`` and no forced EOS.

One thread each. Writes ``experiments/results/hf-export-<host>.json`` and ``.md`` (the model
card as written at its end); ``--quick``: the first 20 lines into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_model, host_slug, json_text, load_average, versions  # noqa: E402

from experiments import add_output_options, head, output_folders  # noqa: E402

QUICK_LINES = 20
BATCH = 32
# name: (aiayn decode overrides, transformers generate settings); None: the run's own.
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "greedy": ({"beam_size": 1}, {"num_beams": 1}),
    "beam 4, each library's settings": ({"beam_size": 4}, {"num_beams": 4}),
    "beam 4, the rules aligned": (
        {"beam_size": 4, "alpha": 0.0, "beam_rule": "fairseq"},
        {
            "num_beams": 4,
            "length_penalty": 0.0,
            "early_stopping": True,
            "forced_eos_token_id": None,
        },
    ),
}


def hf_translate(
    model: Any, tokenizer: Any, lines: list[str], limits: list[int], settings: dict[str, Any]
) -> tuple[list[list[int]], list[str]]:
    """transformers' outputs (in aiayn's ids, without start, EOS and padding) and texts,
    batched by output limit (one source length: no padding in the encoder)."""
    import torch

    from aiayn.interop.hf import hf_order

    order = hf_order(model.config.decoder_vocab_size)
    ids: list[list[int]] = [[] for _ in lines]
    texts = [""] * len(lines)
    by_limit: dict[int, list[int]] = {}
    for i, limit in enumerate(limits):
        if lines[i].strip():
            by_limit.setdefault(limit, []).append(i)
    for limit, members in sorted(by_limit.items()):
        for start in range(0, len(members), BATCH):
            chunk = members[start : start + BATCH]
            inputs = tokenizer([lines[i] for i in chunk], return_tensors="pt", padding=True)
            with torch.inference_mode():
                out = model.generate(
                    **inputs, max_new_tokens=limit + 1, do_sample=False, **settings
                )
            decoded = tokenizer.batch_decode(out, skip_special_tokens=True)
            for i, row, text in zip(chunk, out.tolist(), decoded, strict=True):
                ids[i] = [order[j] for j in row[1:] if order[j] not in (0, 3)]  # PAD, EOS
                texts[i] = text
    return ids, texts


def logit_difference(checkpoint: Path, export: Path, sources: list[str], refs: list[str]) -> float:
    """The largest difference between aiayn's and transformers' teacher-forced logits over
    the given pairs (the references as targets), in aiayn's ids."""
    import torch
    from transformers import MarianMTModel

    from aiayn.data.collate import PAD_ID, collate_pairs
    from aiayn.inference.loading import load_model
    from aiayn.interop.hf import hf_ids

    loaded = load_model(checkpoint)
    model, tokenizer = loaded.model, loaded.tokenizer
    hf = MarianMTModel.from_pretrained(export).eval()
    size = tokenizer.target_vocab_size
    to_hf = torch.tensor(hf_ids(size))
    batch = collate_pairs(
        [tokenizer.encode(s) for s in sources],
        [tokenizer.encode_target_batch([r])[0] for r in refs],
    )
    with torch.inference_mode():
        ours = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        theirs = hf(
            input_ids=to_hf[batch.src_ids].masked_fill(batch.src_pad, size - 1),
            attention_mask=~batch.src_pad,
            decoder_input_ids=to_hf[batch.tgt_in],
        ).logits[..., to_hf]
    real = batch.tgt_out != PAD_ID
    return float((ours - theirs)[real].abs().max())


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import MarianMTModel, MarianTokenizer

    from aiayn.data.collate import UNK_ID
    from aiayn.evaluation.bleu import sacrebleu_bleu, sacrebleu_chrf
    from aiayn.inference.search import max_output_lengths
    from aiayn.inference.textio import read_lines
    from aiayn.inference.translator import Translator
    from aiayn.interop.hf import export_hf

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    lines, refs = read_lines(str(args.source)), read_lines(str(args.reference))
    export = scratch / "hf"
    start = time.perf_counter()
    export_hf(args.checkpoint, export, evaluate_on=[(args.source, args.reference)])
    export_seconds = time.perf_counter() - start
    hf = MarianMTModel.from_pretrained(export).eval()
    hf_tokenizer = MarianTokenizer.from_pretrained(export)

    modes: dict[str, Any] = {}
    for mode, (overrides, settings) in MODES.items():
        translator, config = Translator.from_checkpoint(args.checkpoint, decode_overrides=overrides)
        decode = translator.decode
        sources = [translator.encode_source(line) for line in lines]
        lengths = torch.tensor([len(s) for s in sources])
        limit = config.model.max_positions - 1
        limits = max_output_lengths(lengths, decode.max_len_a, decode.max_len_b, limit).tolist()
        start = time.perf_counter()
        ours = translator.translate_nbest(lines)
        ours_seconds = time.perf_counter() - start
        ours_ids = [hyps[0].tokens if hyps else [] for hyps in ours]
        ours_text = [hyps[0].text if hyps else "" for hyps in ours]
        start = time.perf_counter()
        theirs_ids, theirs_text = hf_translate(hf, hf_tokenizer, lines, limits, settings)
        theirs_seconds = time.perf_counter() - start
        same = [a == b for a, b in zip(ours_ids, theirs_ids, strict=True)]
        differ = [i + 1 for i, s in enumerate(same) if not s]
        modes[mode] = {
            "aiayn": {
                "decode": {
                    "beam_size": decode.beam_size,
                    "alpha": decode.alpha,
                    "beam_rule": decode.beam_rule,
                    "max_len_a": decode.max_len_a,
                    "max_len_b": decode.max_len_b,
                },
                "bleu": sacrebleu_bleu(ours_text, [refs]).score,
                "chrf": sacrebleu_chrf(ours_text, [refs]).score,
                "seconds": ours_seconds,
            },
            "transformers": {
                "generate": {k: v for k, v in settings.items()},
                "bleu": sacrebleu_bleu(theirs_text, [refs]).score,
                "chrf": sacrebleu_chrf(theirs_text, [refs]).score,
                "seconds": theirs_seconds,
            },
            "identical_tokens": sum(same),
            "identical_text": sum(a == b for a, b in zip(ours_text, theirs_text, strict=True)),
            # Lines that differ where aiayn's output reached its limit (EOS forced after it).
            "differing_at_limit": sum(len(ours_ids[i - 1]) >= limits[i - 1] for i in differ),
            # Lines of the same tokens whose text differs where they hold UNK (aiayn writes
            # sentencepiece's " ⁇ ", transformers' skip_special_tokens drops <unk>).
            "text_differs_at_unk": sum(
                a == b and x != y and UNK_ID in a
                for a, b, x, y in zip(ours_ids, theirs_ids, ours_text, theirs_text, strict=True)
            ),
            "differing_lines": differ[:20],
        }
        print(f"{mode}: {sum(same)}/{len(lines)} identical", file=sys.stderr, flush=True)

    return {
        "experiment": "hf_export",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "host": host_slug(),
        "load_average": load_average(),
        "versions": versions(),
        "threads": 1,
        "checkpoint": str(args.checkpoint),
        "source": str(args.source),
        "reference": str(args.reference),
        "lines": len(lines),
        "export_seconds": export_seconds,
        "max_logit_difference": logit_difference(args.checkpoint, export, lines[:64], refs[:64]),
        "modes": modes,
        "model_card": (export / "README.md").read_text(encoding="utf-8"),
    }


def markdown(report: dict[str, Any]) -> str:
    v = report["versions"]
    out = [
        "# aiayn against its Hugging Face export (`aiayn export-hf`)",
        "",
        f"{report['date']}; {report['cpu']}, one thread, load average {report['load_average']};"
        f" aiayn {v['aiayn']}, torch {v['torch']}, transformers {v['transformers']}.",
        f"Checkpoint `{report['checkpoint']}`; {report['lines']:,} lines of "
        f"`{Path(report['source']).name}` against `{Path(report['reference']).name}`. "
        f"Export: {report['export_seconds']:.1f} s (with the model card's scoring).",
        "",
        f"Teacher-forced logits, the first 64 pairs: largest difference "
        f"{report['max_logit_difference']:.2g}.",
        "",
        "| mode | aiayn | transformers | lines identical (tokens) | lines identical (text) "
        "| aiayn BLEU / chrF | transformers BLEU / chrF | aiayn s | transformers s |",
        "|---|---|---|---:|---:|---|---|---:|---:|",
    ]
    n = report["lines"]
    for mode, r in report["modes"].items():
        a, t = r["aiayn"], r["transformers"]
        d = a["decode"]
        ours = (
            "greedy"
            if d["beam_size"] == 1
            else f"beam {d['beam_size']}, α {d['alpha']:g}, {d['beam_rule']} rule"
        )
        settings = ", ".join(f"{k}={v}" for k, v in t["generate"].items()) or "generation_config"
        out.append(
            f"| {mode} | {ours} | {settings} | {r['identical_tokens']:,} / {n:,} | "
            f"{r['identical_text']:,} / {n:,} | {a['bleu']:.2f} / {a['chrf']:.2f} | "
            f"{t['bleu']:.2f} / {t['chrf']:.2f} | {a['seconds']:.1f} | {t['seconds']:.1f} |"
        )
    out += [
        "",
        "Lines whose tokens differ, of them where aiayn's output reached its limit (EOS forced "
        "after `max_len_a` · source tokens + `max_len_b`), and lines of the same tokens whose "
        "text differs at `<unk>` (aiayn writes ` ⁇ `, `skip_special_tokens` drops it): "
        + "; ".join(
            f"{mode}: {n - r['identical_tokens']}, {r['differing_at_limit']} at the limit, "
            f"{r['text_differs_at_unk']} at `<unk>`"
            for mode, r in report["modes"].items()
        )
        + ".",
        "",
        "Beam 4 with each library's settings: transformers reads `length_penalty`, "
        "`early_stopping` and `num_beams` from the exported `generation_config.json`. Lines "
        "that differ (first 20, 1-based) per mode: "
        + "; ".join(
            f"{mode}: {', '.join(map(str, r['differing_lines'])) or 'none'}"
            for mode, r in report["modes"].items()
        )
        + ".",
        "",
        "## The model card as written (`README.md` of the export)",
        "",
        "````markdown",
        report["model_card"].rstrip(),
        "````",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--name", help="results file name (default: hf-export-<host>)")
    add_output_options(parser, f"the first {QUICK_LINES} lines")
    args = parser.parse_args()
    folder, _ = output_folders(args)
    if args.quick:
        args.source = head(args.source, folder / f"quick{args.source.suffix}", QUICK_LINES)
        args.reference = head(args.reference, folder / f"quick{args.reference.suffix}", QUICK_LINES)
    name = args.name or f"hf-export-{host_slug()}"
    with tempfile.TemporaryDirectory(prefix="aiayn-hf-export-") as scratch:
        report = measure(args, Path(scratch))
    saved = json_text(report)
    (folder / f"{name}.json").write_text(saved)
    text = markdown(json.loads(saved))  # what the JSON holds, as its test renders it
    (folder / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
