"""Text in, text out: tokenise, sort by length, batch by a token budget, search, restore the
input order, detokenise.

Input policy (documented in docs/translation.md):

- an empty line (or one that tokenises to nothing) gives an empty output in its place, without
  running the model, so the number of lines out always equals the number in;
- a line with more tokens than the model has positions (``model.max_positions``, EOS included)
  is cut to fit and translated, with a warning naming the line;
- an output never exceeds ``max_len_a * source_tokens + max_len_b`` tokens, nor
  ``model.max_positions - 1``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from aiayn.accel import (
    PRECISION_DTYPES,
    Acceleration,
    Precision,
    accelerate,
    cpu_has_bfloat16,
    use_compiled_step,
)
from aiayn.config import (
    MAX_ALPHA,
    DecodeConfig,
    ModelConfig,
    RunConfig,
    alpha_in_range,
    build_section,
)
from aiayn.data.collate import BOS_ID, EOS_ID, collate_pairs
from aiayn.devices import inference_attention
from aiayn.errors import ConfigError
from aiayn.inference.constrained import steered_search, tokens_needed
from aiayn.inference.loading import load_model
from aiayn.inference.scoring import (
    Score,
    batches_by_tokens,
    encode_targets,
    score_of,
    token_log_probs,
)
from aiayn.inference.search import (
    Hypothesis,
    beam_search,
    greedy_search,
    max_output_lengths,
    never_pad_or_bos,
)
from aiayn.inference.steering import Steering
from aiayn.inference.textio import checked_lines, one_line
from aiayn.model.families import TranslationModel
from aiayn.model.patterns import check_decodable


class IncrementalModel(Protocol):
    """What :func:`search_batch` needs of a translation model (every ``model.arch`` has it):
    the source encoded once (``memory``: the Transformer's (B, S, d_model) tensor, an RNN's
    :class:`~aiayn.model.rnn.EncoderStates`), a cache of ``beam_size`` rows per sentence, and
    the step function of search over that cache."""

    config: ModelConfig

    def encode(self, src_ids: Tensor, src_pad: Tensor | None) -> Any: ...

    def init_cache(
        self, memory: Any, src_pad: Tensor | None, max_len: int, beam_size: int = 1
    ) -> Any: ...

    def log_probs_step(self, tokens: Tensor, cache: Any) -> Tensor: ...


class TextTokenizer(Protocol):
    """What the translator needs of a tokenizer (``aiayn.data.tokenizer.Tokenizer`` is one)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Translation:
    """One hypothesis as text: ``score`` is the length-normalised log-probability that beam
    search ranks by, ``log_prob`` the plain one; ``tokens`` are the output ids;
    ``token_log_probs``, where asked for (:meth:`TextTranslator.with_word_scores`), the
    log-probability of each of them and then of the final EOS (they sum to ``log_prob``)."""

    text: str
    score: float
    log_prob: float
    tokens: list[int]
    token_log_probs: list[float] | None = None


def check_alpha(alpha: float, stored_in: str | Path | None = None) -> None:
    """Refuse (ConfigError, a ValueError) a length penalty that is not a number from 0 to
    :data:`~aiayn.config.MAX_ALPHA`, as the server's requests are refused; ``stored_in``: the
    checkpoint whose decode settings hold it."""
    if alpha_in_range(alpha):
        return
    if stored_in is not None:
        raise ConfigError(
            f"{stored_in}: its decode.alpha={alpha} is no length penalty from 0 to "
            f"{MAX_ALPHA:g}; pass --alpha (the paper's is 0.6)"
        )
    raise ConfigError(
        f"alpha (the length penalty) must be a number from 0 to {MAX_ALPHA:g}, got {alpha}"
    )


def decode_with(decode: DecodeConfig, overrides: Mapping[str, Any] | None) -> DecodeConfig:
    """``decode`` with ``overrides`` (``decode_overrides`` of ``from_checkpoint``), named and
    typed as the config file's ``[decode]`` keys: a ConfigError otherwise."""
    return build_section(DecodeConfig, {**asdict(decode), **dict(overrides or {})}, "decode")


