"""The CUDA paths: training in fp32, bf16 and fp16 (GradScaler), ``compile = true``, resume,
torchrun on ``cuda:LOCAL_RANK``, translation at each precision, and the other model families.
Skipped, with the reason printed, on a machine without CUDA."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.inference import loading
from tests.helpers import ROOT, TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

QUIET = ["--no-progress", "train.log_interval=50"]


def _train(data_dir, run: Path, *overrides: str) -> list[dict]:
    args = ["train", "--config", TINY, "--data", str(data_dir), "--out", str(run)]
    assert main([*args, "--device", "cuda", *QUIET, *overrides]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _exact_match(run: Path, data_dir: Path, **options) -> float:
    from aiayn.inference.translator import Translator

    translator, _ = Translator.from_checkpoint(run, **options)
    sources = (data_dir / "valid.src").read_text().splitlines()
    references = (data_dir / "valid.tgt").read_text().splitlines()
    hypotheses = translator.translate(sources)
    return sum(h == r for h, r in zip(hypotheses, references, strict=True)) / len(references)


@pytest.fixture(scope="module")
def fp32_run(reverse_data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("cuda") / "fp32"
    _train(reverse_data_dir, run)
    return run


def test_fp32_training_on_cuda_learns_and_its_checkpoint_loads_on_the_cpu(
    fp32_run, reverse_data_dir, capsys
):
    state = loading.load_checkpoint(fp32_run / "averaged.pt")
    assert all(v.device.type == "cpu" for v in state["model"].values())
    assert _exact_match(fp32_run, reverse_data_dir, device="cpu") >= 0.9
    assert _exact_match(fp32_run, reverse_data_dir, device="cuda") >= 0.9


def test_translation_on_cuda_equals_the_cpu_in_fp32(fp32_run, reverse_data_dir):
    from aiayn.inference.translator import Translator

    sources = (reverse_data_dir / "valid.src").read_text().splitlines()
    for beam in (1, 4):
        translators = {
            device: Translator.from_checkpoint(
                fp32_run, device=device, decode_overrides={"beam_size": beam}
            )[0]
            for device in ("cpu", "cuda")
        }
        # The CPU's levers: not applied on CUDA, and said so.
        assert [t.engine_details()["accelerated"] for t in translators.values()] == [True, False]
        out = {device: t.translate(sources) for device, t in translators.items()}
        same = sum(a == b for a, b in zip(out["cpu"], out["cuda"], strict=True))
        assert same >= len(sources) - 1, (beam, same)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_translation_on_cuda_at_lower_precision(fp32_run, reverse_data_dir, precision):
    assert _exact_match(fp32_run, reverse_data_dir, device="cuda", precision=precision) >= 0.9


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_decoding_never_runs_cudnn_attention(fp32_run, reverse_data_dir, precision):
    """cuDNN's attention plans every new shape, and decoding meets one at every step: on an
    H200 it made the first bf16 translation of Multi30k val 20 times slower than fp32."""
    from torch.profiler import ProfilerActivity, profile

    from aiayn.inference.translator import Translator

    sources = (reverse_data_dir / "valid.src").read_text().splitlines()[:20]
    translator, _ = Translator.from_checkpoint(fp32_run, device="cuda", precision=precision)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        translator.translate(sources)
    names = {event.key for event in prof.key_averages()}
    assert any("scaled_dot_product" in name for name in names), sorted(names)
    assert not any("cudnn_attention" in name for name in names)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_on_cuda_learns(reverse_data_dir, tmp_path, precision, capsys):
    records = _train(reverse_data_dir, tmp_path / precision, f"train.precision={precision}")
    out = capsys.readouterr().out
    assert "reached train.max_steps=500" in out
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < losses[0] / 3
    state = loading.load_checkpoint(tmp_path / precision / "averaged.pt")
    assert all(v.dtype == torch.float32 for v in state["model"].values() if v.is_floating_point())
    assert _exact_match(tmp_path / precision, reverse_data_dir, device="cuda") >= 0.9


def test_compiled_training_on_cuda_matches_eager(reverse_data_dir, tmp_path):
    short = ["train.max_steps=30", "train.valid_interval=0", "model.dropout=0"]
    short.append("train.log_interval=1")
    eager = _train(reverse_data_dir, tmp_path / "eager", *short)
    compiled = _train(reverse_data_dir, tmp_path / "compiled", *short, "train.compile=true")
    a = [r["loss"] for r in eager if r["kind"] == "train"]
    b = [r["loss"] for r in compiled if r["kind"] == "train"]
    assert len(a) == len(b) == 30
    assert max(abs(x - y) / x for x, y in zip(a, b, strict=True)) < 1e-3


def test_a_cuda_run_resumes_where_it_stopped(reverse_data_dir, tmp_path):
    over = ["train.valid_interval=0", "train.log_interval=1", "train.save_interval_steps=20"]
    straight = _train(reverse_data_dir, tmp_path / "a", "train.max_steps=40", *over)
    _train(reverse_data_dir, tmp_path / "b", "train.max_steps=20", *over)
    resumed = _train(reverse_data_dir, tmp_path / "b", "train.max_steps=40", *over)
    a = {r["step"]: r["loss"] for r in straight if r["kind"] == "train"}
    b = {r["step"]: r["loss"] for r in resumed if r["kind"] == "train"}
    assert set(range(21, 41)) <= b.keys()
    # Dropout masks come from the restored CUDA generator: the same losses, up to the
    # non-deterministic order of CUDA's atomic additions in the backward pass.
    assert max(abs(a[s] - b[s]) / a[s] for s in range(21, 41)) < 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_torchrun_places_its_process_on_cuda(reverse_data_dir, tmp_path):
    """One process: no process group, so not NCCL (two ranks need two GPUs)."""
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(_free_port()), "-m", "aiayn",
        "train", "--config", TINY, "--data", str(reverse_data_dir), "--out", str(run),
        "--no-progress", "train.max_steps=6", "train.valid_interval=3",
        "train.save_interval_steps=3",
    ]  # fmt: skip
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "on 1 × cuda" in result.stderr + result.stdout
    assert (run / "averaged.pt").is_file()


@pytest.mark.parametrize("arch", ["bahdanau", "luong"])
def test_rnn_baselines_train_and_translate_on_cuda(reverse_data_dir, tmp_path, arch):
    run = tmp_path / arch
    over = ["train.max_steps=60", "train.log_interval=10"]
    records = _train(reverse_data_dir, run, f"model.arch={arch}", *over)
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    from aiayn.inference.translator import Translator

    sources = (reverse_data_dir / "valid.src").read_text().splitlines()
    out = [Translator.from_checkpoint(run, device=d)[0].translate(sources) for d in ("cpu", "cuda")]
    assert sum(a == b for a, b in zip(*out, strict=True)) >= len(sources) - 1


@pytest.mark.parametrize(
    ("encoder", "decoder"), [("local", "local"), ("longformer", "full"), ("linformer", "full")]
)
def test_efficient_attention_on_cuda_equals_the_cpu(encoder, decoder):
    from aiayn.config import load_config
    from aiayn.model.families import build_model

    config = load_config(
        overrides=[
            "preset=tiny",
            f"model.encoder_attention={encoder}",
            f"model.decoder_attention={decoder}",
        ]
    )
    model = build_model(config.model).eval()
    src = torch.randint(4, config.model.vocab_size, (3, 40))
    src_pad = torch.zeros_like(src, dtype=torch.bool)
    src_pad[0, 30:] = True
    tgt = torch.randint(4, config.model.vocab_size, (3, 12))
    with torch.no_grad():
        cpu = model(src, src_pad, tgt)
        gpu = model.cuda()(src.cuda(), src_pad.cuda(), tgt.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)
