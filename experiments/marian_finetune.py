"""A Marian model trained with Hugging Face transformers, imported into aiayn, and fine-tuned
with ``aiayn train --config finetune``: what the import keeps and what fine-tuning adds.

    .venv/bin/python -m experiments.marian_finetune --data ../shared/data/multi30k \\
        --work /tmp/marian-ft [--pretrain-steps 1500] [--finetune-steps 600]

1. The "pre-trained" model: an OPUS-MT-shaped ``MarianMTModel`` (Swish, sinusoids in halves,
   shared embeddings, ``source.spm``/``target.spm`` unigram models and one ``vocab.json``)
   trained by a plain PyTorch loop over the Hugging Face model on ``train`` for a fixed number
   of updates (label smoothing 0.1, Adam with Eq. 3's schedule), saved with
   ``save_pretrained`` beside its tokenizer files, as a Hugging Face hub directory is.
2. ``aiayn import-marian``, then greedy ``val`` translations of both: the share of identical
   lines against ``generate``, and BLEU.
3. ``aiayn prepare --tokenizer`` on the same ``train`` text, ``aiayn train --config finetune``
   with ``train.init_from`` for a number of updates (the recipe's time limit replaced by a
   step count, so that a busy machine changes the minutes, not the result), and the beam-4
   BLEU of the averaged model against the imported one's.

Writes ``experiments/results/marian-finetune.json`` and ``.md`` (or into ``--out``);
``--quick`` runs it on the first 5,000 training pairs and 10 validation lines, 20 and 10
updates, into a temporary folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_model, json_text, load_average, versions  # noqa: E402

from experiments import add_output_options, output_folders  # noqa: E402

SHAPE = {"d_model": 256, "ffn": 1024, "heads": 4, "layers": 3}
MAX_TOKENS = 1600  # target tokens (padded) per update, as configs/multi30k.toml
GENERATE_LIMIT = 100  # new tokens at most when decoding val
# --quick: training pairs, validation lines, pre-training and fine-tuning updates, pieces.
QUICK = {"train": 5000, "val": 10, "pretrain": 20, "finetune": 10, "pieces": 1000}


def _head(data: Path, out: Path) -> Path:
    """The first lines of ``data``'s train and val files (``QUICK``) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        for lang in ("en", "de"):
            lines = (data / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            text = "\n".join(lines[: QUICK[split]]) + "\n"
            (out / f"{split}.{lang}").write_text(text, encoding="utf-8")
    return out


def _aiayn(*args: str) -> str:
    """Run the aiayn CLI of this checkout; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "aiayn", *args], check=True, text=True, capture_output=True
    )
    return done.stdout


def _spm(text: Path, prefix: Path, pieces: int) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=pieces, model_type="unigram",
        character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )  # fmt: skip
    return prefix.with_suffix(".model")


def marian_directory(data: Path, out: Path, pieces: int) -> Path:
    """An untrained OPUS-MT-shaped model directory with tokenizer files made from ``train``."""
    import sentencepiece as spm
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    models = {}
    for side, lang in (("source", "en"), ("target", "de")):
        model = _spm(data / f"train.{lang}", out / f"{side}-spm", pieces)
        (out / f"{side}.spm").write_bytes(model.read_bytes())
        models[side] = spm.SentencePieceProcessor(model_file=str(model))
    vocab = {"</s>": 0, "<unk>": 1}
    for sp in models.values():
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if piece != "<unk>":
                vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": False}))
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=SHAPE["d_model"],
        encoder_layers=SHAPE["layers"], decoder_layers=SHAPE["layers"],
        encoder_attention_heads=SHAPE["heads"], decoder_attention_heads=SHAPE["heads"],
        encoder_ffn_dim=SHAPE["ffn"], decoder_ffn_dim=SHAPE["ffn"], activation_function="swish",
        max_position_embeddings=256, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0, scale_embedding=True, dropout=0.1,
        attention_dropout=0.0, activation_dropout=0.0, share_encoder_decoder_embeddings=True,
        num_beams=4, max_length=GENERATE_LIMIT,
    )  # fmt: skip
    torch.manual_seed(1)
    transformers.MarianMTModel(config).save_pretrained(out)
    return out


def _tokenizer(directory: Path) -> Any:
    import transformers

    return transformers.MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json")
    )


def pretrain(directory: Path, data: Path, steps: int, seed: int = 1) -> dict[str, Any]:
    """Train the model in ``directory`` for ``steps`` updates with transformers; saves it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = transformers.MarianMTModel.from_pretrained(directory).train()
    tok = _tokenizer(directory)
    src = (data / "train.en").read_text(encoding="utf-8").splitlines()
    tgt = (data / "train.de").read_text(encoding="utf-8").splitlines()
    pairs = [
        (s, t)
        for s, t in zip(tok(src).input_ids, tok(text_target=tgt).input_ids, strict=True)
        if len(s) <= 128 and len(t) <= 128
    ]
    pairs.sort(key=lambda p: (len(p[1]), len(p[0])))
    batches, current = [], []
    for pair in pairs:  # length-sorted batches of at most MAX_TOKENS padded target tokens
        if current and (len(current) + 1) * len(pair[1]) > MAX_TOKENS:
            batches.append(current)
            current = []
        current.append(pair)
    batches.append(current)
    pad, start = model.config.pad_token_id, model.config.decoder_start_token_id
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    warmup, scale = 500, 0.4 * SHAPE["d_model"] ** -0.5  # configs/multi30k.toml's Eq. 3
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: scale * min((s + 1) ** -0.5, (s + 1) * warmup**-1.5)
    )
    step, tokens, began, order = 0, 0, time.perf_counter(), []
    while step < steps:
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        batch = batches[order.pop()]
        width_s = max(len(s) for s, _ in batch)
        width_t = max(len(t) for _, t in batch)
        ids = torch.tensor([s + [pad] * (width_s - len(s)) for s, _ in batch])
        labels = torch.tensor([t + [-100] * (width_t - len(t)) for _, t in batch])
        decoder_in = torch.cat([torch.full((len(batch), 1), start), labels[:, :-1]], dim=1)
        decoder_in = decoder_in.masked_fill(decoder_in == -100, pad)
        logits = model(
            input_ids=ids, attention_mask=ids != pad, decoder_input_ids=decoder_in
        ).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=0.1
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
        tokens += int((labels != -100).sum())
        if step % 100 == 0:
            print(f"pretrain {step}/{steps}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - began
    model.save_pretrained(directory)
    return {"updates": steps, "minutes": seconds / 60, "target_tokens_per_s": tokens / seconds}


def generate(directory: Path, sources: list[str], batch: int = 64) -> list[str]:
    """Greedy translations by transformers' ``generate`` (at most GENERATE_LIMIT tokens)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    tok = _tokenizer(directory)
    out = []
    with torch.no_grad():
        for i in range(0, len(sources), batch):
            inputs = tok(sources[i : i + batch], padding=True, return_tensors="pt")
            ids = model.generate(
                **inputs, num_beams=1, do_sample=False, max_new_tokens=GENERATE_LIMIT,
                bad_words_ids=[[model.config.pad_token_id]],
            )  # fmt: skip
            out += tok.batch_decode(ids, skip_special_tokens=True)
    return out


def bleu(hypotheses: list[str], references: list[str]) -> tuple[float, float]:
    import sacrebleu

    return (
        round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
        round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2),
    )


def translate(checkpoint: Path, source: Path, out: Path, *options: str) -> list[str]:
    """``aiayn translate``'s lines, also written to ``out``."""
    text = _aiayn("translate", str(checkpoint), "--input", str(source), *options)
    out.write_text(text, encoding="utf-8")
    return text.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="train.en/de, val.en/de")
    parser.add_argument("--work", type=Path, help="scratch directory (needed but with --quick)")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--finetune-steps", type=int, default=600)
    parser.add_argument("--pieces", type=int, default=4000, help="per sentencepiece model")
    add_output_options(parser, ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    args = parser.parse_args()
    folder, _ = output_folders(args)
    if args.quick:
        args.work = args.work or folder / "work"
        args.pretrain_steps, args.finetune_steps = QUICK["pretrain"], QUICK["finetune"]
        args.pieces = QUICK["pieces"]
    if args.work is None:
        parser.error("--work is needed (or --quick)")
    work, data = args.work, args.data
    work.mkdir(parents=True, exist_ok=True)
    if args.quick:
        data = _head(data, work / "quick-data")
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "cpu": cpu_model(),
        "load_before": load_average(),
        "versions": versions(),
        "shape": {**SHAPE, "pieces": args.pieces},
    }
    directory = work / "marian"
    if not (directory / "model.safetensors").is_file() or not (work / "pretrained").is_file():
        marian_directory(data, directory, args.pieces)
        result["pretrain"] = pretrain(directory, data, args.pretrain_steps)
        (work / "pretrained").write_text(json.dumps(result["pretrain"]))
    else:
        result["pretrain"] = json.loads((work / "pretrained").read_text())
    sources = (data / "val.en").read_text(encoding="utf-8").splitlines()
    references = (data / "val.de").read_text(encoding="utf-8").splitlines()

    imported = work / "imported.pt"
    _aiayn("import-marian", str(directory), "--out", str(imported))
    theirs = generate(directory, sources)
    limit = ["--max-len-a", "0", "--max-len-b", str(GENERATE_LIMIT - 1)]
    ours = translate(imported, data / "val.en", work / "imported.greedy.de", "--beam", "1", *limit)
    # Lines where generate stopped at its limit are not comparable (aiayn ends them with EOS).
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    result["import"] = {
        "identical_greedy_lines": same,
        "lines": len(sources),
        "bleu_chrf_greedy_transformers": bleu(theirs, references),
        "bleu_chrf_greedy_aiayn": bleu(ours, references),
    }
    beam = translate(imported, data / "val.en", work / "imported.beam.de")
    result["import"]["bleu_chrf_beam4_aiayn"] = bleu(beam, references)

    prepared = work / "data"
    _aiayn(
        "prepare", "--train", str(data / "train"), "--valid", str(data / "val"), "--src", "en",
        "--tgt", "de", "--tokenizer", str(imported), "--out", str(prepared),
    )  # fmt: skip
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    began = time.perf_counter()
    _aiayn(
        "train", "--config", "finetune", "--data", str(prepared), "--out", str(run),
        "--no-progress", f"train.init_from={imported}",
        f"train.max_steps={args.finetune_steps}", "train.max_minutes=0",
        *["train.compile_step=false"] * args.quick,  # no decoder step compiled (minutes)
    )  # fmt: skip
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "train"]
    tuned = translate(run / "averaged.pt", data / "val.en", work / "tuned.beam.de")
    result["finetune"] = {
        "minutes": round((time.perf_counter() - began) / 60, 2),
        "updates": max(r["step"] for r in records),
        "target_tokens_per_s": round(
            sum(r["tgt_tokens_per_s"] for r in trained) / max(len(trained), 1), 1
        ),
        "valid": [
            {k: r[k] for k in ("step", "loss", "nll")}
            for r in records
            if r["kind"] in ("valid", "averaged")
        ],
        "bleu_chrf_beam4": bleu(tuned, references),
    }
    result["load_after"] = load_average()
    (folder / "marian-finetune.json").write_text(json_text(result))
    (folder / "marian-finetune.md").write_text(report(result))
    print(report(result))