def shortest_with_output(decode: DecodeConfig) -> int:
    """The fewest source tokens whose output limit (``floor(max_len_a · tokens +
    max_len_b)``) allows one token: 1 unless ``max_len_b`` is 0 and ``max_len_a`` under 1."""
    a, b = decode.max_len_a, decode.max_len_b
    if b >= 1 or a <= 0:
        return 1
    tokens = max(1, math.ceil(1 / a))
    while math.floor(tokens * a) < 1:  # 1 / a rounded down in float
        tokens += 1
    return tokens


def _print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def inference_dtype(
    precision: str, device: torch.device, warn: Callable[[str], None]
) -> torch.dtype:
    """The dtype for ``precision`` on ``device``; ValueError where it cannot run (fp16 on
    the CPU), a warning where it runs slowly (bf16 on a CPU without bfloat16 instructions,
    where its products are emulated)."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"unknown precision {precision!r} (one of {', '.join(PRECISION_DTYPES)})")
    if precision == "fp32":
        return torch.float32
    if precision == "fp16" and device.type == "cpu":
        raise ValueError("fp16 decoding needs a CUDA device; on the CPU, use bf16")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_bfloat16():
        warn(
            "precision bf16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX): "
            "its products are emulated, slower than fp32"
        )
    return PRECISION_DTYPES[precision]


def _weights_precision(model: nn.Module) -> Precision | None:
    """The precision of ``model``'s floating-point weights (None if mixed or none)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    names = [name for name, dtype in PRECISION_DTYPES.items() if {dtype} == dtypes]
    return names[0] if names else None  # type: ignore[return-value]


