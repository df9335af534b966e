"""Generation with the decoder-only LM, and classification with the encoder-only model."""

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.data.collate import BOS_ID, EOS_ID
from aiayn.errors import UserError
from aiayn.inference.classifier import TextClassifier
from aiayn.inference.generation import GenerateOptions, TextGenerator
from aiayn.model.families import DecoderOnlyLM, EncoderOnly


class Words:
    """A tokenizer over words "w5" .. "w49": id n is "w{n}"."""

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids if i > EOS_ID)


def _config(task: str, **changes) -> ModelConfig:
    base = {"vocab_size": 50, "d_model": 32, "d_ff": 64, "n_heads": 4, "n_layers": 2}
    return ModelConfig(**{**base, "dropout": 0.0, "max_positions": 40, "task": task, **changes})


def _generator(seed: int = 0) -> TextGenerator:
    torch.manual_seed(seed)
    return TextGenerator(DecoderOnlyLM(_config("lm")), Words())


def test_greedy_generation_is_the_argmax_of_the_full_forward_at_every_step():
    generator = _generator()
    result = generator.generate("w7 w8 w9", GenerateOptions(max_new_tokens=12, strategy="greedy"))
    ids = [BOS_ID, 7, 8, 9]
    with torch.no_grad():
        for token in result.tokens:
            logits = generator.model(torch.tensor([ids]))[0, -1]
            logits[[0, BOS_ID]] = float("-inf")  # PAD and BOS are never generated
            assert int(logits.argmax()) == token
            ids.append(token)
    assert result.text == "".join(" " + Words().decode([t]) for t in result.tokens)


def test_streamed_pieces_add_up_to_the_text():
    generator = _generator(1)
    pieces: list[str] = []
    options = GenerateOptions(max_new_tokens=15, strategy="sample", seed=3)
    result = generator.generate("w5", options, on_text=pieces.append)
    assert len(pieces) == len(result.tokens) > 1  # one piece per token, as they come
    assert "".join(pieces) == result.text


def test_sampling_repeats_with_a_seed_and_filters_apply():
    generator = _generator(2)
    options = GenerateOptions(max_new_tokens=10, strategy="sample", seed=5, top_k=3)
    assert generator.generate("w9", options) == generator.generate("w9", options)
    other = GenerateOptions(max_new_tokens=10, strategy="sample", seed=6, top_k=3)
    runs = {tuple(generator.generate("w9", other).tokens) for _ in range(2)}
    assert len(runs) == 1
    # top_k=1 is greedy
    top1 = GenerateOptions(max_new_tokens=10, strategy="sample", seed=7, top_k=1)
    greedy = GenerateOptions(max_new_tokens=10, strategy="greedy")
    assert generator.generate("w9", top1).tokens == generator.generate("w9", greedy).tokens


def test_beam_search_scores_at_least_the_greedy_continuation():
    generator = _generator(3)
    greedy = generator.generate("w11 w12", GenerateOptions(max_new_tokens=6, strategy="greedy"))
    beam = generator.generate(
        "w11 w12", GenerateOptions(max_new_tokens=6, strategy="beam", beam_size=4, alpha=0.0)
    )
    assert beam.log_prob >= greedy.log_prob - 1e-4


def test_generation_stops_at_the_models_positions_and_refuses_long_prompts():
    generator = _generator()
    result = generator.generate("w5 " * 30, GenerateOptions(max_new_tokens=100, strategy="greedy"))
    assert len(result.tokens) <= 40 - 31
    with pytest.raises(UserError, match="reads at most 40"):
        generator.generate("w5 " * 40)
    with pytest.raises(UserError, match="top-p"):
        generator.generate("w5", GenerateOptions(top_p=0.0))
    for temperature in (float("inf"), float("nan"), 0.0):
        with pytest.raises(UserError, match="temperature must be a positive number"):
            generator.generate("w5", GenerateOptions(temperature=temperature))
    with pytest.raises(UserError, match="seed must be from"):
        generator.generate("w5", GenerateOptions(seed=2**64))
    with pytest.raises(TypeError, match="generate continues one prompt"):
        generator.generate(["w5", "w6"])  # type: ignore[arg-type]


def test_classifier_probabilities_in_input_order_and_batch_independent():
    torch.manual_seed(0)
    model = EncoderOnly(_config("classify", n_classes=3))
    texts = ["w5 w6", "w7 w8 w9 w10 w11", "w12", "w13 w14 w15"]
    big = TextClassifier(model, Words(), ["a", "b", "c"])
    small = TextClassifier(model, Words(), ["a", "b", "c"], batch_tokens=5)
    probs = big.probabilities(texts)
    assert probs.shape == (4, 3)
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    assert torch.allclose(probs, small.probabilities(texts), atol=1e-6)
    alone = big.probabilities([texts[1]])
    assert torch.allclose(alone[0], probs[1], atol=1e-6)
    best = big.predict(texts)
    assert torch.equal(big.probabilities(iter(texts)), probs)  # an iterator, read once
    assert [p.label for p in big.predict(t for t in texts)] == [p.label for p in best]
    assert [p.label for p in best] == [["a", "b", "c"][int(i)] for i in probs.argmax(-1)]
    assert big.inputs("w5 " * 60)[-1] == EOS_ID and len(big.inputs("w5 " * 60)) == 40
    with pytest.raises(ValueError, match="batch_tokens must be positive, got 0"):
        TextClassifier(model, Words(), ["a", "b", "c"], batch_tokens=0)
    for call in (big.predict, big.probabilities):  # one string is not four one-letter texts
        with pytest.raises(TypeError, match=r"a list of lines, not one string"):
            call("w5 w6")
