"""The fused projection + label-smoothed loss (aiayn.accel.loss): the plain loss over the
projected logits, in float32 and to bfloat16's written-out rounding."""

import pytest
import torch
import torch.nn.functional as F

PAD = 0


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("n_rows", [7, 600])  # one chunk; several chunks, the last partial
def test_projected_loss_equals_projection_then_loss(epsilon: float, n_rows: int) -> None:
    from aiayn.accel import loss as loss_module

    gen = torch.Generator().manual_seed(n_rows)
    d, vocab = 6, 13
    hidden = torch.randn(n_rows, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64)
    target = torch.randint(1, vocab, (n_rows,), generator=gen)
    target[::5] = PAD
    # The reference, written out in float64: q = (1 - ε)·onehot(y) + ε/V, loss = -Σ q·log p.
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_probs = F.log_softmax(h1 @ w1.t(), dim=-1)
    q = torch.full_like(log_probs, epsilon / vocab)
    q[torch.arange(n_rows), target] += 1 - epsilon
    keep = target != PAD
    loss = -(q * log_probs).sum(-1)[keep].sum()
    nll = -log_probs[torch.arange(n_rows), target][keep].sum()
    (3.0 * loss).backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused_loss, fused_nll = loss_module.projected_label_smoothed_nll(
        h2.reshape(1, n_rows, d), w2, target.reshape(1, n_rows), epsilon, PAD
    )
    (3.0 * fused_loss).backward()  # the upstream gradient is applied
    torch.testing.assert_close(fused_loss, loss.float())  # the sums are float32
    torch.testing.assert_close(fused_nll, nll.float())
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)
    assert torch.count_nonzero(h2.grad[target == PAD]) == 0


def test_projected_loss_ignores_garbage_at_padding() -> None:
    from aiayn.accel.loss import projected_label_smoothed_nll

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 4, 5, generator=gen)
    weight = torch.randn(9, 5, generator=gen)
    target = torch.randint(1, 9, (2, 4), generator=gen)
    target[1, 2:] = PAD
    base = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD)
    changed = hidden.clone()
    changed[target == PAD] = float("nan")
    assert all(
        map(torch.equal, base, projected_label_smoothed_nll(changed, weight, target, 0.1, PAD))
    )


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16, back in float64."""
    return x.to(torch.bfloat16).to(torch.float64)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows", [37, 11])  # 30 rows kept: two groups; 9: one
def test_projected_loss_in_bfloat16_follows_its_written_out_rounding(
    monkeypatch, hidden_dtype, n_rows
):
    # train.precision=bf16 on the CPU: the three products in bfloat16 (inputs, logits and the
    # gradient rounded to it), everything between them in float32. The reference writes that
    # out in float64, with chunks of 8 rows and groups of 16 rows (the last partial).
    from aiayn.accel import loss as loss_module

    monkeypatch.setattr(loss_module, "PROJECTION_CHUNK_ROWS", 8)
    monkeypatch.setattr(loss_module, "LOW_PRECISION_GROUP_ROWS", 16)
    monkeypatch.setattr(loss_module, "BF16_ROW_MULTIPLE", 4)  # 30 rows -> 32, 9 -> 12
    # Buffers come filled with NaN, so that a padding row left unzeroed shows.
    empty = torch.empty
    monkeypatch.setattr(
        loss_module.torch,
        "empty",
        lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan")),
    )
    epsilon, d, vocab = 0.1, 16, 50
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(n_rows, d, generator=gen).to(hidden_dtype)
    weight = torch.randn(vocab, d, generator=gen) * 0.5
    target = torch.randint(1, vocab, (n_rows,), generator=gen)
    target[::6] = PAD
    keep = target != PAD

    h64, w64 = _bf16(hidden.double()), _bf16(weight.double())
    logits = _bf16(h64 @ w64.t())
    log_probs = F.log_softmax(logits, dim=-1)
    q = torch.full_like(log_probs, epsilon / vocab)
    q[torch.arange(n_rows), target] += 1 - epsilon
    loss = -(q * log_probs).sum(-1)[keep].sum()
    nll = -log_probs[torch.arange(n_rows), target][keep].sum()
    grad = _bf16(log_probs.exp() - q) * keep[:, None]  # dloss/dlogits, padding rows dropped
    upstream = 3.0
    want_hidden = upstream * _bf16(grad @ w64)
    # Each group of 16 non-padding rows gives a (V, d) product rounded to bfloat16; the
    # groups are summed in float32.
    g_kept, h_kept = grad[keep], h64[keep]
    want_weight = upstream * sum(
        _bf16(g_kept[i : i + 16].t() @ h_kept[i : i + 16]) for i in range(0, len(h_kept), 16)
    )

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    got_loss, got_nll = loss_module.projected_label_smoothed_nll(
        h, w, target, epsilon, PAD, compute_dtype=torch.bfloat16
    )
    (upstream * got_loss).backward()
    assert h.grad.dtype == hidden_dtype and w.grad.dtype == torch.float32
    # Where float32 accumulation inside a bfloat16 product tips a value across a rounding
    # boundary, one element differs by a bfloat16 step (0.4%): the tolerances allow that
    # (this CPU matches to 1e-5), not a misplaced row or a missing term.
    torch.testing.assert_close(got_loss.double(), loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_nll.double(), nll, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(h.grad.double(), want_hidden, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(w.grad.double(), want_weight, rtol=1e-2, atol=1e-3)
    assert torch.count_nonzero(h.grad[~keep]) == 0


def test_projected_loss_refuses_other_compute_dtypes():
    from aiayn.accel.loss import projected_label_smoothed_nll

    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    target = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="compute_dtype"):
        projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, torch.float16)
    with pytest.raises(ValueError, match="hidden is"):
        projected_label_smoothed_nll(hidden.double(), weight, target, 0.1, PAD)


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_projected_loss_of_padding_only_is_zero(compute_dtype):
    from aiayn.accel.loss import projected_label_smoothed_nll

    hidden = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    target = torch.full((2, 3), PAD)
    loss, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, compute_dtype)
    loss.backward()
    assert float(loss.detach()) == float(nll.detach()) == 0.0
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0