class TextTranslator:
    """The text side of translation, whatever engine searches: tokenising with the input
    policy of this module, length-sorted batches of at most ``decode.batch_tokens`` padded
    source tokens, and detokenised hypotheses in input order. A subclass searches a batch of
    token-id sources (:meth:`_search_batch`): :class:`Translator` with the PyTorch model,
    :class:`aiayn.interop.ct2_translator.Ct2Translator` with CTranslate2.

    ``decode`` gives the beam size (1 means greedy search), the length penalty ``alpha``, the
    output limit ``max_len_a * source_tokens + max_len_b`` and the batch budget
    ``batch_tokens`` (padded source tokens per batch, EOS included). ``nbest`` hypotheses are
    kept per sentence (at most the beam size). ``max_positions`` is the model's number of
    positions. ``warn`` receives warnings (default: stderr).
    """

    # The engine's name, as ``--engine`` spells it.
    engine_name = ""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        decode: DecodeConfig | None,
        *,
        max_positions: int,
        nbest: int = 1,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.decode = decode if decode is not None else DecodeConfig()
        # Told how many sentences each decoded batch held (progress); the file it came from.
        self.on_batch: Callable[[int], None] | None = None
        self.checkpoint: Path | None = None
        if self.decode.max_len_b < 0 or self.decode.max_len_a < 0:
            raise ValueError("max_len_a and max_len_b must be 0 or more")
        if self.decode.max_len_a == 0 and self.decode.max_len_b == 0:
            raise ValueError("max_len_a and max_len_b are both 0: every translation would be empty")
        if self.decode.beam_size < 1:
            raise ValueError(f"beam size must be at least 1, got {self.decode.beam_size}")
        check_alpha(self.decode.alpha)
        if not 1 <= nbest <= self.decode.beam_size:
            raise ValueError(
                f"nbest must be between 1 and the beam size ({self.decode.beam_size}), got {nbest}"
            )
        if self.decode.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be positive, got {self.decode.batch_tokens}")
        self.tokenizer = tokenizer
        self.nbest = nbest
        self.max_positions = max_positions
        self.warn = warn if warn is not None else _print_warning
        if (shortest := shortest_with_output(self.decode)) > 1:
            self.warn(
                f"max_len_a {self.decode.max_len_a:g} and max_len_b 0 leave no output token "
                f"to a source of fewer than {shortest} tokens: its translation is empty"
            )

    # -- text ------------------------------------------------------------------------------

    def translate(
        self,
        lines: Iterable[str],
        first_line: int = 1,
        *,
        constraints: Sequence[Sequence[str]] | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> list[str]:
        """One detokenised translation per line, in order (the best hypothesis); the
        keywords as :meth:`translate_nbest`'s."""
        nbest = self._translations(
            checked_lines(lines, "translate"), first_line, constraints, prefixes
        )
        return [hyps[0].text if hyps else "" for hyps in nbest]

    def translate_nbest(
        self,
        lines: Iterable[str],
        first_line: int = 1,
        *,
        constraints: Sequence[Sequence[str]] | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> list[list[Translation]]:
        """Up to ``nbest`` translations per line, best first; an empty line gives ``[]``.
        ``first_line`` numbers the lines in warnings.

        ``constraints``: per line, the phrases (plain text) that its translation must hold,
        each whole (terminology; docs/translation.md); ``prefixes``: per line, the text its
        translation starts with ("" for none). Either has one entry per line. A line whose
        constraints cannot fit its output limit is translated without them, with a warning."""
        return self._translations(
            checked_lines(lines, "translate_nbest"), first_line, constraints, prefixes
        )

    def _translations(
        self,
        lines: list[str],
        first_line: int,
        constraints: Sequence[Sequence[str]] | None = None,
        prefixes: Sequence[str] | None = None,
    ) -> list[list[Translation]]:
        """:meth:`translate_nbest` of lines already checked."""
        sources = [self.encode_source(line, first_line + i) for i, line in enumerate(lines)]
        if constraints is None and prefixes is None:
            return self.translations(self.search_ids(sources))
        for name, given in (("constraints", constraints), ("prefixes", prefixes)):
            if given is not None and (isinstance(given, str) or len(given) != len(lines)):
                count = "one string" if isinstance(given, str) else f"{len(given)} entries"
                raise ValueError(f"{name} needs one entry per line ({len(lines)}), got {count}")
        steering = [
            self.encode_steering(
                source,
                constraints[i] if constraints is not None else (),
                prefixes[i] if prefixes is not None else "",
                first_line + i,
            )
            for i, source in enumerate(sources)
        ]
        return self.translations(self.search_ids(sources, steering))

    def translations(self, results: Sequence[list[Hypothesis]]) -> list[list[Translation]]:
        """The detokenised :class:`Translation` of each of :meth:`search_ids`' hypotheses."""
        return [
            [
                Translation(
                    one_line(self.tokenizer.decode(h.tokens)), h.score, h.log_prob, h.tokens
                )
                for h in hyps
            ]
            for hyps in results
        ]

    def encode_source(self, line: str, line_number: int | None = None) -> list[int]:
        """Token ids of one source line (no EOS), cut to the model's positions with a warning."""
        if not line.strip():
            return []
        ids = self.tokenizer.encode(line)
        room = self.max_positions - 1  # the source also carries EOS
        if len(ids) > room:
            where = f"line {line_number}" if line_number is not None else "input"
            self.warn(
                f"{where}: {len(ids)} tokens (+ EOS) exceed the model's {self.max_positions} "
                f"positions; translating the first {room}"
            )
            ids = ids[:room]
        return ids

    def encode_target(self, text: str) -> list[int]:
        """Target-side token ids of ``text`` (the tokenizer's target encoder where it has
        one). A sentencepiece model's pieces start a word with its space mark, so a phrase
        encodes alone as it does inside a sentence after a space."""
        encode_target = getattr(self.tokenizer, "encode_target", None)
        if encode_target is not None:
            return list(encode_target(text))
        batch = getattr(self.tokenizer, "encode_target_batch", None)
        if batch is not None:
            return list(batch([text])[0])
        return self.tokenizer.encode(text)

    def encode_steering(
        self,
        source: Sequence[int],
        constraints: Sequence[str] = (),
        prefix: str = "",
        line_number: int | None = None,
    ) -> Steering:
        """The :class:`Steering` of one source's ``constraints`` (phrases of target text) and
        ``prefix`` (target text); ValueError (naming the line) for a phrase that encodes to
        nothing. A prefix longer than the model's positions is cut, and constraints that do
        not fit the source's output limit are dropped, each with a warning
        (:meth:`fitted_steering`)."""
        where = f"line {line_number}" if line_number is not None else "input"
        if isinstance(constraints, str):
            raise TypeError(f"{where}: constraints are a list of phrases, not one string")
        phrases = []
        for number, phrase in enumerate(constraints, 1):
            if not isinstance(phrase, str):
                raise TypeError(f"{where}: phrase {number} is {type(phrase).__name__}, not str")
            ids = self.encode_target(phrase.strip()) if phrase.strip() else []
            if not ids:
                raise ValueError(f"{where}: constraint {number} ({phrase!r}) is empty")
            phrases.append(tuple(ids))
        if not isinstance(prefix, str):
            raise TypeError(f"{where}: the prefix is {type(prefix).__name__}, not str")
        prefix_ids = self.encode_target(prefix) if prefix.strip() else []
        room = self.max_positions - 1
        if len(prefix_ids) > room:
            self.warn(
                f"{where}: the target prefix's {len(prefix_ids)} tokens exceed the model's "
                f"{room} output positions; keeping the first {room}"
            )
            prefix_ids = prefix_ids[:room]
        return self.fitted_steering(len(source), Steering(tuple(phrases), tuple(prefix_ids)), where)

    def output_limit(self, source_tokens: int, prefix_tokens: int = 0) -> int:
        """The most output tokens of a source of ``source_tokens`` tokens (no EOS): the
        decode settings' limit, raised to hold a prefix of ``prefix_tokens``, within the
        model's positions."""
        room = self.max_positions - 1
        limit = max_output_lengths(
            torch.tensor([source_tokens]), self.decode.max_len_a, self.decode.max_len_b, room
        )
        return min(max(int(limit[0]), prefix_tokens), room)

    def fitted_steering(self, source_tokens: int, steering: Steering, where: str) -> Steering:
        """``steering``, or its prefix alone with a warning naming ``where`` when its
        constraints need more output tokens than the source's limit allows."""
        if not steering.constraints or not source_tokens:
            return steering
        limit = self.output_limit(source_tokens, len(steering.prefix))
        if (needed := tokens_needed(steering)) <= limit:
            return steering
        self.warn(
            f"{where}: its constraints need {needed - len(steering.prefix)} output tokens "
            f"after the prefix, more than its limit of {limit - len(steering.prefix)}; "
            "translated without them"
        )
        return Steering((), steering.prefix)

    # -- ids -------------------------------------------------------------------------------

    def search_ids(
        self, sources: Sequence[Sequence[int]], steering: Sequence[Steering] | None = None
    ) -> list[list[Hypothesis]]:
        """Hypotheses for token-id sources (no EOS, at most ``max_positions - 1`` ids each), in
        input order; an empty source gives ``[]``. Sources are sorted by length and packed
        into batches of at most ``batch_tokens`` padded tokens. ``steering``: one
        :class:`Steering` per source (constraints that do not fit a source's limit are
        dropped with a warning naming the source: :meth:`encode_steering` has done so for a
        line already)."""
        if steering is not None:
            if len(steering) != len(sources):
                raise ValueError(
                    f"steering needs one entry per source ({len(sources)}), got {len(steering)}"
                )
            steering = [
                self.fitted_steering(len(s), steer, f"source {i + 1}")
                for i, (s, steer) in enumerate(zip(sources, steering, strict=True))
            ]
            if not any(steering):
                steering = None
        results: list[list[Hypothesis]] = [[] for _ in sources]
        order = sorted((i for i, s in enumerate(sources) if s), key=lambda i: -len(sources[i]))
        start = 0
        while start < len(order):
            width = len(sources[order[start]]) + 1  # the longest of the batch, EOS included
            count = max(1, self.decode.batch_tokens // width)
            chunk = order[start : start + count]
            batch = [sources[i] for i in chunk]
            if steering is None:  # (an engine without steering takes no second argument)
                found = self._search_batch(batch)
            else:
                found = self._search_batch(batch, [steering[i] for i in chunk])
            for i, hyps in zip(chunk, found, strict=True):
                results[i] = hyps
            start += count
            if self.on_batch is not None:
                self.on_batch(len(chunk))
        return results

    def _search_batch(
        self, sources: list[Sequence[int]], steering: Sequence[Steering] | None = None
    ) -> list[list[Hypothesis]]:
        """Hypotheses for one batch of non-empty sources, in its order (the engine's part);
        ``steering``: one per source, or None where nothing is steered."""
        raise NotImplementedError

    def engine_details(self) -> dict[str, Any]:
        """What the engine says of itself (plain JSON data): ``engine`` (its name), ``device``
        and its own settings (the server's ``GET /v1/model`` reports them)."""
        raise NotImplementedError

    # -- scores (aiayn.inference.scoring) --------------------------------------------------

    def score_pairs(
        self, sources: Iterable[str], targets: Iterable[str], first_line: int = 1
    ) -> list[Score]:
        """The model's score of each target line given its source line, teacher-forced, in
        order. A ValueError names the line (numbered from ``first_line``) where the two
        differ in number, a side is empty or the target has more tokens than the model's
        positions; a source that long is cut as :meth:`encode_source` cuts it."""
        src_lines = checked_lines(sources, "score_pairs")
        tgt_lines = checked_lines(targets, "score_pairs")
        if len(src_lines) != len(tgt_lines):
            raise ValueError(f"{len(src_lines)} source lines but {len(tgt_lines)} target lines")
        src_ids = []
        tgt_ids = encode_targets(self.tokenizer, [t if t.strip() else "" for t in tgt_lines])
        for i, source in enumerate(src_lines):
            number = first_line + i
            src_ids.append(self.encode_source(source, number))
            for side, ids in (("source", src_ids[-1]), ("target", tgt_ids[i])):
                if not ids:
                    raise ValueError(f"line {number}: the {side} is empty")
            if len(tgt_ids[i]) > self.max_positions - 1:
                raise ValueError(
                    f"line {number}: the target's {len(tgt_ids[i])} tokens (+ EOS) exceed "
                    f"the model's {self.max_positions} positions"
                )
        return self.score_ids(src_ids, tgt_ids)

    def score_ids(
        self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]
    ) -> list[Score]:
        """:meth:`score_pairs` of token ids: non-empty sources (no EOS, at most
        ``max_positions - 1`` ids), targets (no BOS or EOS, possibly empty, at most
        ``max_positions - 1`` ids), in batches of at most ``decode.batch_tokens`` padded
        tokens, longest first."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        scores: list[Score | None] = [None] * len(sources)
        for chunk in batches_by_tokens(sources, targets, self.decode.batch_tokens):
            batch_src = [sources[i] for i in chunk]
            batch_tgt = [targets[i] for i in chunk]
            if not all(batch_src):
                raise ValueError("an empty source has no score")
            for i, lps in zip(chunk, self._score_batch(batch_src, batch_tgt), strict=True):
                scores[i] = score_of(targets[i], lps)
            if self.on_batch is not None:
                self.on_batch(len(chunk))
        return [s for s in scores if s is not None]

    def with_word_scores(
        self, sources: Sequence[Sequence[int]], results: Sequence[list[Translation]]
    ) -> list[list[Translation]]:
        """``results`` (the translations of ``sources``, token ids as :meth:`search_ids`
        takes them) with their ``token_log_probs``: the emitted tokens scored teacher-forced
        (one more pass of the decoder), which gives what search summed to float32 rounding."""
        pairs = [(i, j) for i, hyps in enumerate(results) for j in range(len(hyps))]
        on_batch, self.on_batch = self.on_batch, None  # progress counts the search's lines
        try:
            scored = self.score_ids(
                [sources[i] for i, _ in pairs], [results[i][j].tokens for i, j in pairs]
            )
        finally:
            self.on_batch = on_batch
        out = [list(hyps) for hyps in results]
        for (i, j), score in zip(pairs, scored, strict=True):
            out[i][j] = replace(out[i][j], token_log_probs=score.token_log_probs)
        return out

    def _score_batch(
        self, sources: list[Sequence[int]], targets: list[Sequence[int]]
    ) -> list[list[float]]:
        """The log-probability of each target token and its EOS, for one batch of pairs
        (the engine's part)."""
        raise NotImplementedError


class Translator(TextTranslator):
    """Translates sentences with a trained translation model (the PyTorch engine): the
    :class:`~aiayn.model.transformer.Transformer` or an RNN baseline of ``model.arch``; the
    settings and the text side are :class:`TextTranslator`'s.

    ``device`` (default: where ``model``'s parameters are) is where it decodes; ``model`` is
    moved there. ``precision`` is the dtype of the weights and products: ``"fp32"`` (the
    default), ``"bf16"`` (on the CPU: one with bfloat16 instructions, AVX512-BF16 or AMX; or
    CUDA) or ``"fp16"`` (CUDA only). Anything but fp32 converts ``model``'s parameters in place; the
    log-softmax and the beam scores stay in float32.

    On the CPU the model is accelerated for decoding (:func:`aiayn.accel.accelerate`: the
    same translations, faster; ``accelerated=False`` decodes with the plain model), and
    ``pack_weights`` packs its float32 weights once for the CPU's matrix library: by default
    (None) where that is oneDNN (CPUs other than Intel's: faster decoder steps at every batch
    size), True also for MKL on an Intel CPU (faster steps over 4 to 128 rows), False never;
    a pack takes memory besides the weights (docs/translation.md).

    ``compiled_step``: decodes of up to 16 rows (sentences × beam), greedy decodes of more
    and beam 4 searches of more, through the model's decoder step compiled ahead of time
    (:mod:`aiayn.accel.compiled`, float32 Transformers on the CPU): by default (None) when it
    has been compiled on this machine before, True compiles it first where it has not (its
    three libraries, one to two minutes for a small model), False never.

    Terminology constraints and a forced prefix per sentence: the ``constraints`` and
    ``prefixes`` of :meth:`translate` and :meth:`translate_nbest`, searched by
    :func:`aiayn.inference.constrained.steered_search` (docs/translation.md).

    ``process_settings``: also the process-wide settings of :func:`aiayn.accel.accelerate`
    (malloc thresholds), for a program that owns its process
    (``aiayn translate``, ``serve`` and ``demo`` pass it); by default nothing outside the model
    changes.
    """

    engine_name = "torch"

    def __init__(
        self,
        model: TranslationModel,
        tokenizer: TextTokenizer,
        decode: DecodeConfig | None = None,
        *,
        nbest: int = 1,
        device: torch.device | str | None = None,
        warn: Callable[[str], None] | None = None,
        pack_weights: bool | None = None,
        precision: Precision = "fp32",
        accelerated: bool = True,
        compiled_step: bool | None = None,
        process_settings: bool = False,
    ) -> None:
        super().__init__(
            tokenizer, decode, max_positions=model.config.max_positions, nbest=nbest, warn=warn
        )
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()  # as TextGenerator and TextClassifier do
        dtype = inference_dtype(precision, self.device, self.warn)
        if dtype is not torch.float32:
            self.model.to(dtype)
        self.acceleration: Acceleration | None = None
        weights = _weights_precision(self.model)
        tried = False

        def step_first(acceleration: Acceleration) -> None:
            # Before the packs: loading the step briefly holds two copies of its weights.
            nonlocal tried
            tried = True
            if compiled_step is not False:
                use_compiled_step(self.model, acceleration, bool(compiled_step), self.warn)

        if accelerated and weights in ("fp32", "bf16"):  # what the CPU levers serve
            self.acceleration = accelerate(
                self.model,
                "decode",
                precision=weights,
                pack_weights=pack_weights,
                process_settings=process_settings,
                before_packing=step_first,
            )
        if pack_weights and (self.acceleration is None or not self.acceleration.packed):
            self.warn(
                "pack weights: nothing to pack (it needs float32 linear layers on the CPU "
                "and a PyTorch built with MKL or oneDNN); decoding without it"
            )
        if compiled_step and not tried:
            if self.acceleration is not None:  # a model not on the CPU: it says so
                use_compiled_step(self.model, self.acceleration, True, self.warn)
            else:
                self.warn(
                    "compiled step: it serves a model accelerated for the CPU (not with "
                    "accelerated=False); decoding without it"
                )

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        decode_overrides: Mapping[str, Any] | None = None,
        nbest: int = 1,
        warn: Callable[[str], None] | None = None,
        pack_weights: bool | None = None,
        precision: Precision = "fp32",
        compiled_step: bool | None = None,
        mmap: bool = True,
        process_settings: bool = False,
    ) -> tuple[Translator, RunConfig]:
        """A translator for a checkpoint file or run directory, with the run's decode settings
        updated by ``decode_overrides`` (field names of :class:`DecodeConfig`); and the run's
        config. ``mmap``: the weights mapped from the file, else read
        (:func:`~aiayn.inference.loading.load_model`). int8 weights are CTranslate2's:
        ``aiayn.interop.ct2_translator.Ct2Translator.from_checkpoint(path, quantize="int8")``
        (docs/translation.md, "int8")."""
        loaded = load_model(path, device, tasks=("translation",), mmap=mmap)
        model, config, tokenizer = loaded.model, loaded.config, loaded.tokenizer
        check_decodable(config.model.decoder_attention, loaded.path)
        if "alpha" not in (decode_overrides or {}):
            check_alpha(config.decode.alpha, stored_in=loaded.path)
        assert isinstance(model, TranslationModel)
        translator = cls(
            model,
            tokenizer,
            decode_with(config.decode, decode_overrides),
            nbest=nbest,
            device=device,
            warn=warn,
            pack_weights=pack_weights,
            precision=precision,
            compiled_step=compiled_step,
            process_settings=process_settings,
        )
        translator.checkpoint = loaded.path
        return translator, config

    def engine_details(self) -> dict[str, Any]:
        """The engine, the device, the weights' dtypes and whether the model is accelerated
        for the CPU."""
        weights = {str(p.dtype).removeprefix("torch.") for p in self.model.parameters()}
        return {
            "engine": self.engine_name,
            "device": str(self.device),
            "weights_dtype": sorted(weights),
            # A model off the CPU is handed back as it is: no lever applies there.
            "accelerated": self.acceleration is not None and bool(self.acceleration.levers),
        }

    def _score_batch(
        self, sources: list[Sequence[int]], targets: list[Sequence[int]]
    ) -> list[list[float]]:
        return token_log_probs(
            self.model,
            sources,
            targets,
            device=self.device,
            bos_output=self.model.config.bos_output,
        )

    @torch.inference_mode()
    def _search_batch(
        self, sources: list[Sequence[int]], steering: Sequence[Steering] | None = None
    ) -> list[list[Hypothesis]]:
        """Unsteered sentences by :func:`search_batch`; steered ones (if any) apart, by
        :func:`search_steered_batch`: a sentence without steering is searched as it would be
        without the option, whatever shares its batch."""
        steered = [i for i, steer in enumerate(steering or ()) if steer]
        if not steered:
            return self._search_plain(sources)
        assert steering is not None
        plain = [i for i, steer in enumerate(steering) if not steer]
        results: list[list[Hypothesis]] = [[] for _ in sources]
        if plain:
            for i, hyps in zip(plain, self._search_plain([sources[i] for i in plain]), strict=True):
                results[i] = hyps
        batch = collate_pairs([sources[i] for i in steered])
        found = search_steered_batch(
            self.model,
            batch.src_ids.to(self.device),
            batch.src_pad.to(self.device),
            self.decode,
            [steering[i] for i in steered],
            nbest=self.nbest,
        )
        for i, hyps in zip(steered, found, strict=True):
            results[i] = hyps
        return results

    def _search_plain(self, sources: list[Sequence[int]]) -> list[list[Hypothesis]]:
        batch = collate_pairs(sources)
        src_ids = batch.src_ids.to(self.device)
        src_pad = batch.src_pad.to(self.device)
        return search_batch(self.model, src_ids, src_pad, self.decode, nbest=self.nbest)


def search_batch(
    model: IncrementalModel,
    src_ids: Tensor,
    src_pad: Tensor,
    decode: DecodeConfig,
    *,
    nbest: int = 1,
) -> list[list[Hypothesis]]:
    """Search a collated batch (``src_ids`` (B, S) ending in EOS, ``src_pad`` True at padding)
    as :class:`Translator` does: at most ``max_len_a · source tokens + max_len_b`` output
    tokens (and ``model.config.max_positions - 1``), PAD and BOS never output, greedy search
    for ``beam_size`` 1, else beam search by ``decode.beam_rule``. One list of up to ``nbest``
    hypotheses per sentence, best first. Validation BLEU decodes with it too."""
    with inference_attention(src_ids.device):
        return _search_collated(model, src_ids, src_pad, decode, nbest)


def _search_collated(
    model: IncrementalModel, src_ids: Tensor, src_pad: Tensor, decode: DecodeConfig, nbest: int
) -> list[list[Hypothesis]]:
    src_lengths = (~src_pad).sum(-1) - 1  # without the EOS that ends every source
    limit = model.config.max_positions - 1
    limits = max_output_lengths(src_lengths, decode.max_len_a, decode.max_len_b, limit=limit)
    memory = model.encode(src_ids, src_pad)  # (B, S, d_model), or an RNN's EncoderStates
    k = decode.beam_size
    # Rows i*K .. (i+1)*K - 1 are sentence i's K beams; its memory is projected and stored
    # once for them, and beam search's reorders stay within the group.
    cache = model.init_cache(memory, src_pad, int(limits.max()) + 1, beam_size=k)
    step = never_pad_or_bos(model.log_probs_step, model.config.bos_output)
    common: dict[str, Any] = {
        "max_len": limits,
        "alpha": decode.alpha,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "device": src_ids.device,
    }
    if k == 1:
        return [[h] for h in greedy_search(step, cache, src_ids.size(0), **common)]
    return beam_search(
        step, cache, src_ids.size(0), beam_size=k, nbest=nbest, rule=decode.beam_rule, **common
    )


def search_steered_batch(
    model: IncrementalModel,
    src_ids: Tensor,
    src_pad: Tensor,
    decode: DecodeConfig,
    steering: Sequence[Steering],
    *,
    nbest: int = 1,
) -> list[list[Hypothesis]]:
    """:func:`search_batch` of sentences that are steered
    (:func:`~aiayn.inference.constrained.steered_search`): each sentence's output limit is
    raised to hold its prefix (within the model's positions); beam size 1 searches by the
    fairseq rule, which is greedy search where nothing but a prefix steers."""
    with inference_attention(src_ids.device):
        src_lengths = (~src_pad).sum(-1) - 1
        limit = model.config.max_positions - 1
        limits = max_output_lengths(src_lengths, decode.max_len_a, decode.max_len_b, limit=limit)
        prefix = torch.tensor([len(s.prefix) for s in steering], device=limits.device)
        limits = torch.maximum(limits, prefix).clamp(max=limit)
        memory = model.encode(src_ids, src_pad)
        k = decode.beam_size
        cache = model.init_cache(memory, src_pad, int(limits.max()) + 1, beam_size=k)
        step = never_pad_or_bos(model.log_probs_step, model.config.bos_output)
        return steered_search(
            step,
            cache,
            steering,
            beam_size=k,
            alpha=decode.alpha,
            max_len=limits,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            nbest=nbest,
            rule="fairseq" if k == 1 else decode.beam_rule,
            device=src_ids.device,
        )
