import math
import re
import shutil
import types

import pytest
import torch

from aiayn.inference import loading
from aiayn.model.families import build_model
from aiayn.model.transformer import Transformer
from aiayn.training.launch import train_and_average
from aiayn.training.loss import label_smoothed_nll
from aiayn.training.metrics import read_metrics
from aiayn.training.trainer import Trainer, TrainingError
from aiayn.training.validation import ValidSet
from tests.helpers import FixedSampler, ListCorpus, reverse_pairs, tiny_config

pytestmark = pytest.mark.usefixtures("single_thread")

LENGTH, BATCH = 6, 8
TOKENS_PER_BATCH = BATCH * (LENGTH + 1)  # y + EOS


def make_trainer(
    run_dir, config, seed=0, n_pairs=96, valid=None, tokenizer=b"spm", show_progress=False
):
    torch.manual_seed(config.train.seed)
    model = build_model(config.model)
    corpus = ListCorpus(reverse_pairs(n_pairs, LENGTH, config.model.vocab_size, seed))
    batches = [list(range(i, i + BATCH)) for i in range(0, n_pairs, BATCH)]
    sampler = FixedSampler(batches, seed=seed)
    return Trainer(
        config,
        model,
        corpus,
        sampler,
        run_dir,
        valid=valid,
        tokenizer_bytes=tokenizer,
        show_progress=show_progress,
        tensorboard=False,
    )


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_exact_resume_is_bit_identical(tmp_path):
    n = 10  # 12 batches per epoch, 2 per update: the runs cross epoch boundaries
    over = [f"train.update_tokens={2 * TOKENS_PER_BATCH}", "model.dropout=0.1"]
    straight = make_trainer(tmp_path / "a", tiny_config(f"train.max_steps={2 * n}", *over))
    straight.train()

    first = make_trainer(tmp_path / "b", tiny_config(f"train.max_steps={n}", *over))
    first.train()
    path, state = loading.latest_valid_checkpoint(tmp_path / "b")
    assert path.name == f"step_{n:08d}.pt"
    # A fresh process: different initial weights and RNG until the checkpoint is loaded.
    torch.manual_seed(1234)
    second = make_trainer(tmp_path / "b", tiny_config(f"train.max_steps={2 * n}", *over))
    second.load_state_dict(state)
    result = second.train()
    assert result.step == 2 * n and second.epoch == straight.epoch == 3
    a, b = params_of(straight.model), params_of(second.model)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # The shared embedding stayed shared.
    m = second.model
    assert m.out_proj.weight is m.src_embed.token.weight is m.tgt_embed.token.weight


@pytest.mark.parametrize("stop", [5, 6])
def test_a_stop_by_a_signal_and_a_resume_leave_the_run_an_uninterrupted_one_leaves(tmp_path, stop):
    """A SIGTERM during update 5 saves step 5, off the save grid (every 2 updates); resumed,
    the run logs the loss of updates 4-6 as one record, as the uninterrupted run does (the
    sums since the last record are in the checkpoint), and once it has saved step 6, step 5
    goes: the same checkpoints for keep_last and averaging, the same parameters. One during
    update 6 saves step 6, on the grid, which stays."""
    import signal

    from aiayn.training import checkpoint as ckpt

    over = [
        "train.save_interval_steps=2",
        "train.keep_last=2",
        "train.average_last=2",
        "train.log_interval=3",
        "model.dropout=0.1",
    ]
    config = tiny_config("train.max_steps=8", *over)
    straight = make_trainer(tmp_path / "a", config)
    straight.train()

    first = make_trainer(tmp_path / "b", config)
    update = first._update

    def stopped_during_update() -> dict[str, float]:
        if first.step == stop - 1:
            first._signal = signal.SIGTERM  # as the handler sets it
        return update()

    first._update = stopped_during_update  # type: ignore[method-assign]
    result = first.train()
    assert result.interrupted and result.step == stop
    names = [p.name for p in loading.list_step_checkpoints(tmp_path / "b")]
    assert names == [f"step_{(stop - 1) // 2 * 2:08d}.pt", f"step_{stop:08d}.pt"]
    path, state = ckpt.resume_point(tmp_path / "b")
    torch.manual_seed(1234)
    second = make_trainer(tmp_path / "b", config)
    second.load_state_dict(state, path)
    assert second.train().step == 8
    names = [p.name for p in loading.list_step_checkpoints(tmp_path / "b")]
    assert names == [p.name for p in loading.list_step_checkpoints(tmp_path / "a")]
    assert names == ["step_00000006.pt", "step_00000008.pt"]
    a, b = params_of(straight.model), params_of(second.model)
    assert all(torch.equal(a[key], b[key]) for key in a)

    def logged(run):
        return [(r["step"], r["loss"], r["nll"]) for r in read_metrics(run) if r["kind"] == "train"]

    assert logged(tmp_path / "b") == logged(tmp_path / "a")
    assert [step for step, *_ in logged(tmp_path / "a")] == [3, 6]


