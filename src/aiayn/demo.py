"""``aiayn demo``: the embedded English→Spanish Bible corpus, end to end, in one call.

Five steps, each one the library function the other commands call:

1. prepare the corpus (:func:`aiayn.data.prepare.prepare_corpus`; reused when already done),
2. train for a bounded time (:func:`aiayn.training.launch.train_run`; an interrupted run
   resumes where it stopped, ``fresh`` starts over),
3. average the last checkpoints (the trainer does it when time is up),
4. translate the held-out test verses with beam search and score them with sacreBLEU and chrF
   (beside the score of copying the source, the trivial baseline),
5. draw the loss curve and the attention heat maps of one test verse.

The model is sized for the device: the ``small`` preset on a CPU, ``base`` (bf16) on CUDA.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from aiayn.config import RunConfig
from aiayn.data.corpus import Corpus
from aiayn.data.prepare import prepare_corpus, prepare_data
from aiayn.data.sources.bible import write_bible_corpus
from aiayn.data.sources.download import default_cache_dir
from aiayn.errors import ResumeMismatch, UserError
from aiayn.evaluation.bleu import sacrebleu_bleu, sacrebleu_chrf
from aiayn.inference import loading
from aiayn.inference.attention_maps import token_labeler, write_cross_attention_picture
from aiayn.inference.textio import empty_translation_advice
from aiayn.inference.translator import Translator
from aiayn.progress import Log
from aiayn.training.launch import train_run
from aiayn.training.plot import plot_run
from aiayn.training.run_config import resolve_config

SRC, TGT = "en", "es"
STEPS = 5

# The recipe on top of the preset, per device. A 10-minute CPU run sees about a million target
# tokens (~1 epoch of the corpus, so little dropout is needed). With this little compute the
# number of updates matters more than their size (docs/results.md, Multi30k): one micro-batch
# of ~1.4k target tokens per update (~800 updates), a short warmup to a peak learning rate of
# 0.25 · 256^-0.5 · 200^-0.5 ≈ 1.1e-3; checkpoints every tenth of the run, the last three
# averaged (§6.1 averages the last 5 of a 12-hour run).
CPU_RECIPE = [
    "preset=small",
    # bf16 where the CPU has AVX512-BF16 or AMX (more updates in the 10 minutes), else fp32.
    "train.precision=auto",
    "model.dropout=0.1",
    "data.max_tokens=1600",
    "train.update_tokens=1200",
    "train.warmup_steps=200",
    "train.lr_scale=0.25",
    "train.log_interval=20",
    "train.valid_interval=200",
    "train.valid_bleu=false",
    "train.save_interval_steps=0",
    "train.keep_last=3",
    "train.average_last=3",
    "train.patience=0",
    "decode.beam_size=4",
    "decode.alpha=0.6",
]
# On a GPU: the base model in bf16 with larger updates (not run on this project's machines,
# which have no GPU; the same code path as the CPU recipe otherwise).
CUDA_RECIPE = [
    "preset=base",
    "train.precision=bf16",
    "data.max_tokens=8192",
    "train.update_tokens=12000",
    "train.warmup_steps=1000",
    "train.lr_scale=1.0",
    "train.log_interval=20",
    "train.valid_interval=200",
    "train.valid_bleu=false",
    "train.save_interval_steps=0",
    "train.keep_last=5",
    "train.average_last=5",
    "train.patience=0",
    "decode.beam_size=4",
    "decode.alpha=0.6",
]


@dataclass(frozen=True)
class DemoOptions:
    """What ``aiayn demo`` does; every field has the default the command uses but
    ``process_settings``, which the command sets (:class:`~aiayn.training.trainer.Trainer`'s)."""

    minutes: float = 10.0
    data_dir: Path = Path("data/bible-en-es")
    run_dir: Path = Path("runs/demo")
    fresh: bool = False
    device: str = "auto"
    vocab_size: int = 8000
    # Train (and test) on the first N pairs only: a quick look, and the tests.
    train_pairs: int | None = None
    test_pairs: int | None = None
    examples: int = 5
    overrides: Sequence[str] = ()
    cache_dir: Path | None = None
    sword_path: Path | None = None
    show_progress: bool = True
    process_settings: bool = False


@dataclass
class DemoResult:
    """What the demo measured and wrote."""

    run_dir: Path
    checkpoint: Path
    bleu: float = 0.0
    chrf: float = 0.0
    baseline_bleu: float = 0.0
    lines: list[str] = field(default_factory=list)  # what was printed on stdout
    loss_curve: Path | None = None
    attention: Path | None = None
    hypotheses: Path | None = None
    interrupted: bool = False


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but PyTorch sees no CUDA device")
    return name


def demo_config(
    data_dir: Path, minutes: float, device: str, overrides: Sequence[str] = ()
) -> RunConfig:
    """The demo's run config: the device's recipe, ``minutes`` of training, then ``overrides``."""

    if minutes <= 0:
        raise UserError(f"--minutes must be positive, got {minutes:g}")
    recipe = CUDA_RECIPE if device == "cuda" else CPU_RECIPE
    timing = [
        "train.max_steps=0",
        "train.max_epochs=0",
        f"train.max_minutes={minutes!r}",
        f"train.save_interval_minutes={minutes / 10.0!r}",
    ]
    return resolve_config(None, data_dir, [*recipe, *timing, *overrides])


# -- the steps ---------------------------------------------------------------------------------


def _slice(
    prefixes: dict[str, Path], out: Path, train: int | None, test: int | None
) -> dict[str, Path]:
    """The first ``train`` training pairs and ``test`` valid/test pairs, as new text files."""
    out.mkdir(parents=True, exist_ok=True)
    sliced = {}
    for split, prefix in prefixes.items():
        limit = train if split == "train" else test
        for lang in (SRC, TGT):
            src_path = Path(f"{prefix}.{lang}")
            lines = src_path.read_text(encoding="utf-8").splitlines(keepends=True)
            if limit is not None:
                lines = lines[:limit]
            target, text = out / f"{split}.{lang}", "".join(lines)
            # An unchanged slice keeps its time stamp, so prepare finds the data directory up
            # to date instead of encoding it again (the vocabulary is reused either way).
            if not target.is_file() or target.read_text(encoding="utf-8") != text:
                target.write_text(text, encoding="utf-8")
        sliced[split] = out / split
    return sliced


def prepare_demo_data(options: DemoOptions, log: Log) -> dict[str, Any]:
    """Step 1: the Bible corpus, prepared into ``options.data_dir`` (reused when unchanged)."""

    if options.train_pairs is None and options.test_pairs is None:
        return prepare_corpus(
            "bible",
            options.data_dir,
            vocab_size=options.vocab_size,
            cache_dir=options.cache_dir,
            sword_path=options.sword_path,
            log=log,
        )
    cache = options.cache_dir if options.cache_dir is not None else default_cache_dir()
    prefixes = write_bible_corpus(cache / "bible", options.sword_path, log=log)
    text_dir = options.data_dir.with_name(options.data_dir.name + "-text")
    sliced = _slice(prefixes, text_dir, options.train_pairs, options.test_pairs)
    return prepare_data(
        sliced["train"],
        sliced["valid"],
        sliced.get("test"),
        SRC,
        TGT,
        options.vocab_size,
        options.data_dir,
        log=log,
    )


def _start_fresh(run_dir: Path) -> None:
    if not run_dir.exists():
        return
    markers = ("config.toml", "run.json", "checkpoints", "metrics.jsonl")
    if any(run_dir.iterdir()) and not any((run_dir / m).exists() for m in markers):
        raise UserError(
            f"--fresh would delete {run_dir}, which does not look like a run directory; "
            "choose another --out"
        )
    shutil.rmtree(run_dir)


def _translate_with_progress(
    translator: Translator, lines: list[str], log: Callable[[str, bool], None]
) -> list[str]:
    """Translate in chunks of similar length, reporting progress and the time left."""
    order = sorted(range(len(lines)), key=lambda i: -len(lines[i]))
    out = [""] * len(lines)
    chunk = 128
    start = time.monotonic()
    for begin in range(0, len(order), chunk):
        part = order[begin : begin + chunk]
        for i, text in zip(part, translator.translate([lines[i] for i in part]), strict=True):
            out[i] = text
        done = begin + len(part)
        # Longest first: the rest goes faster than the time per sentence so far.
        per = (time.monotonic() - start) / done
        left = per * (len(lines) - done) * 0.7
        log(f"  translated {done:,}/{len(lines):,} verses, about {left:.0f} s left", True)
    return out


def _pick_examples(sources: list[str], count: int, max_words: int = 22) -> list[int]:
    """Up to ``count`` readable (short) test verses, spread over the test set."""
    short = [i for i, s in enumerate(sources) if 4 <= len(s.split()) <= max_words]
    pool = short if len(short) >= count else list(range(len(sources)))
    if not pool or count <= 0:
        return []
    step = max(1, len(pool) // count)
    return pool[::step][:count]


def _command_name() -> str:
    """How to call this ``aiayn`` again: the bare name when it is on PATH."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    found = shutil.which("aiayn")
    if argv0 is not None and argv0.name == "aiayn" and argv0.exists():
        if found is not None and Path(found).resolve() == argv0.resolve():
            return "aiayn"
        return str(argv0)
    return "aiayn" if found is not None else f"{sys.executable} -m aiayn"


def run_demo(
    options: DemoOptions, out: TextIO | None = None, err: TextIO | None = None
) -> DemoResult:
    """Prepare, train, average, translate, score and draw; results to ``out`` (stdout),
    progress to ``err`` (stderr)."""

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    tty = bool(getattr(err, "isatty", lambda: False)())
    t0 = time.monotonic()

    def log(message: str, transient: bool = False) -> None:
        if transient and not tty:
            return
        err.write(("\r\033[K" if tty else "") + message + ("" if transient else "\n"))
        err.flush()

    def step(n: int, what: str) -> None:
        log(f"[{n}/{STEPS}] {what}  ({(time.monotonic() - t0) / 60:.1f} min so far)")

    lines: list[str] = []

    def say(text: str = "") -> None:
        lines.append(text)
        out.write(text + "\n")
        out.flush()

    device = _device(options.device)
    run_dir, data_dir = options.run_dir, options.data_dir
    log(
        f"aiayn demo: English→Spanish Bible, {'base' if device == 'cuda' else 'small'} model on "
        f"{device}, {options.minutes:g} minutes of training; about "
        f"{options.minutes + 3:.0f} minutes in all (preparing and translating included)"
    )

    step(1, f"preparing the embedded corpus into {data_dir}")
    prepare_demo_data(options, lambda message: log(f"  {message}"))
    if not (data_dir / f"test.{SRC}").is_file():
        raise UserError(f"{data_dir} has no test split; delete it and run the demo again")

    if options.fresh:
        _start_fresh(run_dir)
    resuming = bool(loading.list_step_checkpoints(run_dir))
    config = demo_config(data_dir, options.minutes, device, options.overrides)
    step(
        2,
        f"{'resuming' if resuming else 'training'} in {run_dir} for up to {options.minutes:g} "
        "minutes (Ctrl-C saves a checkpoint; run the demo again to continue)",
    )
    try:
        result = train_run(
            config,
            data_dir,
            run_dir,
            device=device,
            show_progress=options.show_progress,
            process_settings=options.process_settings,
        )
    except ResumeMismatch as error:  # a run of another corpus or recipe in run_dir
        raise UserError(f"{error} (aiayn demo --fresh starts over)") from None
    if result.interrupted:
        log(
            f"{result.reason} at update {result.step}; checkpoint saved to {result.checkpoint}. "
            "Run the demo again to continue (--fresh starts over)."
        )
        return DemoResult(run_dir, Path(result.checkpoint or ""), interrupted=True)

    step(3, "averaging the last checkpoints")
    model_path = result.averaged
    if model_path is None:  # too short a run for more than one checkpoint
        model_path = result.checkpoint
        log(f"  one checkpoint only: using {model_path}")
    else:
        log(f"  {model_path}")
    model_path = Path(model_path or "")

    test = Corpus.open(data_dir, "test")
    sources = test.src_texts()
    references = test.tgt_texts()
    step(4, f"translating the {len(sources):,} test verses (beam {config.decode.beam_size})")
    translator, _ = Translator.from_checkpoint(
        model_path, device=device, process_settings=options.process_settings
    )
    hypotheses = _translate_with_progress(translator, sources, log)
    hyp_path = run_dir / f"test.hyp.{TGT}"
    hyp_path.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    bleu = sacrebleu_bleu(hypotheses, [references])
    chrf = sacrebleu_chrf(hypotheses, [references])
    baseline = sacrebleu_bleu(sources, [references])

    step(5, "drawing the loss curve and the attention of one test verse")
    curve = plot_run(run_dir)
    picks = _pick_examples(sources, options.examples)
    attention = None
    if picks:
        src_ids = translator.encode_source(sources[picks[0]])
        [hyps] = translator.search_ids([src_ids])
        attention = write_cross_attention_picture(
            translator.model,
            src_ids,
            hyps[0].tokens,
            token_labeler(translator.tokenizer),
            run_dir / "attention.png",
        )

    say()
    say(f"Test verses ({len(sources):,}), English → Spanish, translated by the model just trained:")
    for i in picks:
        say()
        say(f"  source     {sources[i]}")
        say(f"  reference  {references[i]}")
        say(f"  aiayn      {hypotheses[i]}")
    say()
    say(f"test {bleu.line}")
    say(f"test {chrf.line}")
    say(f"baseline (copying the English source): BLEU {baseline.score:.1f}")
    asked = [(s, h) for s, h in zip(sources, hypotheses, strict=True) if s.strip()]
    empty = sum(1 for _, h in asked if not h.strip())
    advice = empty_translation_advice(len(asked), empty, config.decode.beam_size)
    if advice is not None:
        say(f"note: {advice}; here: a larger --minutes")
    say()
    say(f"run directory      {run_dir}")
    say(f"model              {model_path}")
    say(f"test translations  {hyp_path}")
    say(f"loss curve         {curve}")
    if attention is not None:
        say(f"attention map      {attention}  (every layer: aiayn attention --help)")
    example = "In the beginning, God created the heavens and the earth."
    command = f"echo {shlex.quote(example)} | {_command_name()} translate {model_path}"
    say()
    say("Translate your own sentences:")
    say(f"  {command}")
    log(f"done in {(time.monotonic() - t0) / 60:.1f} minutes")
    return DemoResult(
        run_dir,
        model_path,
        bleu=bleu.score,
        chrf=chrf.score,
        baseline_bleu=baseline.score,
        lines=lines,
        loss_curve=curve,
        attention=attention,
        hypotheses=hyp_path,
    )
