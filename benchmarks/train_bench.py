"""Training throughput of one system on one workload, in this process (run by ``run_all.py``).

A timed update is a full training step: forward, label-smoothed loss, backward, Adam step
(and, for aiayn, the learning-rate schedule). Reports the time of each timed update, target
tokens per second from their median, and this process's peak RSS.

    python -m benchmarks.train_bench --system aiayn --workload small --warmup 3 --steps 10
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common import (
    PAD_ID,
    WORKLOADS,
    TrainBatch,
    Workload,
    emit,
    median,
    peak_rss_mb,
    set_threads,
    skip,
    time_calls,
    training_batch,
    training_flops_per_target_token,
)
from benchmarks.peers import available

SYSTEMS = ("aiayn", "aiayn-bf16", "torch", "hf")
Update = Callable[[], None]

# The peers' optimiser: Adam with the paper's betas and epsilon, PyTorch's default kernel.
ADAM_BETAS, ADAM_EPS, PEER_LR = (0.9, 0.98), 1e-9, 1e-4


def aiayn_update(
    w: Workload, batch: TrainBatch | Sequence[TrainBatch], bf16: bool = False
) -> Update:
    """The core of ``aiayn.training.trainer.Trainer._update`` for one batch on the CPU in fp32:
    the library's model, its fused projection + label-smoothed loss
    (``projected_label_smoothed_nll``) where the acceleration fuses them (else the loss over
    the logits), ``build_optimizer`` (fused Adam) and ``build_schedule``; given several
    batches, each update takes the next (in turn). With ``bf16``, what
    ``train.precision=bf16`` does on the CPU (opt-in, outside the fp32 workloads): the model
    under bfloat16 autocast and the fused loss with bfloat16 products."""
    from aiayn.accel import accelerate
    from aiayn.accel.loss import projected_label_smoothed_nll
    from aiayn.config import TrainConfig
    from aiayn.model.families import build_model
    from aiayn.training.loss import label_smoothed_nll
    from aiayn.training.optim import build_optimizer, build_schedule

    config = w.model_config()
    train = TrainConfig(label_smoothing=w.label_smoothing)
    torch.manual_seed(0)
    model = build_model(config).train()
    # As aiayn train's Trainer does (its process settings included).
    precision = "bf16" if bf16 else "fp32"
    acceleration = accelerate(model, "train", precision=precision, process_settings=True)
    optimizer = build_optimizer(model, train)
    schedule = build_schedule(optimizer, config.d_model, train)
    given = [batch] if isinstance(batch, TrainBatch) else batch
    # Each batch with its target token count, counted once rather than in the timed update.
    batches = itertools.cycle([(b, float(b.tgt_out.ne(PAD_ID).sum())) for b in given])
    eps = train.label_smoothing
    fused = model.out_proj.weight if acceleration.fused_loss else None

    dtype = torch.bfloat16 if bf16 else None

    def update() -> None:
        batch, n_tokens = next(batches)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(batch.src_ids, batch.src_pad, batch.tgt_in, project=fused is None)
        if fused is not None:
            loss_sum, _ = projected_label_smoothed_nll(
                out, fused, batch.tgt_out, eps, PAD_ID, dtype
            )
        else:
            loss_sum, _ = label_smoothed_nll(out, batch.tgt_out, eps, PAD_ID)
        (loss_sum / n_tokens).backward()
        optimizer.step()
        schedule.step()

    return update


def torch_update(w: Workload, batch: TrainBatch) -> Update:
    from benchmarks.peers import TorchTransformer

    torch.manual_seed(0)
    model = TorchTransformer(w).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=PEER_LR, betas=ADAM_BETAS, eps=ADAM_EPS)

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch.src_ids, batch.src_pad, batch.tgt_in)
        loss = F.cross_entropy(
            logits.reshape(-1, w.vocab_size),
            batch.tgt_out.reshape(-1),
            ignore_index=PAD_ID,
            label_smoothing=w.label_smoothing,
        )
        loss.backward()
        optimizer.step()

    return update


def hf_update(w: Workload, batch: TrainBatch) -> Update:
    from benchmarks.peers import marian_model

    model = marian_model(w).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=PEER_LR, betas=ADAM_BETAS, eps=ADAM_EPS)
    attention_mask = (~batch.src_pad).long()
    # Marian starts the decoder from its padding id, not BOS.
    decoder_in = batch.tgt_in.clone()
    decoder_in[:, 0] = model.config.decoder_start_token_id

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(
            input_ids=batch.src_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_in,
            use_cache=False,
        ).logits
        loss = F.cross_entropy(
            logits.reshape(-1, w.vocab_size),
            batch.tgt_out.reshape(-1),
            ignore_index=PAD_ID,
            label_smoothing=w.label_smoothing,
        )
        loss.backward()
        optimizer.step()

    return update


BUILDERS: dict[str, Callable[[Workload, TrainBatch], Update]] = {
    "aiayn": aiayn_update,
    "aiayn-bf16": lambda w, batch: aiayn_update(w, batch, bf16=True),
    "torch": torch_update,
    "hf": hf_update,
}
REQUIRES = {"hf": "transformers"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    set_threads()
    needed = REQUIRES.get(args.system)
    if needed and not available(needed):
        skip(args.system, f"{needed} is not installed (pip install -e '.[bench]')")
        return
    if args.system == "aiayn-bf16":
        from aiayn.accel import cpu_has_bfloat16

        if not cpu_has_bfloat16():
            skip(args.system, "this CPU has no bfloat16 instructions (AVX512-BF16 or AMX)")
            return
    w = WORKLOADS[args.workload]
    batch = training_batch(w)
    start = time.perf_counter()
    update = BUILDERS[args.system](w, batch)
    build_s = time.perf_counter() - start
    times = time_calls(update, args.warmup, args.steps)
    step_s = median(times)
    emit(
        {
            "kind": "train",
            "system": args.system,
            "workload": w.name,
            "times_s": times,
            "median_s": step_s,
            "tokens_per_s": w.tgt_tokens / step_s,
            "gflops": w.tgt_tokens * training_flops_per_target_token(w) / step_s / 1e9,
            "build_s": build_s,
            "peak_rss_mb": peak_rss_mb(),
        }
    )


if __name__ == "__main__":
    main()
