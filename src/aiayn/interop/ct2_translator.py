"""CTranslate2 as an engine of ``aiayn translate``: the export of a checkpoint (cached beside
it, :func:`aiayn.interop.ct2.cached_export`) decoded by ``ctranslate2.Translator`` with
aiayn's tokenisation, input policy, batching, output limit and length penalty.

How aiayn's decoding maps onto CTranslate2's (docs/interop.md):

- beam size, n-best (``num_hypotheses``), device and threads map directly; each of aiayn's
  batches (length-sorted, at most ``batch_tokens`` padded source tokens) is one
  ``translate_batch`` call per output limit within it, so that every sentence gets its own
  limit ``floor(max_len_a · source tokens + max_len_b)``;
- CTranslate2's beam search finishes a hypothesis when EOS is among the best ``beam_size``
  candidates and stops a sentence once ``beam_size`` have finished (unless its length
  penalty is 0): aiayn's ``fairseq`` rule, which this engine therefore requires (``paper``
  has no CTranslate2 equivalent);
- CTranslate2 ranks by ``log P / length ** length_penalty``, aiayn by GNMT's
  ``log P / ((5 + |Y|) / 6) ** alpha`` (|Y| counting EOS): CTranslate2 returns all
  ``beam_size`` hypotheses with their scores, the penalty is undone and GNMT's applied here.
  Where more than ``beam_size`` finish at once, CTranslate2 keeps the best ``beam_size`` by
  its own penalty, which no power law can make rank as GNMT's does at every length. It
  decodes with the power law that favours short hypotheses least as GNMT does
  (:func:`ranking_penalties`); a sentence where a dropped hypothesis could still be among
  GNMT's best ``nbest`` is decoded again with the one that favours long hypotheses most,
  and both sets join. The search itself does not depend on the penalty, so the two
  decodings finish the same hypotheses; for a sentence that ends before its limit and holds
  no PAD or BOS, GNMT's best two are in one of them (:func:`ranking_penalties` says why);
- aiayn allows only EOS after ``limit`` output tokens. CTranslate2 decodes that step too
  (``max_decoding_length = limit + 1``), where it ends each of its best ``beam_size``
  candidates, EOS or not: one that is not is cut back to ``limit`` tokens and scored with
  EOS here (``score_batch``). Greedy search agrees exactly. In beam search those
  candidates can extend fewer than ``beam_size`` beams, while aiayn ends each of its live
  beams with EOS: a sentence with a hypothesis cut at the limit is decoded again to
  ``limit`` steps, whose last step returns the live beams, and they join the hypotheses;
- aiayn never outputs PAD or BOS: their log-probabilities are set to -inf after the
  log-softmax, which leaves the other tokens' as they are. CTranslate2 can suppress a token
  only before its softmax (``suppress_sequences``), which renormalises the others, so it
  decodes without that, and a sentence where a hypothesis holds PAD or BOS (a model that is
  barely trained) is decoded again with both suppressed and its hypotheses scored again,
  teacher-forced, with the full distribution's log-probabilities, aiayn's. (A model with
  ``model.bos_output = false`` decodes from a distribution renormalised without BOS: its
  export gives BOS a logit bias that takes it out of CTranslate2's softmax, searches and
  scores alike, :data:`aiayn.interop.ct2.NO_OUTPUT_BIAS`.)
- a forced prefix (:class:`~aiayn.inference.steering.Steering`) is CTranslate2's
  ``target_prefix``, within the output limit (raised to the prefix's length where it is
  shorter). CTranslate2's score leaves the prefix out (it divides the log-probability of the
  tokens after it by the penalty of the whole length): the prefix's log-probability, scored
  teacher-forced, is added, so that the prefix is scored as aiayn's search scores it.
  CTranslate2 also ranks without it: where more than ``beam_size`` finish, the hypotheses it
  keeps need not bracket GNMT's best as :func:`ranking_penalties` shows without a prefix, so
  a prefixed sentence is always decoded under both powers (``alpha`` > 0), and the union is
  ranked by GNMT's score. Constraints are refused: CTranslate2 has no constrained search;
- scores of given targets (``score_pairs``, ``translate --word-scores``) are CTranslate2's
  ``score_batch``: the full distribution's log-probabilities, aiayn's.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiayn.config import DecodeConfig, ModelConfig, RunConfig
from aiayn.data.collate import BOS_ID, EOS_ID, PAD_ID
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.inference.loading import AVERAGED_NAME, resolve_checkpoint
from aiayn.inference.search import Hypothesis, gnmt_length_penalty
from aiayn.inference.steering import Steering
from aiayn.inference.translator import TextTranslator, check_alpha, decode_with
from aiayn.interop.ct2 import cached_export, import_ctranslate2, read_export, vocabularies

# A length penalty that changes no score (length ** 1e-30 == 1.0 in float32) but is not 0,
# which would make CTranslate2 stop a sentence at its first finished best beam.
RAW_SCORES = 1e-30

# aiayn's precisions and int8 quantization as CTranslate2 compute types.
_COMPUTE_TYPES = {
    (None, "fp32"): "default",  # the exported weights' type
    (None, "bf16"): "bfloat16",
    (None, "fp16"): "float16",
    ("int8", "fp32"): "int8_float32",
    ("int8", "bf16"): "int8_bfloat16",
    ("int8", "fp16"): "int8_float16",
}


def compute_type(quantize: str | None, precision: str) -> str:
    """The CTranslate2 compute type for ``translate --quantize Q --precision P``."""
    if quantize not in (None, "int8"):
        raise ValueError(f"unknown quantization {quantize!r} (only int8)")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"unknown precision {precision!r} (fp32, bf16, fp16)")
    return _COMPUTE_TYPES[(quantize, precision)]


def ranking_penalties(alpha: float, steps: int) -> tuple[float, float]:
    """The two powers ``p`` with which CTranslate2's ``log P / length ** p`` brackets GNMT's
    ``log P / ((5 + n) / 6) ** alpha`` over hypotheses of 1 to ``steps`` tokens (EOS counted).

    Between two lengths a < b, the power that ranks as GNMT does is the slope of
    ``alpha · log((5 + n) / 6)`` against ``log n`` between them, which lies between that
    curve's slopes at n = 1 and n = ``steps``: ``alpha / 6`` and ``alpha · steps / (5 +
    steps)`` (in that order for ``alpha`` ≥ 0). So the hypotheses ranked above GNMT's best
    under the first power are all shorter than it, and under the second all longer: two
    disjoint sets. CTranslate2 stops once ``beam_size`` hypotheses have finished, so at most
    ``2 · beam_size - 1`` finish; for GNMT's best to be dropped under both powers, the two sets
    would need ``beam_size`` each, more than there are (for the second best, the two sets can
    share only the best: still too many). Both are :data:`RAW_SCORES` for ``alpha`` 0, where
    raw log-probabilities rank as GNMT's."""
    if alpha == 0:
        return RAW_SCORES, RAW_SCORES
    ends = (alpha / 6.0, alpha * steps / (5.0 + steps))
    return min(ends), max(ends)


