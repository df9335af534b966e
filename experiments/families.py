"""The figures of docs/families.md: the language model and the classifier on the embedded
Bible corpus, each trained for a fixed number of minutes on this machine, through the CLI a
user runs.

1. ``lm``: ``aiayn prepare --corpus bible --task lm`` and ``configs/bible_lm.toml``; the
   perplexity of the averaged model on the held-out books (valid and test) and samples from
   three prompts.
2. ``classify``: ``aiayn prepare --corpus bible --task classify`` (seven genres);
   ``configs/bible_mlm.toml`` pre-trains the encoder; ``configs/bible_classify.toml``
   fine-tunes it, and the same config from random weights (``train.init_from=none``) is the
   run without pre-training; test accuracy and macro-F1 of each, beside a bag-of-words logistic
   regression (scikit-learn) on the same split.

Writes ``experiments/results/families.{json,md}`` (``families-lm`` or ``families-classify``
with ``--only`` one of them; or into ``--out``) and the confusion-matrix PNGs under ``--work``.
``--minutes`` scales every training time; ``--quick`` is ``--minutes 0.02`` (12 seconds of
language model) into a temporary folder.

    .venv/bin/python -m experiments.families [--only lm classify] [--minutes 1.0]
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import finished_run, json_text, machine  # noqa: E402

from experiments import add_output_options, output_folders  # noqa: E402

AIAYN = [sys.executable, "-m", "aiayn"]
QUICK_SCALE = 0.02
PROMPTS = ["In the beginning", "Jesus said to them,", "The Lord is my shepherd"]


def _run(*args: str) -> str:
    """Run an aiayn command; its stdout (stderr passes through)."""
    print("+ aiayn " + " ".join(args), file=sys.stderr, flush=True)
    done = subprocess.run([*AIAYN, *args], check=True, stdout=subprocess.PIPE, text=True)
    return done.stdout


def _train(config: str, data: Path, out: Path, minutes: float, *extra: str) -> dict[str, Any]:
    start = time.monotonic()
    _run("train", "--config", config, "--data", str(data), "--out", str(out), "--no-progress",
         f"train.max_minutes={minutes:g}", *extra)  # fmt: skip
    figures = finished_run(out)
    return {**figures, "minutes": minutes, "wall_minutes": (time.monotonic() - start) / 60}


def _test_metrics(run: Path, data: Path) -> dict[str, float]:
    """Validation metrics of the run's averaged model on the data's test split."""
    from aiayn.training.tasks import score_split

    return score_split(run, data, "test")


def language_model(work: Path, scale: float) -> dict[str, Any]:
    data, run = work / "data-bible-lm-en", work / "bible-lm"
    _run("prepare", "--corpus", "bible", "--task", "lm", "--lang", "en", "--out", str(data))
    training = _train("configs/bible_lm.toml", data, run, 10 * scale)
    samples = []
    for number, prompt in enumerate(PROMPTS):
        text = _run("generate", str(run), prompt, "--top-p", "0.9", "--seed", str(number + 1),
                    "--max-new-tokens", "60")  # fmt: skip
        samples.append(text.strip())
    greedy = _run("generate", str(run), PROMPTS[0], "--greedy", "--max-new-tokens", "60")
    return {
        "training": training,
        "test": _test_metrics(run, data),
        "samples_top_p_0.9": samples,
        "greedy": greedy.strip(),
    }


def _bag_of_words(data: Path) -> dict[str, float]:
    """Logistic regression on TF-IDF unigrams and bigrams of the training verses."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score

    from aiayn.data.text import TextCorpus

    train, test = TextCorpus.open(data, "train"), TextCorpus.open(data, "test")
    assert train.labels is not None and test.labels is not None
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x_train = vectorizer.fit_transform(train.texts())
    model = LogisticRegression(max_iter=2000, C=10.0)
    model.fit(x_train, train.labels)
    predicted = model.predict(vectorizer.transform(test.texts()))
    return {
        "accuracy": float(accuracy_score(test.labels, predicted)),
        "macro_f1": float(f1_score(test.labels, predicted, average="macro")),
    }


def _scores(text: str) -> dict[str, float]:
    match = re.search(r"accuracy ([0-9.]+), macro-F1 ([0-9.]+)", text)
    if not match:
        raise RuntimeError(f"no scores in: {text}")
    return {"accuracy": float(match.group(1)), "macro_f1": float(match.group(2))}


