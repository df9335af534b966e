"""What several test modules share: in-memory training data (a corpus of id pairs and a
resumable sampler), the word-reversal task as text and as prepared data, tiny configs and
trainers, and a few cached decoder steps of a model. Fixtures built on them: conftest.py."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import RunConfig, load_config
from aiayn.data.collate import PAD_ID, Batch, collate_pairs
from aiayn.model.transformer import Transformer
from aiayn.training.trainer import Trainer


def _bible_missing() -> str:
    """Why the Bible corpus cannot be built here ("" when it can)."""
    from aiayn.data.sources.bible import DEBIAN_SWORD_DIR, sword_paths

    if sword_paths(None) and (DEBIAN_SWORD_DIR / "mods.d").is_dir():
        return ""
    return (
        "the Bible's SWORD modules are not installed (make test installs them: "
        "apt-get install sword-text-web sword-text-sparv)"
    )


BIBLE_MISSING = _bible_missing()


class ListCorpus:
    """Pairs of id lists (without BOS/EOS), batched with the project's collate."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        self.pairs = pairs
        self.src_lengths = np.array([len(s) for s, _ in pairs], dtype=np.int64)
        self.tgt_lengths = np.array([len(t) for _, t in pairs], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, indices: Sequence[int]) -> Batch:
        return collate_pairs(
            [self.pairs[i][0] for i in indices], [self.pairs[i][1] for i in indices]
        )


