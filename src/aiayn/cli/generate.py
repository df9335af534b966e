"""``aiayn generate``: continue a prompt with a decoder-only language model (task ``lm``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from aiayn.cli.paths import add_checkpoint_argument
from aiayn.errors import CLIError, UserError

if TYPE_CHECKING:
    from aiayn.inference.generation import GenerateOptions, Strategy, TextGenerator


# The options of generating and their defaults (GenerateOptions's): --data refuses them set.
_GENERATING: dict[str, object] = {
    "prompt": "-",
    "max_new_tokens": 100,
    "greedy": False,
    "beam": None,
    "alpha": 0.6,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "seed": None,
    "samples": 1,
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="continue a prompt with a language model",
        description="Continue PROMPT with a decoder-only language model (a run trained with "
        "model.task=lm, e.g. preset gpt_small). Sampling (the default) and greedy search print "
        "the text as it is generated; beam search prints its best continuation at the end. "
        "Without PROMPT, or with '-', each line of stdin is a prompt and each continuation is "
        "printed on one line. The continuation stops at the end of a line of the training "
        "text (EOS) or after --max-new-tokens. With --data, print the model's perplexity on "
        "a prepared split instead.",
    )
    add_checkpoint_argument(parser)
    parser.add_argument(
        "prompt", nargs="?", default=_GENERATING["prompt"], help="the text to continue"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=_GENERATING["max_new_tokens"],
        help="default %(default)s",
    )
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--greedy", action="store_true", help="the most probable token each step")
    how.add_argument("--beam", type=int, metavar="K", help="beam search with K beams")
    parser.add_argument(
        "--alpha", type=float, default=_GENERATING["alpha"], help="beam: length penalty alpha"
    )
    parser.add_argument(
        "--temperature", type=float, default=_GENERATING["temperature"], help="sampling temperature"
    )
    parser.add_argument(
        "--top-k", type=int, default=_GENERATING["top_k"], help="sample among the K best (0: all)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=_GENERATING["top_p"],
        help="sample within the nucleus of mass P (1: off)",
    )
    parser.add_argument("--seed", type=int, help="seed of the sampling (repeatable output)")
    parser.add_argument(
        "--samples", type=int, default=_GENERATING["samples"], help="continuations per prompt"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    score = parser.add_argument_group("scoring (instead of generating)")
    score.add_argument(
        "--data",
        metavar="DATA_DIR",
        help="print the model's perplexity on a split of a directory prepared with "
        "`aiayn prepare --task lm` and the model's tokenizer",
    )
    score.add_argument("--split", help="the split of --data (default test)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.devices import pick_device
    from aiayn.inference.generation import GenerateOptions, TextGenerator
    from aiayn.inference.textio import decode_line

    if args.data:
        return _score(args)
    if args.split is not None:
        raise CLIError("--split goes with --data")
    if args.samples < 1:
        raise CLIError(f"--samples must be at least 1, got {args.samples}")
    sampling = not args.greedy and args.beam is None
    if not sampling and args.samples > 1:
        raise CLIError("--samples goes with sampling; greedy and beam search give one output")
    changed = [
        name
        for name, value, default in (
            ("--temperature", args.temperature, _GENERATING["temperature"]),
            ("--top-k", args.top_k, _GENERATING["top_k"]),
            ("--top-p", args.top_p, _GENERATING["top_p"]),
            ("--seed", args.seed, _GENERATING["seed"]),
        )
        if value != default
    ]
    if not sampling and changed:
        these = "them" if len(changed) > 1 else "it"
        verb = "set" if len(changed) > 1 else "sets"
        raise CLIError(
            f"{', '.join(changed)} {verb} the sampling; drop {these} with --greedy or --beam"
        )
    strategy: Strategy = "sample"
    if args.greedy or args.beam is not None:
        strategy = "greedy" if args.greedy else "beam"
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        strategy=strategy,
        beam_size=args.beam if args.beam is not None else 4,
        alpha=args.alpha,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    options.validate()
    generator = TextGenerator.from_checkpoint(args.checkpoint, pick_device(args.device or "auto"))
    if args.prompt != "-":
        for number in range(args.samples):
            if number:
                options = replace(options, seed=_next(options.seed))
            _stream(generator, args.prompt, options)
        return 0
    failed = 0
    for number, raw in enumerate(sys.stdin.buffer, 1):
        prompt = decode_line(raw, "stdin", number)
        try:
            generator.checked_prompt_ids(prompt)
        except UserError as err:  # said, answered with empty lines, and the next one read
            print(
                f"aiayn generate: error: stdin: line {number}: {err}", file=sys.stderr, flush=True
            )
            print("\n" * (args.samples - 1), flush=True)
            failed += 1
            continue
        for _ in range(args.samples):
            result = generator.generate(prompt, options)
            print(prompt + result.text, flush=True)
            options = replace(options, seed=_next(options.seed))
    return 2 if failed else 0


def _score(args: argparse.Namespace) -> int:
    """The perplexity of the model on a prepared split (the metrics `aiayn train` validates
    with)."""
    from aiayn.training.tasks import score_split

    generating = [
        "a prompt" if name == "prompt" else f"--{name.replace('_', '-')}"
        for name, default in _GENERATING.items()
        if getattr(args, name) != default
    ]
    if generating:
        verb = "go" if len(generating) > 1 else "goes"
        raise CLIError(f"--data scores the model; {', '.join(generating)} {verb} with generating")
    split = args.split or "test"
    metrics = score_split(args.checkpoint, args.data, split, args.device or "auto", tasks=("lm",))
    print(
        f"{split}: loss {metrics['loss']:.4f}, nll {metrics['nll']:.4f} per token, "
        f"perplexity {metrics['ppl']:.2f}"
    )
    return 0


def _next(seed: int | None) -> int | None:
    return None if seed is None else seed + 1


def _stream(generator: TextGenerator, prompt: str, options: GenerateOptions) -> None:
    """Print the prompt, then the continuation as it comes, then a newline; nothing where
    the prompt is refused (``options`` are checked already)."""
    generator.checked_prompt_ids(prompt)
    sys.stdout.write(prompt)
    sys.stdout.flush()

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generator.generate(prompt, options, on_text=show)
    if options.strategy == "beam":
        show(result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