@pytest.mark.parametrize("arch", ["bahdanau", "luong"])
def test_exact_resume_of_an_rnn_model_is_bit_identical(tmp_path, arch):
    """The same for the attention-RNN baselines (dropout on; the fused loss of the CPU)."""
    n = 4
    over = ["model.dropout=0.1", f"model.arch={arch}", "model.d_model=16", "train.clip_norm=1"]
    straight = make_trainer(tmp_path / "a", tiny_config(f"train.max_steps={2 * n}", *over))
    assert straight._fused_loss
    straight.train()
    first = make_trainer(tmp_path / "b", tiny_config(f"train.max_steps={n}", *over))
    first.train()
    _, state = loading.latest_valid_checkpoint(tmp_path / "b")
    torch.manual_seed(1234)
    second = make_trainer(tmp_path / "b", tiny_config(f"train.max_steps={2 * n}", *over))
    second.load_state_dict(state)
    assert second.train().step == 2 * n
    a, b = params_of(straight.model), params_of(second.model)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    m = second.model
    assert m.out_proj.weight is m.src_embed.weight is m.tgt_embed.weight


def test_update_sees_the_token_budget_and_normalises_globally(tmp_path):
    config = tiny_config("train.max_steps=1", f"train.update_tokens={3 * TOKENS_PER_BATCH - 5}")
    trainer = make_trainer(tmp_path, config)
    stats = trainer._update()
    assert stats["tgt_tokens"] == 3 * TOKENS_PER_BATCH  # three micro-batches
    assert trainer.sampler.position == 3 and trainer.step == 1


