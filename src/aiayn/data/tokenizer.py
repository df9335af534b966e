"""One joint sentencepiece vocabulary for source and target (§3.4: shared embeddings need it).

The special ids are fixed (``PAD_ID=0 UNK_ID=1 BOS_ID=2 EOS_ID=3``, see
:mod:`aiayn.data.collate`), so corpus files, checkpoints and the model agree without a lookup.
The tokenizers of the text tasks carry one more symbol, ``<mask>`` at ``MASK_ID=4`` (the
``user_defined_symbols`` of :func:`train_tokenizer`); translation tokenizers do not.
A :class:`Tokenizer` round-trips through bytes, so a checkpoint can embed it.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from aiayn.data.collate import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID
from aiayn.errors import UserError

# sentencepiece's own default: characters covering 99.95% of the text get a piece; the rare rest
# becomes UNK. 1.0 would put every stray symbol of a web-crawled corpus into the vocabulary.
DEFAULT_CHARACTER_COVERAGE = 0.9995
# At most this many sentences (sampled uniformly) train the vocabulary; enough for a stable BPE
# merge table while keeping memory flat on WMT-sized text.
DEFAULT_INPUT_SENTENCE_SIZE = 2_000_000
# sentencepiece's trainer refuses a sample of 1 to 100 sentences (0 takes every one).
MIN_INPUT_SENTENCE_SIZE = 101
_SPECIAL_IDS = frozenset((PAD_ID, BOS_ID, EOS_ID))
# The masked-language-model symbol of the text tasks' tokenizers (at MASK_ID).
MASK_PIECE = "<mask>"


class Tokenizer:
    """A sentencepiece model with the project's fixed special ids."""

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        ids = (
            processor.pad_id(),
            processor.unk_id(),
            processor.bos_id(),
            processor.eos_id(),
        )
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(
                f"sentencepiece model has special ids pad/unk/bos/eos = {ids}, expected "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}"
            )
        self._sp = processor

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a ``.model`` file written by :func:`train_tokenizer`."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise UserError(f"{path}: tokenizer model not found") from None
        except OSError as err:
            raise UserError(f"{path}: cannot read tokenizer model: {err.strerror}") from None
        try:
            return cls.from_bytes(data)
        except (RuntimeError, ValueError) as err:
            raise UserError(f"{path}: not a usable sentencepiece model: {err}") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> Tokenizer:
        """Rebuild from :meth:`to_bytes`: a serialized sentencepiece model proto, or a
        :class:`PieceVocabTokenizer`'s JSON."""
        if data.startswith(_PIECE_VOCAB_MAGIC):
            return PieceVocabTokenizer.from_json(data[len(_PIECE_VOCAB_MAGIC) :])
        return cls(_processor(data))

    def to_bytes(self) -> bytes:
        return bytes(self._sp.serialized_model_proto())

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of one sentence, without BOS/EOS."""
        return list(self._sp.encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        """Token ids of many sentences at once (sentencepiece's threaded encoder)."""
        threads = num_threads or min(8, os.cpu_count() or 1)
        return self._sp.encode(list(texts), out_type=int, num_threads=threads)

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Target-side token ids of many sentences (one joint vocabulary: as the source's)."""
        return self.encode_batch(texts)

    def sample_batch(self, texts: Sequence[str], dropout: float, seed: int) -> list[list[int]]:
        """Token ids of many sentences, each segmented with BPE-dropout: every merge skipped
        with probability ``dropout`` (a BPE model; :mod:`aiayn.data.sampling`). The draws
        depend on ``seed`` alone (sentencepiece's generator, one thread)."""
        spm.set_random_generator_seed(seed)
        return self._sp.encode(
            list(texts),
            out_type=int,
            enable_sampling=True,
            alpha=dropout,
            nbest_size=-1,
            num_threads=1,
        )

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def shared(self) -> bool:
        """Whether source and target number their pieces alike."""
        return True

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenised text; PAD, BOS and EOS are skipped, UNK becomes sentencepiece's ' ⁇ '."""
        return str(self._sp.decode([int(i) for i in ids if int(i) not in _SPECIAL_IDS]))

    def piece(self, token_id: int) -> str:
        return str(self._sp.id_to_piece(int(token_id)))

    @property
    def has_mask(self) -> bool:
        """Whether ``<mask>`` is the symbol at ``MASK_ID`` (a tokenizer of the text tasks)."""
        return self.vocab_size > MASK_ID and self.piece(MASK_ID) == MASK_PIECE


def _processor(data: bytes) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)
    return processor


_PIECE_VOCAB_MAGIC = b"aiayn-piece-vocab\n"
# Where the four special symbols of a piece vocabulary go (the fixed ids of aiayn.data.collate).
SPECIAL_PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}