def resolve_without_loading(path: str | os.PathLike[str]) -> Path:
    """The checkpoint file of a file or run directory, as :func:`resolve_checkpoint` finds it,
    but without reading a file given or a run's ``averaged.pt`` (the export cache is checked
    before anything is loaded)."""
    path = Path(path)
    if path.is_dir():
        if (path / AVERAGED_NAME).is_file():
            return path / AVERAGED_NAME
        return resolve_checkpoint(path)
    return path


class Ct2Translator(TextTranslator):
    """Translates with a CTranslate2 export of an aiayn model (``model_dir``, written by
    :func:`aiayn.interop.ct2.export_ct2`); the text side, the settings and the results are
    those of :class:`~aiayn.inference.translator.Translator` (see the module docstring for
    how the search maps). ``decode.beam_rule`` must be ``"fairseq"`` for beam search.

    ``compute_type`` is CTranslate2's (``"default"``: the exported weights' type), ``threads``
    its threads per translation (``intra_threads``; 0: CTranslate2's default), ``device``
    ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    """

    engine_name = "ctranslate2"

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tokenizer: Tokenizer,
        decode: DecodeConfig | None,
        model_config: ModelConfig,
        *,
        nbest: int = 1,
        device: str = "cpu",
        compute_type: str = "default",
        threads: int = 0,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            tokenizer, decode, max_positions=model_config.max_positions, nbest=nbest, warn=warn
        )
        if self.decode.beam_size > 1 and self.decode.beam_rule != "fairseq":
            raise ValueError(
                "CTranslate2's beam search stops as the fairseq rule does (beam_rule "
                f"{self.decode.beam_rule!r} has no CTranslate2 equivalent): use "
                "--beam-rule fairseq, or --engine torch"
            )
        if threads < 0:
            raise ValueError(f"threads must be 0 (the default) or more, got {threads}")
        ct2 = import_ctranslate2()
        kind, _, index = device.partition(":")
        self.model_dir = Path(model_dir)
        self.device = device
        try:
            self.engine = ct2.Translator(
                str(self.model_dir),
                device=kind,
                device_index=int(index or 0),
                compute_type=compute_type,
                inter_threads=1,
                intra_threads=threads,
            )
        except (RuntimeError, ValueError) as err:
            raise UserError(f"CTranslate2 cannot load {self.model_dir}: {err}") from None
        self.compute_type = str(self.engine.compute_type)
        self.threads = threads
        source, target = vocabularies(tokenizer)
        self._source_pieces = source
        self._target_pieces = target
        # A piece listed twice is the first one's id, as in CTranslate2's vocabulary.
        self._target_ids: dict[str, int] = {}
        for i, piece in enumerate(target):
            self._target_ids.setdefault(piece, i)
        self._never = [[target[PAD_ID]], [target[BOS_ID]]]
        # Kept alive while the translator is: an export made for this run only.
        self.scratch: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        decode_overrides: Mapping[str, Any] | None = None,
        nbest: int = 1,
        quantize: str | None = None,
        precision: str = "fp32",
        threads: int = 0,
        warn: Callable[[str], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> tuple[Ct2Translator, RunConfig]:
        """A translator for a checkpoint file or run directory, through its export cached
        beside the checkpoint (made now if missing or stale; ``log`` hears of it): float32
        weights, or int8 with ``quantize="int8"``. The run's decode settings are updated by
        ``decode_overrides``; the beam rule is ``"fairseq"`` unless they name another (which
        is refused). Also returns the run's config."""
        compute = compute_type(quantize, precision)
        checkpoint = resolve_without_loading(path)
        # Names, types and alpha checked before an export, which takes a while.
        overrides = dict(decode_overrides or {})
        checked = decode_with(DecodeConfig(), overrides)
        if "alpha" in overrides:
            check_alpha(checked.alpha)
        scratch: list[tempfile.TemporaryDirectory[str]] = []

        def scratch_dir() -> Path:
            scratch.append(tempfile.TemporaryDirectory(prefix="aiayn-ct2-"))
            return Path(scratch[-1].name)

        model_dir = cached_export(checkpoint, quantize, log=log, scratch=scratch_dir)
        export = read_export(model_dir)
        config = export.config
        if config.model.task != "translation":
            raise UserError(f"{checkpoint}: not a translation model")
        if "alpha" not in overrides:
            check_alpha(config.decode.alpha, stored_in=checkpoint)
        overrides = {"beam_rule": "fairseq", **overrides}
        translator = cls(
            model_dir,
            export.tokenizer,
            decode_with(config.decode, overrides),
            config.model,
            nbest=nbest,
            device=device,
            compute_type=compute,
            threads=threads,
            warn=warn,
        )
        translator.checkpoint = checkpoint
        translator.scratch = scratch[0] if scratch else None
        return translator, config

    def engine_details(self) -> dict[str, Any]:
        """The engine, the device, CTranslate2's compute type and its threads per translation
        (None: CTranslate2's default)."""
        return {
            "engine": self.engine_name,
            "device": self.device,
            "compute_type": self.compute_type,
            "threads": self.threads or None,
        }

    # -- search -------------------------------------------------------------------------------

    def _search_batch(
        self, sources: list[Sequence[int]], steering: Sequence[Steering] | None = None
    ) -> list[list[Hypothesis]]:
        """One ``translate_batch`` call per output limit among ``sources``. A forced prefix
        (``steering``) goes to CTranslate2's ``target_prefix``, and is scored (CTranslate2's
        own score leaves it out: its log-probability is added); the output limit of a sentence
        is at least its prefix. Constraints are refused (ValueError): CTranslate2 has no
        constrained search."""
        decode = self.decode
        steer = list(steering) if steering is not None else [Steering()] * len(sources)
        if len(steer) != len(sources):
            raise ValueError(f"{len(sources)} sources but {len(steer)} steerings")
        if any(s.constraints for s in steer):
            raise ValueError(
                "CTranslate2 has no constrained search: terminology constraints need the "
                "PyTorch engine (--engine torch)"
            )
        room = self.max_positions - 1
        limits = [
            max(
                len(s.prefix),
                min(room, max(0, math.floor(len(src) * decode.max_len_a + decode.max_len_b))),
            )
            for src, s in zip(sources, steer, strict=True)
        ]
        groups: dict[int, list[int]] = {}
        for i, limit in enumerate(limits):
            groups.setdefault(limit, []).append(i)
        results: list[list[Hypothesis]] = [[] for _ in sources]
        for limit, rows in groups.items():
            pieces = [[self._source_pieces[t] for t in sources[i]] for i in rows]
            prefixes = [[self._target_pieces[t] for t in steer[i].prefix] for i in rows]
            for i, hyps in zip(rows, self._search_group(pieces, limit, prefixes), strict=True):
                results[i] = hyps
        return results

    def _search_group(
        self, pieces: list[list[str]], limit: int, prefixes: list[list[str]] | None = None
    ) -> list[list[Hypothesis]]:
        """Hypotheses for sources (as pieces) that share the output limit ``limit``, each
        starting with its prefix (pieces; empty or None: none)."""
        if prefixes is None:
            prefixes = [[] for _ in pieces]
        prefix_lps = [0.0] * len(pieces)
        prefixed = [i for i, prefix in enumerate(prefixes) if prefix]
        if prefixed:  # CTranslate2's scores leave the prefix out
            scored_prefixes = self._log_probs(
                [pieces[i] for i in prefixed], [prefixes[i] for i in prefixed]
            )
            for i, lps in zip(prefixed, scored_prefixes, strict=True):
                prefix_lps[i] = sum(lps[: len(prefixes[i])])  # not the EOS that follows
        found = self._searched(pieces, limit, [], prefixes, prefix_lps)
        again = [i for i, hyps in enumerate(found) if any(self._banned(h[0]) for h in hyps)]
        if again:  # decoded again without PAD and BOS, and then all scored again
            redone = self._searched(
                [pieces[i] for i in again],
                limit,
                self._never,
                [prefixes[i] for i in again],
                [prefix_lps[i] for i in again],
            )
            for i, hyps in zip(again, redone, strict=True):
                found[i] = [(tokens, log_prob, True) for tokens, log_prob, _ in hyps]
        # Scored again, teacher-forced: those cut at the limit (their EOS, which aiayn
        # forces, has no score yet) and those of a search without PAD and BOS.
        pairs = [(i, j) for i, hyps in enumerate(found) for j, h in enumerate(hyps) if h[2]]
        if pairs:
            targets = [[self._target_pieces[t] for t in found[i][j][0]] for i, j in pairs]
            scored = self._log_probs([pieces[i] for i, _ in pairs], targets)
            for (i, j), lps in zip(pairs, scored, strict=True):
                found[i][j] = (found[i][j][0], sum(lps), False)
        results = []
        for hyps in found:
            ranked = [self._scored(tokens, log_prob) for tokens, log_prob, _ in hyps]
            ranked.sort(key=lambda h: -h.score)  # stable: CTranslate2's order among equals
            results.append(ranked[: self.nbest])
        return results

    def _searched(
        self,
        pieces: list[list[str]],
        limit: int,
        suppress: list[list[str]],
        prefixes: list[list[str]],
        prefix_lps: list[float],
    ) -> list[list[tuple[list[int], float, bool]]]:
        """:meth:`_translate` to ``limit + 1`` steps, and again to ``limit`` steps for beam
        search where a hypothesis was cut at the limit: the candidates of CTranslate2's last
        step can extend fewer than ``beam_size`` beams, and cut back to the limit they are
        fewer hypotheses, while aiayn ends each of its live beams with EOS. The last step of
        the second search returns the live beams themselves."""
        found = self._translate(pieces, limit, suppress, limit + 1, prefixes, prefix_lps)
        if self.decode.beam_size == 1 or limit == 0:  # greedy: the cut hypothesis is the beam
            return found
        cut = [i for i, hyps in enumerate(found) if any(h[2] for h in hyps)]
        if cut:
            extra = self._translate(
                [pieces[i] for i in cut],
                limit,
                suppress,
                limit,
                [prefixes[i] for i in cut],
                [prefix_lps[i] for i in cut],
            )
            for i, hyps in zip(cut, extra, strict=True):
                known = {tuple(h[0]) for h in found[i]}
                found[i] += [h for h in hyps if tuple(h[0]) not in known]
        return found

    def _translate(
        self,
        pieces: list[list[str]],
        limit: int,
        suppress: list[list[str]],
        steps: int,
        prefixes: list[list[str]],
        prefix_lps: list[float],
    ) -> list[list[tuple[list[int], float, bool]]]:
        """The finished hypotheses of each source as (token ids without EOS, log-probability,
        whether it was cut at the limit), without repeats; the tokens ``suppress`` are never
        output. Each starts with its prefix, whose log-probability (``prefix_lps``)
        CTranslate2's score leaves out and which is added here.

        CTranslate2 decodes at most ``steps`` tokens (``limit + 1``: one step beyond ``limit``
        output tokens, where aiayn allows only EOS; the prefix counts among them); at its last
        step it ends every one of the best ``beam_size`` candidates, EOS or not. One that is
        not EOS is cut back to its ``limit`` tokens, a hypothesis aiayn ends with the forced
        EOS (its log-probability, without that EOS, is then unknown). Sentences where
        CTranslate2's ranking under the first of :func:`ranking_penalties` may have dropped
        one of GNMT's best ``nbest`` are decoded again under the second, and the hypotheses
        of both join."""
        low, high = ranking_penalties(self.decode.alpha, steps)
        results = self._ct2_batch(pieces, suppress, steps, low, prefixes)
        found = [
            self._finished(result, low, limit, prefix_lp)
            for result, prefix_lp in zip(results, prefix_lps, strict=True)
        ]
        again = [
            i
            for i, result in enumerate(results)
            if self._may_have_dropped(result, low, limit, bool(prefixes[i]))
        ]
        if again and high != low:
            redone = self._ct2_batch(
                [pieces[i] for i in again], suppress, steps, high, [prefixes[i] for i in again]
            )
            for i, result in zip(again, redone, strict=True):
                known = {tuple(h[0]) for h in found[i]}
                found[i] += [
                    h
                    for h in self._finished(result, high, limit, prefix_lps[i])
                    if tuple(h[0]) not in known
                ]
        return found

    def _ct2_batch(
        self,
        pieces: list[list[str]],
        suppress: list[list[str]],
        steps: int,
        penalty: float,
        prefixes: list[list[str]],
    ) -> Any:
        k = self.decode.beam_size
        return self.engine.translate_batch(
            pieces,
            target_prefix=[prefix or None for prefix in prefixes] if any(prefixes) else None,
            beam_size=k,
            num_hypotheses=k,
            length_penalty=penalty,
            max_decoding_length=steps,
            min_decoding_length=0,
            max_input_length=0,
            return_scores=True,
            return_end_token=True,
            suppress_sequences=suppress or None,
        )

    def _finished(
        self, result: Any, penalty: float, limit: int, prefix_lp: float = 0.0
    ) -> list[tuple[list[int], float, bool]]:
        """A CTranslate2 result's hypotheses as (ids without EOS, log-probability, cut).
        CTranslate2 divides the log-probability of the tokens after the prefix by the
        penalty of the whole length (prefix and EOS included)."""
        hyps: dict[tuple[int, ...], tuple[list[int], float, bool]] = {}
        for tokens, score in zip(result.hypotheses, result.scores, strict=True):
            ids = [self._target_ids[t] for t in tokens]
            log_prob = float(score) * len(ids) ** penalty + prefix_lp  # before the penalty
            ended = bool(ids) and ids[-1] == EOS_ID
            hyp = (ids[:-1], log_prob, False) if ended else (ids[:limit], math.nan, True)
            hyps.setdefault(tuple(hyp[0]), hyp)
        return list(hyps.values())

    def _may_have_dropped(
        self, result: Any, penalty: float, limit: int, prefixed: bool = False
    ) -> bool:
        """Whether a hypothesis CTranslate2 dropped, ranking with ``length ** penalty`` (the
        first of :func:`ranking_penalties`), could be among GNMT's best ``nbest``.
        CTranslate2 returns ``beam_size`` when at least that many finished; one it dropped
        scored at most the lowest returned score ``s`` (< 0), and is no longer than the
        longest returned, ``m`` tokens: those finished by step ``m`` already, so the search
        stopped there. Its GNMT score is then at most ``s · n ** penalty / ((5 + n') / 6) **
        alpha`` for its length ``n`` in CTranslate2 and ``n'`` in aiayn (one more for a
        hypothesis cut at the limit), so at most ``s · m ** penalty / ((6 + min(m, limit)) /
        6) ** alpha``. Compared with the ``nbest``-th GNMT score of the hypotheses returned
        that ended with EOS (those cut at the limit are scored with their EOS only later).
        With ``nbest == beam_size`` that is always so, and for a sentence with a prefix
        (``prefixed``: CTranslate2 ranks without the prefix's log-probability, which that
        bound does not hold)."""
        k, alpha = self.decode.beam_size, self.decode.alpha
        if k == 1 or alpha == 0 or len(result.hypotheses) < k:
            return False
        if alpha < 0 or self.nbest == k or prefixed:
            return True
        eos = self._target_pieces[EOS_ID]
        ended = sorted(
            (
                score * len(tokens) ** penalty / gnmt_length_penalty(len(tokens), alpha)
                for tokens, score in zip(result.hypotheses, result.scores, strict=True)
                if tokens and tokens[-1] == eos
            ),
            reverse=True,
        )
        if len(ended) < self.nbest:
            return True
        longest = max(len(tokens) for tokens in result.hypotheses)
        bound = (
            min(result.scores)
            * longest**penalty
            / gnmt_length_penalty(min(longest, limit) + 1, alpha)
        )
        return bound >= ended[self.nbest - 1] - 1e-5 * abs(ended[self.nbest - 1])

    @staticmethod
    def _banned(tokens: list[int]) -> bool:
        return PAD_ID in tokens or BOS_ID in tokens

    def _log_probs(self, pieces: list[list[str]], targets: list[list[str]]) -> list[list[float]]:
        """The log-probabilities of each target's tokens and its EOS given its source,
        teacher-forced (``score_batch``): the full distribution's, as aiayn's."""
        scored = self.engine.score_batch(pieces, targets, max_input_length=0)
        return [[float(lp) for lp in result.log_probs] for result in scored]

    def _score_batch(
        self, sources: list[Sequence[int]], targets: list[Sequence[int]]
    ) -> list[list[float]]:
        """Teacher-forced, by CTranslate2's ``score_batch`` (:meth:`_log_probs`)."""
        return self._log_probs(
            [[self._source_pieces[t] for t in source] for source in sources],
            [[self._target_pieces[t] for t in target] for target in targets],
        )

    def _scored(self, tokens: list[int], log_prob: float) -> Hypothesis:
        score = log_prob / gnmt_length_penalty(len(tokens) + 1.0, self.decode.alpha)
        return Hypothesis(tokens, score, log_prob)
