"""A/B measurements of single levers, each variant interleaved with the others in one process
(wall-clock medians on the benchmark's 2 threads). ``docs/performance.md`` records what each
gave; this script reproduces those figures.

    .venv/bin/python -m benchmarks.levers loss adam dropout cache mask attention [--repeats N]
    .venv/bin/python -m benchmarks.levers search
    .venv/bin/python -m benchmarks.levers compile-train compile-decode   # minutes: compiles
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import (
    BASE,
    DECODE,
    PAD_ID,
    SMALL,
    Workload,
    decode_sources,
    median,
    set_threads,
    training_batch,
)
from benchmarks.decode_bench import suppress_eos

Variants = dict[str, Callable[[], object]]


def interleaved(variants: Variants, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each variant, the variants taking turns."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: median(ts) for name, ts in times.items()}


def show(title: str, results: dict[str, float]) -> None:
    first = next(iter(results.values()))
    print(f"\n{title}")
    for name, seconds in results.items():
        print(f"  {name:<40} {1000 * seconds:9.1f} ms   {first / seconds:5.2f}× the first")


def _model(w: Workload, train: bool) -> torch.nn.Module:
    from aiayn.model.families import build_model

    torch.manual_seed(0)
    config = w.model_config()
    return build_model(config).train(train)


def _loss_variants(w: Workload) -> Variants:
    from aiayn.accel.loss import projected_label_smoothed_nll
    from aiayn.training.loss import label_smoothed_nll

    n = w.tgt_tokens
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, w.d_model, generator=gen).requires_grad_()
    weight = torch.randn(w.vocab_size, w.d_model, generator=gen) * w.d_model**-0.5
    weight.requires_grad_()
    target = torch.randint(4, w.vocab_size, (n,), generator=gen)
    eps = w.label_smoothing

    def on_logits(loss_fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[[], None]:
        def run() -> None:
            hidden.grad = weight.grad = None
            loss, _ = loss_fn(hidden @ weight.t(), target, eps, PAD_ID)
            (loss / n).backward()

        return run

    def fused_projection() -> None:
        hidden.grad = weight.grad = None
        loss, _ = projected_label_smoothed_nll(hidden, weight, target, eps, PAD_ID)
        (loss / n).backward()

    def peer() -> None:
        hidden.grad = weight.grad = None
        F.cross_entropy(hidden @ weight.t(), target, label_smoothing=eps).backward()

    return {
        "projection + label_smoothed_nll (training/loss.py)": on_logits(label_smoothed_nll),
        "F.cross_entropy(label_smoothing) (peers)": peer,
        "projected_label_smoothed_nll (accel/loss.py; the trainer's)": fused_projection,
    }


def lever_loss(repeats: int) -> None:
    """Projection + label-smoothed loss, forward and backward, from the decoder output."""
    for w in (SMALL, BASE):
        show(
            f"loss, {w.name}: projection + loss, forward + backward",
            interleaved(_loss_variants(w), repeats),
        )


def _update(w: Workload, adam: dict[str, bool], grid_dropout: bool = False) -> Callable[[], None]:
    from aiayn.accel import GridDropout, GridResidual
    from aiayn.model.layers import Residual
    from aiayn.training.loss import label_smoothed_nll

    model = _model(w, train=True)
    if grid_dropout:  # the dropout lever of accelerate(mode="train") alone
        for module in model.modules():
            if type(module) is torch.nn.Dropout:
                module.__class__ = GridDropout
            elif type(module) is Residual:
                module.__class__ = GridResidual
    batch = training_batch(w)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, **adam)

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss, _ = label_smoothed_nll(logits, batch.tgt_out, w.label_smoothing, PAD_ID)
        (loss / w.tgt_tokens).backward()
        optimizer.step()

    return update


def lever_adam(repeats: int) -> None:
    for w in (SMALL, BASE):
        show(
            f"adam, {w.name}: full training update",
            interleaved(
                {
                    "Adam, default (for-loop on CPU)": _update(w, {}),
                    "Adam(foreach=True)": _update(w, {"foreach": True}),
                    "Adam(fused=True)": _update(w, {"fused": True}),
                },
                max(2, repeats // 2),
            ),
        )


def lever_dropout(repeats: int) -> None:
    from aiayn.accel.dropout import dropout, dropout_add

    x, y = torch.randn(768, 512), torch.randn(768, 512)
    show(
        "dropout, one 768×512 activation (forward)",
        interleaved(
            {
                "F.dropout": lambda: F.dropout(x, 0.1, True),
                "aiayn.accel.dropout.dropout": lambda: dropout(x, 0.1, True),
                "x + F.dropout(y)": lambda: x + F.dropout(y, 0.1, True),
                "aiayn.accel.dropout.dropout_add": lambda: dropout_add(x, y, 0.1, True),
            },
            repeats * 5,
        ),
    )
    for w in (SMALL, BASE):
        show(
            f"dropout, {w.name}: full training update",
            interleaved(
                {
                    "plain model (F.dropout)": _update(w, {}),
                    "GridDropout + GridResidual": _update(w, {}, grid_dropout=True),
                },
                max(2, repeats // 2),
            ),
        )


def _decode_variant(
    model: torch.nn.Module, src: Tensor, beam: int, grouped: bool, pad_none: bool = False
) -> Callable[[], None]:
    from aiayn.inference.search import beam_search, greedy_search

    @torch.inference_mode()
    def run() -> None:
        n = src.size(0)
        pad = None if pad_none else torch.zeros_like(src, dtype=torch.bool)
        memory = model.encode(src, pad)
        if grouped or beam == 1:
            cache = model.init_cache(memory, pad, DECODE.steps, beam_size=beam)
        else:
            rows_pad = None if pad is None else pad.repeat_interleave(beam, 0)
            cache = model.init_cache(memory.repeat_interleave(beam, 0), rows_pad, DECODE.steps)
        step = suppress_eos(model.log_probs_step, DECODE.steps)
        if beam > 1:
            beam_search(step, cache, n, beam_size=beam, max_len=DECODE.steps - 1)
        else:
            greedy_search(step, cache, n, max_len=DECODE.steps - 1)

    return run


def lever_cache(repeats: int) -> None:
    model = _model(SMALL, train=False)
    src = decode_sources(DECODE)
    for n in (64, 1):
        show(
            f"cache, beam 4, {n} sentence(s) per batch",
            interleaved(
                {
                    "memory repeated per beam": _decode_variant(model, src[:n], 4, grouped=False),
                    "memory shared by the beams": _decode_variant(model, src[:n], 4, grouped=True),
                },
                repeats,
            ),
        )
    rows = torch.arange(256).view(64, 4)[:, torch.tensor([1, 0, 3, 3])].reshape(-1)
    buffer = torch.randn(256, 4, 24, 64)
    spare = torch.empty_like(buffer)
    for t in (4, 23):
        variants: Variants = {
            "buf[:, :, :t] = buf[rows, :, :t]": lambda t=t: buffer[:, :, :t].copy_(
                buffer[rows, :, :t]
            ),
            "index_select into the spare buffer": lambda t=t: torch.index_select(
                buffer[:, :, :t], 0, rows, out=spare[:, :, :t]
            ),
        }
        show(
            f"cache reorder, one (256, 4, 24, 64) buffer, {t} positions",
            interleaved(variants, repeats * 10),
        )


def lever_mask(repeats: int) -> None:
    model = _model(SMALL, train=False)
    src = decode_sources(DECODE)
    for n in (64, 1):
        show(
            f"mask, beam 4, {n} sentence(s): bool padding mask (no padding) vs none",
            interleaved(
                {
                    "bool mask": _decode_variant(model, src[:n], 4, grouped=True),
                    "no mask": _decode_variant(model, src[:n], 4, grouped=True, pad_none=True),
                },
                repeats,
            ),
        )


def lever_attention(repeats: int) -> None:
    def manual(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(q.size(-1) ** -0.5)
        return torch.matmul(scores.softmax(-1), v)

    for rows in (4, 256):
        q = torch.randn(rows, 4, 1, 64)
        k, v = torch.randn(rows, 4, 24, 64)[:, :, :12], torch.randn(rows, 4, 24, 64)[:, :, :12]
        show(
            f"attention, one decoder query over 12 cached positions, {rows} rows",
            interleaved(
                {
                    "F.scaled_dot_product_attention": lambda q=q, k=k, v=v: (
                        F.scaled_dot_product_attention(q, k, v)
                    ),
                    "matmul, softmax, matmul": lambda q=q, k=k, v=v: manual(q, k, v),
                },
                repeats * 20,
            ),
        )


class _Replay:
    """The cache protocol of search, for log-probabilities made beforehand."""

    def __init__(self) -> None:
        self.t = 0

    def reorder(self, rows: Tensor) -> None:
        pass

    def keep(self, rows: Tensor) -> None:
        pass


def _search_run(tables: list[Tensor], n: int, sync_free: frozenset[str]) -> Callable[[], None]:
    from aiayn.inference import search

    def step(tokens: Tensor, cache: _Replay) -> Tensor:
        cache.t += 1
        return tables[cache.t - 1][: tokens.numel()]

    def run() -> None:
        saved = search.SYNC_FREE_DEVICES
        search.SYNC_FREE_DEVICES = sync_free
        try:
            search.beam_search(step, _Replay(), n, beam_size=4, max_len=len(tables) - 1)
        finally:
            search.SYNC_FREE_DEVICES = saved

    return run


def lever_search(repeats: int) -> None:
    """Beam search alone, over log-probabilities made beforehand: the n-best merge at every
    step (one transfer a step, as on a GPU) against only where a candidate finished (the
    CPU's, which reads the finished mask on the host)."""
    gen = torch.Generator().manual_seed(0)
    steps, vocab = DECODE.steps, SMALL.vocab_size
    for n in (1, 64):
        tables = [
            torch.randn(n * 4, vocab, generator=gen).mul_(3.0).log_softmax(-1) for _ in range(steps)
        ]
        show(
            f"beam search alone, beam 4, {n} sentence(s), {vocab} tokens, {steps} steps",
            interleaved(
                {
                    "merge every step (one transfer a step)": _search_run(tables, n, frozenset()),
                    "merge where a candidate finished": _search_run(tables, n, frozenset({"cpu"})),
                },
                repeats * 5,
            ),
        )


def lever_compile_train(repeats: int) -> None:
    from aiayn.training.loss import label_smoothed_nll

    w = SMALL
    model = _model(w, train=True)
    batch = training_batch(w)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    compiled_model = torch.compile(model)

    def compiled() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = compiled_model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss, _ = label_smoothed_nll(logits, batch.tgt_out, w.label_smoothing, PAD_ID)
        (loss / w.tgt_tokens).backward()
        optimizer.step()

    start = time.perf_counter()
    compiled()
    print(f"\ncompile-train, {w.name}: compile + first update {time.perf_counter() - start:.1f} s")
    show(
        f"compile-train, {w.name}: full training update",
        interleaved({"eager": _update(w, {}), "torch.compile(model)": compiled}, repeats),
    )


def lever_compile_decode(repeats: int) -> None:
    from aiayn.inference.search import beam_search

    model = _model(SMALL, train=False)
    src = decode_sources(DECODE)[:1]
    compiled_step = torch.compile(model.log_probs_step, dynamic=True)

    def run(step_fn: Callable[[Tensor, object], Tensor]) -> Callable[[], None]:
        @torch.inference_mode()
        def go() -> None:
            pad = torch.zeros_like(src, dtype=torch.bool)
            cache = model.init_cache(model.encode(src, pad), pad, DECODE.steps, beam_size=4)
            beam_search(
                suppress_eos(step_fn, DECODE.steps), cache, 1, beam_size=4, max_len=DECODE.steps - 1
            )

        return go

    start = time.perf_counter()
    run(compiled_step)()
    print(f"\ncompile-decode: compile + first sentence {time.perf_counter() - start:.1f} s")
    show(
        "compile-decode, beam 4, one sentence",
        interleaved(
            {
                "eager": run(model.log_probs_step),
                "torch.compile(log_probs_step)": run(compiled_step),
            },
            repeats,
        ),
    )


LEVERS: dict[str, Callable[[int], None]] = {
    "loss": lever_loss,
    "adam": lever_adam,
    "dropout": lever_dropout,
    "cache": lever_cache,
    "mask": lever_mask,
    "attention": lever_attention,
    "search": lever_search,
    "compile-train": lever_compile_train,
    "compile-decode": lever_compile_decode,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("levers", nargs="+", choices=sorted(LEVERS))
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    set_threads()
    for name in args.levers:
        LEVERS[name](args.repeats)


if __name__ == "__main__":
    main()