# sentencepiece's TrainerSpec.ModelType numbers (sentencepiece_model.proto).
SPM_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


def spm_model_type(model: bytes) -> str:
    """The algorithm of a serialized sentencepiece model ("unigram", "bpe", "word" or
    "char"), read from its ``trainer_spec.model_type`` (proto fields 2 and 3) without the
    protobuf package. Unigram, the proto's default, when the field is absent."""

    def varint(data: bytes, at: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value, at

    def fields(data: bytes) -> dict[int, int | bytes]:
        found: dict[int, int | bytes] = {}
        at = 0
        while at < len(data):
            key, at = varint(data, at)
            number, wire = key >> 3, key & 7
            value: int | bytes
            if wire == 0:
                value, at = varint(data, at)
            elif wire == 2:
                size, at = varint(data, at)
                value, at = data[at : at + size], at + size
            elif wire in (1, 5):  # fixed 64 / 32 bits
                value, at = 0, at + (8 if wire == 1 else 4)
            else:
                raise ValueError(f"not a sentencepiece model (wire type {wire})")
            found.setdefault(number, value)
        return found

    spec = fields(model).get(2, b"")
    kind = fields(spec).get(3, 1) if isinstance(spec, bytes) else 1
    return SPM_MODEL_TYPES.get(int(kind) if isinstance(kind, int) else 1, "unigram")


class PieceVocabTokenizer(Tokenizer):
    """Sentencepiece models that cut text into pieces, and vocabularies that number the pieces:
    the tokenizers of Marian / OPUS-MT models (``source.spm``, ``target.spm``, ``vocab.json``).

    ``source_vocab[i]`` is the piece of id ``i`` on the source side, ``target_vocab`` on the
    target side (the same list for a shared vocabulary); ids 0-3 hold ``<pad> <unk> <s> </s>``
    (:data:`SPECIAL_PIECES`). A piece that a vocabulary lacks is UNK. A source sentence that
    starts with a language code such as ``>>fra<<`` keeps it as one token, as Marian's
    multilingual models expect. Serialised as JSON (the sentencepiece models in base64), so a
    checkpoint embeds it without code.
    """

    def __init__(
        self,
        source_spm: bytes,
        target_spm: bytes,
        source_vocab: Sequence[str],
        target_vocab: Sequence[str],
    ) -> None:
        for name, vocab in (("source", source_vocab), ("target", target_vocab)):
            head = {i: vocab[i] for i in SPECIAL_PIECES if i < len(vocab)}
            if head != SPECIAL_PIECES:
                raise ValueError(f"{name} vocabulary starts with {head}, expected {SPECIAL_PIECES}")
        self._spm_bytes = (source_spm, target_spm)
        self._source_sp = _processor(source_spm)
        self._target_sp = _processor(target_spm)
        self.source_vocab = list(source_vocab)
        self.target_vocab = list(target_vocab)
        self._source_ids = {piece: i for i, piece in enumerate(self.source_vocab)}
        self._target_ids = {piece: i for i, piece in enumerate(self.target_vocab)}

    @classmethod
    def from_json(cls, data: bytes) -> PieceVocabTokenizer:
        fields = json.loads(data.decode("utf-8"))
        return cls(
            base64.b64decode(fields["source_spm"]),
            base64.b64decode(fields["target_spm"]),
            fields["source_vocab"],
            fields["target_vocab"],
        )

    def to_bytes(self) -> bytes:
        fields = {
            "source_spm": base64.b64encode(self._spm_bytes[0]).decode("ascii"),
            "target_spm": base64.b64encode(self._spm_bytes[1]).decode("ascii"),
            "source_vocab": self.source_vocab,
            "target_vocab": self.target_vocab,
        }
        return _PIECE_VOCAB_MAGIC + json.dumps(fields, ensure_ascii=False).encode("utf-8")

    @property
    def source_spm(self) -> bytes:
        """The source side's sentencepiece model (Marian's ``source.spm``)."""
        return self._spm_bytes[0]

    @property
    def target_spm(self) -> bytes:
        """The target side's sentencepiece model (Marian's ``target.spm``)."""
        return self._spm_bytes[1]

    @property
    def shared(self) -> bool:
        return self.source_vocab == self.target_vocab

    @property
    def vocab_size(self) -> int:
        """The source vocabulary's size (the target's: :attr:`target_vocab_size`)."""
        return len(self.source_vocab)

    @property
    def target_vocab_size(self) -> int:
        return len(self.target_vocab)

    def source_pieces(self, text: str) -> list[str]:
        code = []
        end = text.find("<<") if text.startswith(">>") else -1
        if end != -1:  # a leading language code such as >>fra<< is one token
            code, text = [text[: end + 2]], text[end + 2 :]
        return code + list(self._source_sp.encode(text, out_type=str))

    def encode(self, text: str) -> list[int]:
        """Source-side token ids of one sentence, without EOS."""
        return [self._source_ids.get(p, UNK_ID) for p in self.source_pieces(text)]

    def encode_batch(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_target(self, text: str) -> list[int]:
        """Target-side token ids of one sentence (references for fine-tuning), without EOS."""
        pieces = self._target_sp.encode(text, out_type=str)
        return [self._target_ids.get(p, UNK_ID) for p in pieces]

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode_target(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenised target text; PAD, BOS and EOS are skipped, UNK becomes ``<unk>``; no
        space at either end (a last piece of ``▁`` alone), as ``MarianTokenizer`` gives."""
        pieces = [self.target_vocab[int(i)] for i in ids if int(i) not in _SPECIAL_IDS]
        return str(self._target_sp.decode_pieces(pieces)).strip()

    def piece(self, token_id: int) -> str:
        return self.target_vocab[int(token_id)]

    def source_piece(self, token_id: int) -> str:
        return self.source_vocab[int(token_id)]

    @property
    def has_mask(self) -> bool:
        return False


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_tokenizer(
    text_files: list[Path],
    vocab_size: int,
    model_prefix: Path,
    model_type: str = "bpe",
    *,
    character_coverage: float = DEFAULT_CHARACTER_COVERAGE,
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
    num_threads: int = 0,
    seed: int = 1,
    source: str | None = None,
    user_defined_symbols: Sequence[str] = (),
) -> Tokenizer:
    """Train one joint model on all ``text_files``; writes ``{model_prefix}.model`` and ``.vocab``.

    ``user_defined_symbols`` take the ids after the four special ones, in order (``[MASK_PIECE]``
    puts ``<mask>`` at ``MASK_ID``); each is always one token, also where the text spells it.
    A vocabulary size the text cannot support raises :class:`UserError` naming the limit and
    the text (``source``, by default the file names).
    """
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise UserError(f"unknown tokenizer model type {model_type!r} (bpe, unigram, char, word)")
    reserved = 4 + len(user_defined_symbols)
    if vocab_size <= reserved:
        raise UserError(
            f"vocabulary size {vocab_size} leaves no room beyond the {reserved} special ids"
        )
    if not (input_sentence_size == 0 or input_sentence_size >= MIN_INPUT_SENTENCE_SIZE):
        raise UserError(
            f"input_sentence_size must be 0 (every sentence) or at least "
            f"{MIN_INPUT_SENTENCE_SIZE}, got {input_sentence_size}"
        )
    spm.set_random_generator_seed(seed)
    model_prefix = Path(model_prefix)
    try:
        spm.SentencePieceTrainer.train(
            input=",".join(str(p) for p in text_files),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            user_defined_symbols=list(user_defined_symbols),
            # Sentences longer than this (bytes) are skipped by the trainer, not truncated.
            max_sentence_length=16384,
            num_threads=num_threads or min(8, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as err:
        message = str(err)
        files = source or ", ".join(str(p) for p in text_files)
        if match := _TOO_HIGH.search(message):
            raise UserError(
                f"vocabulary size {match.group(1)} is larger than the training text allows "
                f"(at most {match.group(2)} for {files}); lower the vocabulary size (--vocab-size)"
            ) from None
        if match := _TOO_LOW.search(message):
            raise UserError(
                f"vocabulary size {match.group(1)} is smaller than the {match.group(2)} "
                f"characters and special symbols of {files} need; raise the vocabulary size "
                f"(--vocab-size)"
            ) from None
        raise UserError(f"sentencepiece could not train on {files}: {message}") from None
    return Tokenizer.load(model_prefix.with_name(model_prefix.name + ".model"))