def report(r: dict[str, Any]) -> str:
    p, i, f = r["pretrain"], r["import"], r["finetune"]
    return "\n".join(
        [
            f"# Marian model: import and fine-tuning ({r['date']}, {r['cpu']})",
            "",
            f"Pre-trained with transformers: {p['updates']} updates in {p['minutes']:.1f} min "
            f"({p['target_tokens_per_s']:.0f} target tokens/s).",
            "",
            "| model | decoding | BLEU | chrF |",
            "|---|---|---:|---:|",
            f"| transformers `generate` | greedy | {i['bleu_chrf_greedy_transformers'][0]} | "
            f"{i['bleu_chrf_greedy_transformers'][1]} |",
            f"| imported into aiayn | greedy | {i['bleu_chrf_greedy_aiayn'][0]} | "
            f"{i['bleu_chrf_greedy_aiayn'][1]} |",
            f"| imported into aiayn | beam 4 | {i['bleu_chrf_beam4_aiayn'][0]} | "
            f"{i['bleu_chrf_beam4_aiayn'][1]} |",
            f"| fine-tuned {f['minutes']:.1f} min ({f['updates']} updates) | beam 4 | "
            f"{f['bleu_chrf_beam4'][0]} | {f['bleu_chrf_beam4'][1]} |",
            "",
            f"Greedy lines identical to `generate`: {i['identical_greedy_lines']} of "
            f"{i['lines']}. Fine-tuning: {f['target_tokens_per_s']:.0f} target tokens/s; "
            f"load average before {r['load_before']}, after {r['load_after']}.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
