"""Scores of given translations: the model's log-probability of a target given its source,
teacher-forced (one pass of the decoder over BOS + target), token by token.

The log-probability of each target token and of the EOS that ends it is the one search
decodes with (:func:`aiayn.inference.search.never_pad_or_bos`): the log-softmax of the
model's logits in float32, renormalised without BOS for a model with ``model.bos_output =
false``. A target's log-probability is their float32 sum, in order, as search sums it; so
scoring the tokens greedy search emitted gives the ``log_prob`` it reported, to float32
rounding (the two passes compute the same products in another order). docs/translation.md,
"Scores", gives the formats and the agreement.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from aiayn.data.collate import BOS_ID, PAD_ID, collate_pairs
from aiayn.devices import inference_attention


@dataclass(frozen=True)
class Score:
    """The score of one target given its source: ``tokens`` are the target's token ids
    (without EOS), ``token_log_probs`` the natural-log probability of each of them and then
    of the EOS that ends the target (one more than ``tokens``), ``log_prob`` their sum."""

    tokens: list[int]
    token_log_probs: list[float]
    log_prob: float

    @property
    def mean(self) -> float:
        """The log-probability per token, EOS included."""
        return self.log_prob / len(self.token_log_probs)


def f32_sum(values: Sequence[float]) -> float:
    """The float32 sum of ``values`` in order, as search accumulates a hypothesis's
    log-probability (each partial sum rounded to float32)."""
    total = 0.0
    for value in values:
        total = struct.unpack("f", struct.pack("f", total + value))[0]
    return total


def score_of(tokens: Sequence[int], token_log_probs: Sequence[float]) -> Score:
    """A :class:`Score` from a target's tokens and its tokens' (and EOS's) log-probabilities."""
    if len(token_log_probs) != len(tokens) + 1:
        raise ValueError(
            f"{len(tokens)} target tokens need {len(tokens) + 1} log-probabilities (EOS last), "
            f"got {len(token_log_probs)}"
        )
    return Score(list(tokens), list(token_log_probs), f32_sum(token_log_probs))


def encode_targets(tokenizer: object, texts: Sequence[str]) -> list[list[int]]:
    """Target-side token ids of ``texts``: the tokenizer's ``encode_target_batch`` where it
    has one (a Marian model's target vocabulary is not its source's), else ``encode``."""
    batch = getattr(tokenizer, "encode_target_batch", None)
    if batch is not None:
        return [list(ids) for ids in batch(list(texts))]
    encode = getattr(tokenizer, "encode")  # noqa: B009 (any tokenizer of the translator)
    return [list(encode(text)) for text in texts]


def batches_by_tokens(
    sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], budget: int
) -> list[list[int]]:
    """The indices of the pairs in batches of at most ``budget`` padded tokens (the longer
    side of the longest pair, EOS or BOS included, times the pairs; at least one pair a
    batch), longest first: length-sorted, as translate's batches are, so that they pad
    little."""
    width = [max(len(s), len(t)) + 1 for s, t in zip(sources, targets, strict=True)]
    order = sorted(range(len(width)), key=lambda i: -width[i])
    batches = []
    start = 0
    while start < len(order):
        count = max(1, budget // width[order[start]])
        batches.append(order[start : start + count])
        start += count
    return batches


class TeacherForcedModel(Protocol):
    """What scoring needs of a translation model (every ``model.arch`` has it): the
    teacher-forced decoder output before the pre-softmax projection, and the projection."""

    def __call__(
        self, src_ids: Tensor, src_pad: Tensor | None, tgt_in: Tensor, project: bool = True
    ) -> Tensor: ...

    def project(self, hidden: Tensor) -> Tensor: ...


def token_log_probs(
    model: TeacherForcedModel,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    device: torch.device,
    bos_output: bool = True,
) -> list[list[float]]:
    """For one batch of pairs (sources without EOS, non-empty; targets without BOS or EOS):
    the log-probability of each target token and of its EOS, teacher-forced. ``bos_output``
    is ``model.config.bos_output`` (False: the distribution renormalised without BOS, as
    search decodes). Only the target's positions are projected to the vocabulary, not the
    batch's padding (the projection is the largest product of a small model)."""
    batch = collate_pairs(sources, targets)
    with torch.inference_mode(), inference_attention(device):
        hidden = model(
            batch.src_ids.to(device),
            batch.src_pad.to(device),
            batch.tgt_in.to(device),
            project=False,
        )  # (B, T, d_model)
        tgt_out = batch.tgt_out.to(device)
        kept = tgt_out != PAD_ID
        log_probs = torch.log_softmax(model.project(hidden[kept]), dim=-1, dtype=torch.float32)
        del hidden
        wanted = tgt_out[kept]
        picked = log_probs.gather(-1, wanted[:, None]).squeeze(-1)  # (positions,)
        if not bos_output:  # log p_v - log(1 - p_BOS), as never_pad_or_bos does
            picked -= torch.log1p(-log_probs[:, BOS_ID].exp())
        values: list[float] = picked.cpu().tolist()
    out = []
    start = 0
    for target in targets:  # the kept positions, row by row: each target and its EOS
        out.append(values[start : start + len(target) + 1])
        start += len(target) + 1
    return out