class FixedSampler:
    """Yields fixed index batches (a rank takes every world_size-th), shuffled per epoch."""

    def __init__(
        self,
        batches: list[list[int]],
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.batches = batches
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.epoch = 0
        self.position = 0

    def _order(self) -> list[list[int]]:
        order = list(range(len(self.batches)))
        if self.shuffle:
            random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        # Whole groups of world_size batches so that every rank gets the same count.
        usable = len(order) - len(order) % self.world_size
        return [self.batches[i] for i in order[:usable][self.rank :: self.world_size]]

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0

    def __len__(self) -> int:
        return len(self._order())

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        while self.position < len(order):
            self.position += 1
            yield order[self.position - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def reverse_pairs(n: int, length: int, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Random sequences of exactly ``length`` ids in [4, vocab) and their reversal."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        src = [rng.randrange(4, vocab) for _ in range(length)]
        pairs.append((src, src[::-1]))
    return pairs


def tiny_config(*overrides: str) -> RunConfig:
    base = [
        "preset=tiny",
        "train.warmup_steps=10",
        "train.log_interval=1000",
        "train.valid_interval=0",
        "train.save_interval_steps=0",
        "train.save_interval_minutes=0",
        "train.average_last=0",
        "train.keep_last=3",
        "train.update_tokens=56",
    ]
    return load_config(overrides=[*base, *overrides])


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india".split()


def write_reverse_text(folder: Path, prefix: str, n: int, seed: int) -> None:
    """``folder/prefix.src`` and ``.tgt``: random word sequences and their reversal."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        src.append(" ".join(words))
        tgt.append(" ".join(reversed(words)))
    (folder / f"{prefix}.src").write_text("\n".join(src) + "\n", encoding="utf-8")
    (folder / f"{prefix}.tgt").write_text("\n".join(tgt) + "\n", encoding="utf-8")


def write_upper_reversed(
    prefix: Path, n: int, seed: int, words: Sequence[str], max_words: int
) -> Path:
    """``prefix.xx``: ``n`` random sequences of 1 to ``max_words`` of ``words``; ``prefix.yy``:
    each reversed and upper-cased. Returns ``prefix``."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        chosen = rng.choices(words, k=rng.randint(1, max_words))
        src.append(" ".join(chosen))
        tgt.append(" ".join(w.upper() for w in reversed(chosen)))
    Path(f"{prefix}.xx").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    Path(f"{prefix}.yy").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")
    return prefix


def make_reverse_data(folder: Path, n_train: int = 4000, n_valid: int = 100) -> Path:
    """A prepared DATA_DIR for the reversal task (one word = one token); returns it."""
    from aiayn.data.prepare import prepare_data

    folder.mkdir(parents=True, exist_ok=True)
    write_reverse_text(folder, "train", n_train, seed=1)
    write_reverse_text(folder, "valid", n_valid, seed=2)
    data = folder / "data"
    prepare_data(
        folder / "train",
        folder / "valid",
        None,
        "src",
        "tgt",
        len(WORDS) + 4,
        data,
        model_type="word",
    )
    return data


ROOT = Path(__file__).resolve().parents[1]  # the repository
TINY = str(ROOT / "configs" / "tiny.toml")


def cli_env() -> dict[str, str]:
    """The environment of an ``aiayn`` subprocess: this checkout's sources first on the path,
    from whatever directory it runs in."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def small_reverse_trainer(config: RunConfig, run_dir: Path) -> Any:
    """A Trainer over 32 reversal pairs of 4 tokens (ids < 64) in 8 fixed batches of 4, quiet."""
    pairs = reverse_pairs(32, 4, 64, seed=0)
    batches = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    return Trainer(
        config,
        Transformer(config.model),
        ListCorpus(pairs),
        FixedSampler(batches),
        run_dir,
        show_progress=False,
        tensorboard=False,
    )


def step_log_probs(model: Transformer, rows: int, vocab: int = 50) -> Tensor:
    """Three steps' log-probabilities (3, rows, V) over ``rows`` random sources (the first
    padded), each copied at once (an accelerated model writes every step into one buffer)."""
    torch.manual_seed(2)
    src = torch.randint(4, vocab, (rows, 9))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    src_pad[0, 6:] = True
    with torch.inference_mode():
        cache = model.init_cache(model.encode(src, src_pad), src_pad, max_len=4)
        tokens = torch.randint(4, vocab, (rows,))
        return torch.stack([model.log_probs_step(tokens, cache).clone() for _ in range(3)])


class LetterTokenizer:
    """Text ↔ ids for a model of 50 tokens, for tests that only need a translator to run:
    each character an id in 4..43, each id a letter."""

    vocab_size = 50

    def encode(self, text: str) -> list[int]:
        return [4 + (ord(c) % 40) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def packing_model(vocab: int = 50) -> Transformer:
    """The small fp32 model of the packed-weight tests (tests/accel/test_linear*.py)."""
    from aiayn.config import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, d_model=32, d_ff=64, n_heads=4, n_layers=2, dropout=0.0)
    return Transformer(config).eval()


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def packed_flags(model: nn.Module) -> list[bool]:
    """For each linear layer: whether a pack of its current weight serves its products."""
    from aiayn.accel import CpuLinear

    return [isinstance(m, CpuLinear) and m.pack_serves() for m in linear_layers(model)]


def search_tokens(model: Transformer, beam: bool) -> list:
    """The tokens beam search (beam 4; every hypothesis) or greedy search finds for six random
    sources."""
    from aiayn.inference.search import beam_search, greedy_search

    torch.manual_seed(3)
    src = torch.randint(4, 50, (6, 7))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    with torch.inference_mode():
        memory = model.encode(src, src_pad)
        if beam:
            cache = model.init_cache(memory, src_pad, max_len=12, beam_size=4)
            hyps = beam_search(model.log_probs_step, cache, 6, beam_size=4, max_len=11, alpha=0.6)
            return [[h.tokens for h in sentence] for sentence in hyps]
        cache = model.init_cache(memory, src_pad, max_len=12)
        return [h.tokens for h in greedy_search(model.log_probs_step, cache, 6, max_len=11)]


def file_spans(path: Path) -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of ``path`` (/proc/self/maps)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            spans.append((start, end))
    return spans


def write_to_disk(path: Path, tensors: dict[str, Tensor]) -> None:
    """``torch.save`` and fsync: the file's pages clean, as a checkpoint's are (a dirty page
    cannot be handed back without being written first)."""
    with path.open("wb") as file:
        torch.save(tensors, file)
        file.flush()
        os.fsync(file.fileno())


def loader_settings(monkeypatch: Any, owner: type, argv: list[str]) -> dict[str, object]:
    """The keyword arguments ``aiayn argv`` passes to ``owner.from_checkpoint`` (which is
    stopped there: nothing is loaded)."""
    from aiayn.cli import main

    seen: dict[str, object] = {}

    def spy(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(owner, "from_checkpoint", spy)
    try:
        main(argv)
    except SystemExit:
        pass
    assert seen, f"aiayn {' '.join(argv)} did not reach {owner.__name__}.from_checkpoint"
    return seen


def train_to_reverse(
    model: Transformer, source: Callable[[], list[int]], steps: int, batch: int, lr: float
) -> None:
    """Train ``model`` for ``steps`` Adam updates of ``batch`` pairs, each a ``source()``
    and its reversal (the tiny models the engine and export tests decode)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    model.train()
    for _ in range(steps):
        src = [source() for _ in range(batch)]
        pairs = collate_pairs(src, [s[::-1] for s in src])
        logits = model(pairs.src_ids, pairs.src_pad, pairs.tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), pairs.tgt_out.flatten(), ignore_index=PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
