"""``aiayn demo``: the embedded English→Spanish Bible corpus, prepared, trained on, averaged,
translated and scored, with no data to find and no flags to learn (see :mod:`aiayn.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from aiayn.cli.process import PROCESS_SETTINGS
from aiayn.errors import CLIError


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the main job end to end on the embedded English-Spanish Bible corpus",
        description="Prepare the embedded English→Spanish Bible corpus (once), train a "
        "Transformer sized for this machine (the small preset on a CPU, base on a GPU) for "
        "--minutes, average the last checkpoints, translate the held-out test verses with beam "
        "search, and print examples, sacreBLEU and chrF, where the model, the loss curve and an "
        "attention heat map were written, and the command that translates your own sentences. "
        "Running it again continues an interrupted run (Ctrl-C saves a checkpoint); --fresh "
        "starts over. KEY=VALUE arguments override the training recipe "
        "(e.g. train.update_tokens=4000).",
        epilog=PROCESS_SETTINGS,
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="training time in minutes (default 10; preparing and translating add ~3)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/demo"),
        metavar="RUN_DIR",
        help="run directory (default runs/demo)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("data/bible-en-es"),
        metavar="DATA_DIR",
        help="where the prepared corpus goes (default data/bible-en-es; reused when present)",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto"
    )
    parser.add_argument(
        "--train-pairs",
        type=int,
        metavar="N",
        help="train on the first N training pairs only (a quick look)",
    )
    parser.add_argument(
        "--test-pairs",
        type=int,
        metavar="N",
        help="validate and test on the first N pairs of those splits only",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=8000, help="joint subword vocabulary (default 8000)"
    )
    parser.add_argument(
        "--sword-path",
        type=Path,
        help="SWORD modules to read the Bible from (default: the system's, see docs/data.md)",
    )
    parser.add_argument("--cache-dir", type=Path, help="where the corpus text is cached")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.cli.paths import check_output_dir
    from aiayn.demo import DemoOptions, run_demo

    check_output_dir(args.out, "--out")
    for name in ("train_pairs", "test_pairs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be positive, got {value}")
    options = DemoOptions(
        minutes=args.minutes,
        data_dir=args.data,
        run_dir=args.out,
        fresh=args.fresh,
        device=args.device,
        vocab_size=args.vocab_size,
        train_pairs=args.train_pairs,
        test_pairs=args.test_pairs,
        overrides=tuple(args.overrides),
        cache_dir=args.cache_dir,
        sword_path=args.sword_path,
        show_progress=not args.no_progress,
        process_settings=True,
    )
    run_demo(options)
    return 0