def test_gradient_equals_mean_token_loss_gradient(tmp_path):
    # lr_scale=0: the update leaves the weights (and the gradient) as they were.
    config = tiny_config(
        "model.dropout=0", "train.lr_scale=0", f"train.update_tokens={2 * TOKENS_PER_BATCH}"
    )
    trainer = make_trainer(tmp_path, config)
    reference = Transformer(config.model)
    reference.load_state_dict(trainer.model.state_dict())
    trainer._update()

    total, tokens = 0.0, 0
    for indices in trainer.sampler._order()[:2]:
        batch = trainer.corpus.batch(indices)
        loss, _ = label_smoothed_nll(
            reference(batch.src_ids, batch.src_pad, batch.tgt_in), batch.tgt_out, 0.1, 0
        )
        total = total + loss
        tokens += batch.n_tgt_tokens
    (total / tokens).backward()
    for (name, p), q in zip(trainer.model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class PoisonedModel(torch.nn.Module):
    """The model with NaN outputs (and so NaN gradients)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs) * float("nan")


def test_nan_loss_is_skipped_then_stops(tmp_path):
    config = tiny_config("train.max_steps=50", "train.max_bad_steps=3")
    trainer = make_trainer(tmp_path, config)
    trainer.train_module = PoisonedModel(trainer.model)
    before = params_of(trainer.model)
    with pytest.raises(TrainingError, match=r"3 updates in a row, after update 0"):
        trainer.train()
    assert trainer.skipped == 3 and trainer.step == 0
    after = params_of(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoints_validation_best_and_averaging(tmp_path):
    pairs = reverse_pairs(16, LENGTH, 64, seed=7)
    valid = ValidSet(
        ListCorpus(pairs),
        ListCorpus(pairs).src_lengths,
        references=[" ".join(map(str, t)) for _, t in pairs],
        detokenize=lambda ids: " ".join(map(str, ids)),
    )
    config = tiny_config(
        "train.max_steps=6",
        "train.valid_interval=2",
        "train.save_interval_steps=2",
        "train.keep_last=2",
        "train.average_last=2",
        "train.log_interval=1",
        f"train.update_tokens={TOKENS_PER_BATCH}",
    )
    trainer = make_trainer(tmp_path, config, valid=valid)
    result = train_and_average(trainer)
    assert result.reason == "reached train.max_steps=6" and not result.interrupted
    names = [p.name for p in loading.list_step_checkpoints(tmp_path)]
    assert names == ["step_00000004.pt", "step_00000006.pt"]
    assert (tmp_path / "best.pt").is_file() and result.averaged == tmp_path / "averaged.pt"
    records = read_metrics(tmp_path)
    kinds = [r["kind"] for r in records]
    assert kinds.count("train") == 6 and kinds.count("valid") == 3 and kinds[-1] == "averaged"
    valid_rec = [r for r in records if r["kind"] == "valid"]
    assert all(0.0 <= r["bleu"] <= 100.0 for r in valid_rec)
    assert all(math.isclose(r["ppl"], math.exp(r["nll"])) for r in valid_rec)
    state = loading.load_checkpoint(tmp_path / "averaged.pt")
    assert state["kind"] == "model" and bytes(state["tokenizer"].tolist()) == b"spm"


def test_patience_stops_early(tmp_path):
    pairs = reverse_pairs(8, LENGTH, 64, seed=3)
    valid = ValidSet(ListCorpus(pairs), ListCorpus(pairs).src_lengths)
    # lr_scale=0: the model never changes, so the validation loss never improves.
    config = tiny_config(
        "train.max_steps=100",
        "train.valid_interval=1",
        "train.patience=2",
        "train.lr_scale=0",
        f"train.update_tokens={TOKENS_PER_BATCH}",
    )
    result = make_trainer(tmp_path, config, valid=valid).train()
    assert result.step == 3 and "patience" in result.reason


def test_time_limit_stops_and_is_carried_across_resume(tmp_path):
    config = tiny_config("train.max_steps=100", "train.max_minutes=0.000001")
    trainer = make_trainer(tmp_path, config)
    result = trainer.train()
    assert result.step == 1 and result.reason == "reached train.max_minutes=1e-06"
    state = loading.load_checkpoint(result.checkpoint)
    assert state["progress"]["minutes"] > 0
    again = make_trainer(tmp_path, config)
    again.load_state_dict(state)
    assert again.train().step == 1  # the time already spent counts


def test_resume_refuses_another_model_or_tokenizer(tmp_path):
    from aiayn.errors import ResumeMismatch

    first = make_trainer(tmp_path / "a", tiny_config("train.max_steps=2"))
    first.train()
    _, state = loading.latest_valid_checkpoint(tmp_path / "a")
    other_tokenizer = make_trainer(tmp_path / "b", tiny_config(), tokenizer=b"spm2")
    with pytest.raises(ResumeMismatch, match="another tokenizer"):
        other_tokenizer.load_state_dict(state)
    other_model = make_trainer(tmp_path / "c", tiny_config("model.d_ff=48"))
    with pytest.raises(ResumeMismatch, match="d_ff: checkpoint"):
        other_model.load_state_dict(state)
    make_trainer(tmp_path / "d", tiny_config()).load_state_dict(state)  # the same: accepted
    # Both differ: the tokenizer is named (data prepared again explains the model's change).
    both = make_trainer(tmp_path / "e", tiny_config("model.d_ff=48"), tokenizer=b"spm2")
    with pytest.raises(ResumeMismatch, match="another tokenizer"):
        both.load_state_dict(state)
    # n_classes, which only a classifier uses (a run once took it from labelled data).
    make_trainer(tmp_path / "f", tiny_config("model.n_classes=7")).load_state_dict(state)


def test_fp16_needs_cuda(tmp_path):
    from aiayn.errors import ConfigError

    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        make_trainer(tmp_path, tiny_config("train.precision=fp16"))


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_takes_bf16_only_where_the_cpu_has_the_instructions(
    tmp_path, monkeypatch, capsys, native
):
    from aiayn.training import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cpu_has_bfloat16", lambda: native)
    trainer = make_trainer(tmp_path, tiny_config("train.precision=auto"))
    chosen = "bf16" if native else "fp32"
    assert trainer.train_cfg.precision == trainer.config.train.precision == chosen
    assert trainer._loss_dtype == (torch.bfloat16 if native else None)
    assert f"train.precision=auto: {chosen} (this CPU" in capsys.readouterr().err
    trainer.save()
    saved = loading.load_checkpoint(loading.list_step_checkpoints(tmp_path)[-1])
    assert saved["config"]["train"]["precision"] == chosen  # what ran, not "auto"


def test_progress_line_follows_the_nearer_limit():
    import io

    from aiayn.training.metrics import Progress

    stream = io.StringIO()
    progress = Progress(1000, stream=stream, total_minutes=10.0)
    progress.update(100, 2, 3.0, 2.5, 1e-3, 1234.0, minutes=5.0)  # half the time, 10% of steps
    line = stream.getvalue()
    assert line.startswith("[##########----------] 100/1000 ep 2 | loss 3.000 nll 2.500 ppl 12.2")
    assert "lr 1.00e-03 | 1,234 tok/s | 0:05:00 eta" in line
    quiet = io.StringIO()
    Progress(10, stream=quiet, bar=False).update(1, 0, 1.0, 1.0, 1.0, 1.0)
    assert quiet.getvalue() == ""


def test_resume_forgets_metrics_of_updates_it_will_redo(tmp_path):
    from aiayn.training.metrics import MetricsLog

    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.write({"kind": "train", "step": step, "loss": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"kind": "tra')  # torn by a kill
    assert log.drop_after(3) == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def reversal_valid_set(n_pairs=16, seed=7):
    pairs = reverse_pairs(n_pairs, LENGTH, 64, seed=seed)
    return ValidSet(
        ListCorpus(pairs),
        ListCorpus(pairs).src_lengths,
        references=[" ".join(map(str, t)) for _, t in pairs],
        detokenize=lambda ids: " ".join(map(str, ids)),
    )


def test_a_restart_forgets_the_records_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    config = tiny_config("train.max_steps=4", "train.log_interval=1")
    make_trainer(tmp_path, config).train()
    shutil.rmtree(tmp_path / loading.CHECKPOINT_DIR)  # as if killed before the first save
    make_trainer(tmp_path, config).train()  # starts again from update 0
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_running_a_finished_run_again_records_its_average_once(tmp_path, capsys):
    config = tiny_config(
        "train.max_steps=4",
        "train.valid_interval=2",
        "train.save_interval_steps=2",
        "train.average_last=3",  # only two checkpoints exist
        f"train.update_tokens={TOKENS_PER_BATCH}",
    )
    valid = reversal_valid_set()
    train_and_average(make_trainer(tmp_path, config, valid=valid))
    err = capsys.readouterr().err
    assert "only 2 checkpoint(s) available" in err
    assert "averaged last 2: " in err and "averaged last 3" not in err
    before = read_metrics(tmp_path)
    again = make_trainer(tmp_path, config, valid=valid)
    again.load_state_dict(loading.latest_valid_checkpoint(tmp_path)[1])
    assert train_and_average(again).step == 4
    after = read_metrics(tmp_path)
    assert [(r["kind"], r["step"]) for r in after] == [(r["kind"], r["step"]) for r in before]
    assert [r["kind"] for r in after].count("averaged") == 1


def test_eta_counts_the_updates_done_since_the_clock_started(tmp_path, capsys, monkeypatch):
    from aiayn.training import metrics

    now = [0.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def run(trainer, setup_seconds):
        update = trainer._update

        def one_second_update():
            now[0] += 1.0
            return update()

        trainer._update = one_second_update
        now[0] += setup_seconds  # loading data and the checkpoint: not training
        capsys.readouterr()
        trainer.train()
        return re.findall(r" (\d+)/\d+ .* eta (\d+:\d\d:\d\d)", capsys.readouterr().err)

    # One second per update: after update 2 of 4, two more take 0:00:02.
    first = make_trainer(
        tmp_path, tiny_config("train.max_steps=4", "train.log_interval=2"), show_progress=True
    )
    assert run(first, setup_seconds=60.0) == [("2", "0:00:02"), ("4", "0:00:00")]
    config = tiny_config("train.max_steps=8", "train.log_interval=2")
    resumed = make_trainer(tmp_path, config, show_progress=True)
    resumed.load_state_dict(loading.latest_valid_checkpoint(tmp_path)[1])
    assert run(resumed, setup_seconds=60.0) == [("6", "0:00:02"), ("8", "0:00:00")]


def test_bf16_on_the_cpu_takes_the_fused_loss_as_close_to_fp32_as_autocast_is(tmp_path):
    # train.precision=bf16 on the CPU: the model under bfloat16 autocast, the projection and
    # loss fused with bfloat16 products. Its gradient differs from the fp32 one as much as
    # plain autocast's does (projection under autocast, then the loss): by bfloat16's
    # 8-bit mantissa, a few percent of each parameter's gradient norm here.
    over = ["model.dropout=0", "train.lr_scale=0", f"train.update_tokens={2 * TOKENS_PER_BATCH}"]
    fp32 = make_trainer(tmp_path / "fp32", tiny_config(*over))
    fp32._update()
    errors = {}
    for fused in (True, False):
        bf16 = make_trainer(tmp_path / f"bf16-{fused}", tiny_config(*over, "train.precision=bf16"))
        assert bf16._fused_loss and bf16._loss_dtype == torch.bfloat16
        bf16._fused_loss = fused
        bf16.model.load_state_dict(fp32.model.state_dict())
        bf16._update()
        errors[fused] = []
        for a, b in zip(fp32.model.parameters(), bf16.model.parameters(), strict=True):
            assert b.grad.dtype == torch.float32
            errors[fused].append(float((b.grad - a.grad).norm() / a.grad.norm()))
    assert max(errors[False]) < 0.1  # the reference itself is close
    assert max(errors[True]) < 1.2 * max(errors[False])
    assert sum(errors[True]) < 1.2 * sum(errors[False])