def classifier(work: Path, scale: float, reuse_pretraining: bool = False) -> dict[str, Any]:
    data = work / "data-bible-genre"
    _run("prepare", "--corpus", "bible", "--task", "classify", "--lang", "en", "--out", str(data))
    mlm = work / "bible-mlm"
    if reuse_pretraining and (mlm / "averaged.pt").is_file():
        pretraining = {**finished_run(mlm), "reused": str(mlm)}
    else:
        pretraining = _train("configs/bible_mlm.toml", data, mlm, 10 * scale)
    results: dict[str, Any] = {"pretraining": pretraining, "bag_of_words": _bag_of_words(data)}
    for name, init in (("fine_tuned", str(mlm / "averaged.pt")), ("from_scratch", "none")):
        run = work / f"bible-genre-{name}"
        shutil.rmtree(run, ignore_errors=True)
        training = _train("configs/bible_classify.toml", data, run, 5 * scale,
                          f"train.init_from={init}")  # fmt: skip
        png = work / f"confusion-{name}.png"
        out = _run("classify", str(run), "--data", str(data), "--split", "test",
                   "--confusion", str(png))  # fmt: skip
        results[name] = {"training": training, "test": _scores(out), "report": out}
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Families: measured figures",
        "",
        f"{results['date']}, {results['machine']['cpu']}, {results['machine']['threads']} "
        "threads; training times as configured (wall minutes include start-up and averaging).",
    ]
    if "lm" in results:
        lm = results["lm"]
        t = lm["training"]
        lines += [
            "",
            "## Language model (configs/bible_lm.toml)",
            "",
            f"- {t['minutes']:g} minutes, {t['updates']} updates, "
            f"{t['tokens_per_s']:,.0f} target tokens/s at the end",
            f"- averaged model, valid books perplexity {t['averaged']['ppl']:.2f}; "
            f"test books perplexity {lm['test']['ppl']:.2f}",
            "",
            "Samples (top-p 0.9, seeds 1-3):",
            "",
            *[f"> {s}" + "\n" for s in lm["samples_top_p_0.9"]],
            f"Greedy: `{lm['greedy']}`",
        ]
    if "classify" in results:
        c = results["classify"]
        p = c["pretraining"]
        lines += [
            "",
            "## Genre classifier (configs/bible_mlm.toml, configs/bible_classify.toml)",
            "",
            f"Pre-training: {p['minutes']:g} minutes, {p['updates']} updates, "
            f"averaged masked-token perplexity {p['averaged']['ppl']:.2f} (valid).",
            "",
            "| model | training | test accuracy | test macro-F1 |",
            "|---|---|---:|---:|",
        ]
        for name, label in (("fine_tuned", "pre-trained + fine-tuned"),
                            ("from_scratch", "same model, random init")):  # fmt: skip
            r = c[name]
            lines.append(
                f"| {label} | {r['training']['minutes']:g} min, {r['training']['updates']} "
                f"updates | {r['test']['accuracy']:.4f} | {r['test']['macro_f1']:.4f} |"
            )
        bow = c["bag_of_words"]
        lines.append(
            f"| bag of words (TF-IDF 1-2 grams, logistic regression) | seconds | "
            f"{bow['accuracy']:.4f} | {bow['macro_f1']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=["lm", "classify"], default=None)
    parser.add_argument("--minutes", type=float, default=1.0, help="scale of training times")
    parser.add_argument("--work", type=Path, help="the runs' folder (default: runs/families)")
    parser.add_argument(
        "--reuse-pretraining",
        action="store_true",
        help="classify: start from the finished MLM run in --work instead of pre-training again",
    )
    add_output_options(parser, f"--minutes {QUICK_SCALE}")
    args = parser.parse_args()
    folder, _ = output_folders(args)
    if args.quick:
        args.minutes = QUICK_SCALE
    args.work = args.work or (folder / "runs" if args.quick else ROOT / "runs" / "families")
    args.work.mkdir(parents=True, exist_ok=True)
    only = args.only or ["lm", "classify"]
    results: dict[str, Any] = {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "scale": args.minutes,
    }
    if "lm" in only:
        results["lm"] = language_model(args.work, args.minutes)
    if "classify" in only:
        results["classify"] = classifier(args.work, args.minutes, args.reuse_pretraining)
    name = "families" if len(set(only)) == 2 else f"families-{only[0]}"
    (folder / f"{name}.json").write_text(json_text(results))
    (folder / f"{name}.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
