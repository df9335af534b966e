"""The trainer on the other tasks: the language model, the masked language model and the
classifier learn, validate, and resume bit-identically."""

import random

import numpy as np
import pytest
import torch

from aiayn.data.collate import BOS_ID, EOS_ID, MASK_ID, PAD_ID, LabelBatch, TokenBatch
from aiayn.data.collate import pad_sequences as pad
from aiayn.inference import loading
from aiayn.model.families import build_model
from aiayn.training.tasks import TextValidSet
from aiayn.training.trainer import Trainer
from tests.helpers import FixedSampler, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")


class Sequences:
    """Token-level examples over fixed id sequences: ``lm`` (counting up mod 40, so the next
    token is predictable) or ``mlm`` (masked with torch's global RNG, as TextExamples does
    without a generator)."""

    def __init__(self, task: str, n: int = 48, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.task = task
        self.docs = []
        for _ in range(n):
            start, length = rng.randrange(5, 45), rng.randint(4, 9)
            self.docs.append([BOS_ID, *[5 + (start + i) % 40 for i in range(length)], EOS_ID])
        self.lengths = np.array([len(d) - 1 for d in self.docs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.docs)

    def batch(self, indices, generator=None):
        docs = [self.docs[i] for i in indices]
        if self.task == "lm":
            targets = pad([d[1:] for d in docs])
            return TokenBatch(pad([d[:-1] for d in docs]), targets)
        ids = pad(docs)
        chosen = (torch.rand(ids.shape, generator=generator) < 0.3) & (ids >= 5)
        inputs = ids.masked_fill(chosen, MASK_ID)
        return TokenBatch(inputs, ids.masked_fill(~chosen, PAD_ID))


class Labelled:
    """Classify a sequence by whether its ids are mostly low (< 25) or high."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.texts, self.labels = [], []
        for _ in range(n):
            label = rng.randrange(2)
            low, high = (5, 25) if label == 0 else (25, 45)
            self.texts.append([rng.randrange(low, high) for _ in range(rng.randint(3, 8))])
            self.labels.append(label)
        self.lengths = np.array([len(t) + 2 for t in self.texts], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.texts)

    def batch(self, indices, generator=None):
        inputs = pad([[BOS_ID, *self.texts[i], EOS_ID] for i in indices])
        return LabelBatch(inputs, torch.tensor([self.labels[i] for i in indices]))


def _config(task: str, *extra: str):
    over = ["model.vocab_size=50", "train.lr_scale=0.5", "train.update_tokens=60"]
    if task == "classify":
        over = [*over, "model.n_classes=2", "train.update_tokens=8"]
    return tiny_config(f"model.task={task}", "train.label_smoothing=0", *over, *extra)


def _trainer(task: str, run_dir, config, seed: int = 0) -> Trainer:
    source = Labelled(seed=seed) if task == "classify" else Sequences(task, seed=seed)
    valid = Labelled(16, seed=9) if task == "classify" else Sequences(task, 16, seed=9)
    batches = [list(range(i, i + 4)) for i in range(0, len(source), 4)]
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(3)
    return Trainer(
        config,
        build_model(config.model),
        source,
        FixedSampler(batches),
        run_dir,
        valid=TextValidSet(valid, n_classes=2 if task == "classify" else 0),
        labels=["low", "high"] if task == "classify" else None,
        show_progress=False,
        tensorboard=False,
    )


@pytest.mark.parametrize("task", ["lm", "mlm", "classify"])
def test_each_task_learns_and_validates(tmp_path, task):
    config = _config(task, "train.max_steps=80")
    trainer = _trainer(task, tmp_path, config)
    before = trainer.validate()
    trainer.train()
    after = trainer.validate()
    trainer.close()
    assert after["loss"] < before["loss"] * (0.6 if task != "mlm" else 0.9), (before, after)
    assert after["ppl"] == pytest.approx(np.exp(after["nll"]))
    if task == "classify":
        assert after["accuracy"] > 0.9 and after["macro_f1"] > 0.9
        saved = loading.load_checkpoint(loading.step_checkpoint_path(tmp_path, 80))
        assert saved["labels"] == ["low", "high"]


@pytest.mark.parametrize("task", ["lm", "mlm", "classify"])
def test_resume_is_bit_identical(tmp_path, task):
    n = 7
    over = ["model.dropout=0.1"]
    straight = _trainer(task, tmp_path / "a", _config(task, f"train.max_steps={2 * n}", *over))
    straight.train()
    first = _trainer(task, tmp_path / "b", _config(task, f"train.max_steps={n}", *over))
    first.train()
    _, state = loading.latest_valid_checkpoint(tmp_path / "b")
    torch.manual_seed(999)  # a fresh process: other weights and RNG until the state loads
    second = _trainer(task, tmp_path / "b", _config(task, f"train.max_steps={2 * n}", *over))
    second.load_state_dict(state)
    second.train()
    for (name, a), (_, b) in zip(
        straight.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    for trainer in (straight, first, second):
        trainer.close()


def test_mlm_validation_masks_the_same_tokens_every_time(tmp_path):
    trainer = _trainer("mlm", tmp_path, _config("mlm", "train.max_steps=1"))
    assert trainer.validate() == trainer.validate()
    trainer.close()


def test_classifier_labels_of_index_zero_are_learned(tmp_path):
    # Class 0 equals PAD_ID: the classifier's loss must not ignore it.
    config = _config("classify", "train.max_steps=1")
    trainer = _trainer("classify", tmp_path, config)
    batch = Labelled().batch(range(8))
    assert (batch.labels == 0).any()
    loss, _ = trainer._loss(batch)
    per_text = loss / batch.labels.numel()
    assert per_text > 0.1
    trainer.close()
