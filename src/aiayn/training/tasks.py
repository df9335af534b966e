"""What differs between the tasks in training: the loss of a micro-batch and the validation
metrics. Translation's are in :mod:`aiayn.training.validation`; the language model's, the
masked language model's and the classifier's are here.

- ``lm`` and ``mlm``: a :class:`~aiayn.data.collate.TokenBatch`; the label-smoothed loss over
  the target positions that are not PAD (``train.label_smoothing``, 0 in their presets);
  validation reports loss, NLL and perplexity per predicted token. MLM validation draws its
  masks from a generator seeded per batch, so every validation masks the same tokens.
- ``classify``: a :class:`~aiayn.data.collate.LabelBatch`; the (label-smoothed) cross-entropy
  of the class logits, one prediction per text; validation adds accuracy and macro-F1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from aiayn.accel.loss import projected_label_smoothed_nll
from aiayn.config import RunConfig
from aiayn.data.collate import PAD_ID, Batch, LabelBatch, TokenBatch
from aiayn.data.corpus import load_manifest, tokenizer_path
from aiayn.data.text import TextCorpus, TextExamples
from aiayn.errors import UserError
from aiayn.evaluation.classification import classification_scores
from aiayn.training.distributed import DistInfo, all_reduce_sum, reduce_device
from aiayn.training.loss import label_smoothed_nll
from aiayn.training.metrics import perplexity
from aiayn.training.validation import autocast, valid_batches

# A class index may be 0: nothing is ignored in a classifier's targets.
_NO_PAD = -100
# The seed of the validation masks of a rank's batch i: MLM_VALID_SEED + i · world + rank.
MLM_VALID_SEED = 1234


def batch_loss(
    module: nn.Module,
    batch: Batch | TokenBatch | LabelBatch,
    epsilon: float,
    fused_weight: Tensor | None,
    loss_dtype: torch.dtype | None,
    precision_context: Any,
) -> tuple[Tensor, Tensor]:
    """Summed loss and NLL of one micro-batch through ``module`` (the model, or its DDP or
    compiled wrapper). With ``fused_weight`` (the pre-softmax projection's weight), token-level
    tasks fuse the projection into the loss (:mod:`aiayn.accel.loss`)."""
    fused = fused_weight is not None
    if isinstance(batch, Batch):
        with precision_context:
            out = module(batch.src_ids, batch.src_pad, batch.tgt_in, project=not fused)
        targets = batch.tgt_out
    elif isinstance(batch, TokenBatch):
        with precision_context:
            out = module(batch.inputs, batch.pad, project=not fused)
        targets = batch.targets
    else:
        with precision_context:
            logits = module(batch.inputs, batch.pad)
        return label_smoothed_nll(logits, batch.labels, epsilon, _NO_PAD)
    if fused_weight is not None:
        return projected_label_smoothed_nll(out, fused_weight, targets, epsilon, PAD_ID, loss_dtype)
    return label_smoothed_nll(out, targets, epsilon, PAD_ID)


class Examples(Protocol):
    """A split of a text task: examples by index, and each one's input length."""

    lengths: np.ndarray

    def __len__(self) -> int: ...

    def batch(
        self, indices: Sequence[int] | np.ndarray, generator: torch.Generator | None = None
    ) -> TokenBatch | LabelBatch: ...


@dataclass
class TextValidSet:
    """The validation split of an lm, mlm or classify run."""

    examples: Examples
    n_classes: int = 0


@torch.no_grad()
def evaluate_text(
    model: nn.Module, valid: TextValidSet, config: RunConfig, info: DistInfo
) -> dict[str, float]:
    """Validation metrics of an lm, mlm or classify model, summed over ranks: ``loss``,
    ``nll`` and ``ppl`` per prediction; for classify also ``accuracy`` and ``macro_f1``."""
    was_training = model.training
    model.eval()
    examples = valid.examples
    mine = list(range(info.rank, len(examples), info.world_size))
    classify = config.model.task == "classify"
    sums = torch.zeros(3, dtype=torch.float64)
    confusion = torch.zeros(max(valid.n_classes, 1) ** 2, dtype=torch.float64)
    eps = config.train.label_smoothing
    for number, chunk in enumerate(valid_batches(examples.lengths, mine, config.data.max_tokens)):
        seed = MLM_VALID_SEED + number * info.world_size + info.rank
        generator = torch.Generator().manual_seed(seed)
        batch = examples.batch(chunk, generator).to(info.device)
        with autocast(config.train.precision, info.device):
            logits = model(batch.inputs, batch.pad)
        if isinstance(batch, LabelBatch):
            loss_sum, nll_sum = label_smoothed_nll(logits, batch.labels, eps, _NO_PAD)
            predicted = logits.argmax(-1)
            cells = batch.labels * valid.n_classes + predicted
            confusion += torch.bincount(cells.cpu(), minlength=confusion.numel()).double()
        else:
            loss_sum, nll_sum = label_smoothed_nll(logits, batch.targets, eps, PAD_ID)
        sums += torch.tensor(
            [float(loss_sum), float(nll_sum), float(batch.n_tgt_tokens)], dtype=torch.float64
        )
    sums = all_reduce_sum(sums.to(reduce_device(info)), info).cpu()
    loss, nll, count = (float(x) for x in sums)
    count = max(count, 1.0)
    metrics = {"loss": loss / count, "nll": nll / count, "ppl": perplexity(nll / count)}
    if classify:
        confusion = all_reduce_sum(confusion.to(reduce_device(info)), info).cpu()
        matrix = confusion.view(valid.n_classes, valid.n_classes).long().numpy()
        scores = classification_scores(matrix)
        metrics["accuracy"] = scores.accuracy
        metrics["macro_f1"] = scores.macro_f1
    if was_training:
        model.train()
    return metrics


def text_examples(data_dir: Path, split: str, config: RunConfig) -> TextExamples:
    """The examples of an lm, mlm or classify run on one split of a text data directory."""
    return TextExamples(
        TextCorpus.open(data_dir, split),
        config.model.task,
        block_size=config.data.block_size,
        pack=config.data.pack,
        max_positions=config.model.max_positions,
        mask_prob=config.data.mask_prob,
    )


def score_split(
    checkpoint: str | Path,
    data_dir: str | Path,
    split: str = "test",
    device: str | torch.device = "cpu",
    tasks: Sequence[str] = ("lm", "mlm", "classify"),
) -> dict[str, float]:
    """The metrics a run validates with (:func:`evaluate_text`: loss, NLL and perplexity per
    predicted token; a classifier's accuracy and macro-F1) of the lm, mlm or classify model of
    ``checkpoint`` (a file or a run directory) on ``split`` of a directory that ``aiayn prepare
    --task`` made with the model's tokenizer, its examples cut as the run cut them. A model
    of a task outside ``tasks`` is refused."""
    from aiayn.devices import pick_device
    from aiayn.inference.loading import load_model

    device = pick_device(str(device))  # "auto" too, as train_run takes it
    loaded = load_model(checkpoint, device, tasks=tasks)
    data_dir = Path(data_dir)
    spm = tokenizer_path(data_dir)
    if spm.is_file() and spm.read_bytes() != loaded.tokenizer_bytes:
        raise UserError(
            f"{data_dir} was prepared with another tokenizer than {loaded.path}'s: prepare it "
            f"with --tokenizer {loaded.path}"
        )
    config = loaded.config
    classify = config.model.task == "classify"
    if classify and list(load_manifest(data_dir).get("labels") or []) != loaded.labels:
        raise UserError(
            f"the classes of {data_dir} are not those of {loaded.path} "
            f"({', '.join(loaded.labels)}, in this order): prepare it from text of those "
            "classes (aiayn prepare sorts them)"
        )
    n_classes = len(loaded.labels) if classify else 0
    valid = TextValidSet(text_examples(data_dir, split, config), n_classes)
    return evaluate_text(loaded.model, valid, config, DistInfo(device=device))
