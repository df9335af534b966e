import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.training.loss import label_smoothed_nll

PAD = 0


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    target = torch.randint(1, 11, (3, 5), generator=gen)
    target[0, 3:] = PAD
    target[2, 1:] = PAD
    return logits, target


def test_epsilon_zero_equals_cross_entropy():
    logits, target = _data()
    loss, nll = label_smoothed_nll(logits, target, 0.0, PAD)
    expected = F.cross_entropy(
        logits.reshape(-1, 11).float(), target.reshape(-1), ignore_index=PAD, reduction="sum"
    )
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected)


def test_smoothed_loss_matches_the_written_out_distribution():
    logits, target = _data(1)
    eps, vocab = 0.1, logits.size(-1)
    loss, nll = label_smoothed_nll(logits, target, eps, PAD)
    log_probs = F.log_softmax(logits.float(), dim=-1).reshape(-1, vocab)
    flat = target.reshape(-1)
    # q = (1 - ε)·onehot(y) + ε/V ; loss = -Σ_v q_v log p_v over non-padding positions.
    q = torch.full_like(log_probs, eps / vocab)
    q[torch.arange(flat.numel()), flat] += 1 - eps
    keep = flat != PAD
    expected = -(q * log_probs).sum(-1)[keep].sum()
    torch.testing.assert_close(loss, expected)
    expected_nll = -log_probs[torch.arange(flat.numel()), flat][keep].sum()
    torch.testing.assert_close(nll, expected_nll)


def test_padding_contributes_nothing():
    logits, target = _data(2)
    base_loss, base_nll = label_smoothed_nll(logits, target, 0.1, PAD)
    changed = logits.clone()
    changed[target == PAD] = float("nan")  # garbage at padded positions
    loss, nll = label_smoothed_nll(changed, target, 0.1, PAD)
    assert torch.equal(loss, base_loss) and torch.equal(nll, base_nll)
    # And no gradient reaches padded logits.
    leaf = logits.clone().requires_grad_(True)
    label_smoothed_nll(leaf, target, 0.1, PAD)[0].backward()
    assert torch.count_nonzero(leaf.grad[target == PAD]) == 0
    assert torch.all(leaf.grad[target != PAD].abs().sum(-1) > 0)


def test_uniform_logits_give_log_vocab():
    target = torch.tensor([[1, 2, PAD]])
    logits = torch.zeros(1, 3, 7)
    loss, nll = label_smoothed_nll(logits, target, 0.1, PAD)
    assert math.isclose(float(nll), 2 * math.log(7), rel_tol=1e-6)
    assert math.isclose(float(loss), 2 * math.log(7), rel_tol=1e-6)


def test_rejects_bad_epsilon():
    logits, target = _data()
    with pytest.raises(ValueError):
        label_smoothed_nll(logits, target, 1.0, PAD)
