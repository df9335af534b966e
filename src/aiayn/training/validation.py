"""Validation: loss, NLL, perplexity and greedy-decoding BLEU on the valid split, over ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from aiayn.config import RunConfig
from aiayn.data.collate import PAD_ID, Batch
from aiayn.evaluation.bleu import sacrebleu_bleu
from aiayn.inference.translator import search_batch
from aiayn.model.families import TranslationModel
from aiayn.training.distributed import (
    DistInfo,
    all_gather_objects,
    all_reduce_sum,
    broadcast_object,
    reduce_device,
)
from aiayn.training.loss import label_smoothed_nll
from aiayn.training.metrics import perplexity

# A batch's pair indices: a list, or the array a batch sampler yields.
Indices = Sequence[int] | np.ndarray


class PairSource(Protocol):
    """What training and validation need of a corpus: its size and padded batches by index."""

    def __len__(self) -> int: ...

    def batch(self, indices: Indices) -> Batch: ...


@dataclass
class ValidSet:
    """The validation split: pairs by index, their source lengths, and what BLEU needs.

    ``references[i]`` is the detokenized reference of pair ``i`` and ``detokenize`` turns
    output ids into text; without references only loss and perplexity are computed.
    """

    corpus: PairSource
    src_lengths: np.ndarray
    references: list[str] | None = None
    detokenize: Callable[[list[int]], str] | None = None


def valid_batches(
    src_lengths: np.ndarray, indices: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """Index batches sorted by source length with at most ``max_tokens`` padded source tokens."""
    order = sorted(indices, key=lambda i: (int(src_lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for index in order:
        length = int(src_lengths[index]) + 1  # + EOS
        if current and max(width, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(index)
        width = max(width, length)
    if current:
        batches.append(current)
    return batches


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autocast context of ``train.precision`` on ``device`` (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    model: TranslationModel, valid: ValidSet, config: RunConfig, info: DistInfo
) -> dict[str, float]:
    """``loss``, ``nll`` and ``ppl`` per target token of the valid split, and ``bleu`` of its
    greedy translations (as ``aiayn translate --beam 1`` decodes) when it has references and
    ``train.valid_bleu`` is on.

    Each rank takes every W-th sentence; sums are all-reduced, hypotheses gathered to rank 0
    for BLEU, and the result broadcast so that every rank decides alike.
    """
    was_training = model.training
    model.eval()
    mine = list(range(info.rank, len(valid.corpus), info.world_size))
    want_bleu = (
        config.train.valid_bleu and valid.references is not None and valid.detokenize is not None
    )
    greedy = replace(config.decode, beam_size=1)
    with_precision = autocast(config.train.precision, info.device)
    sums = torch.zeros(3, dtype=torch.float64)
    hypotheses: dict[int, list[int]] = {}
    for chunk in valid_batches(valid.src_lengths, mine, config.data.max_tokens):
        batch = valid.corpus.batch(chunk).to(info.device)
        with with_precision:
            logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss_sum, nll_sum = label_smoothed_nll(
            logits, batch.tgt_out, config.train.label_smoothing, PAD_ID
        )
        sums += torch.tensor(
            [float(loss_sum), float(nll_sum), float(batch.n_tgt_tokens)], dtype=torch.float64
        )
        if want_bleu:
            with with_precision:
                found = search_batch(model, batch.src_ids, batch.src_pad, greedy)
            hypotheses.update(zip(chunk, (hyps[0].tokens for hyps in found), strict=True))
    sums = all_reduce_sum(sums.to(reduce_device(info)), info).cpu()
    loss, nll, tokens = (float(x) for x in sums)
    tokens = max(tokens, 1.0)
    metrics = {"loss": loss / tokens, "nll": nll / tokens, "ppl": perplexity(nll / tokens)}
    if want_bleu:
        metrics["bleu"] = float(broadcast_object(_bleu(valid, hypotheses, info), info))
    if was_training:
        model.train()
    return metrics


def _bleu(valid: ValidSet, hypotheses: dict[int, list[int]], info: DistInfo) -> float | None:
    """sacreBLEU of every rank's hypotheses, on rank 0 (None elsewhere)."""
    gathered = all_gather_objects(hypotheses, info)
    if not info.is_main:
        return None
    assert valid.detokenize is not None and valid.references is not None
    merged: dict[int, list[int]] = {}
    for part in gathered:
        merged.update(part)
    texts = [valid.detokenize(merged[i]) for i in range(len(valid.corpus))]
    return sacrebleu_bleu(texts, [valid.references]).score
