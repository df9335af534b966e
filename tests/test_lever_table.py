"""The lever table's format (benchmarks/lever_table.py, the format docs/performance.md points
at) from made-up measurements, and the host's slug."""

from __future__ import annotations

from typing import Any

from benchmarks.lever_table import (
    FIGURES,
    cell,
    earns,
    lever_rows,
    render,
)

from aiayn.accel.levers import NAMES


def _run(figures: dict[str, float], rss: float, levers: list[str]) -> dict[str, Any]:
    return {"figures": figures, "rss": rss, "levers": levers}


DECODE = {"beam-batch": 100.0, "greedy-batch": 300.0, "beam-single": 40.0, "greedy-single": 30.0}


def _runs() -> dict[str, Any]:
    """Two rounds: grid dropout applies to both (decoding 10% faster with it), fused loss
    only to training (1.5× with it, and a third less training RSS), a third lever nowhere."""
    train_on = ["grid dropout", "fused projection + loss"]
    decode_on = ["grid dropout"]
    train = {
        "on": [_run({"train": 3000.0}, 600, train_on), _run({"train": 3100.0}, 600, train_on)],
        "grid dropout": [_run({"train": 2950.0}, 600, []), _run({"train": 3100.0}, 600, [])],
        "fused projection + loss": [
            _run({"train": 2000.0}, 900, []),
            _run({"train": 2000.0}, 900, []),
        ],
    }
    slower = {k: v / 1.1 if k.endswith("batch") else v * 1.1 for k, v in DECODE.items()}
    decode = {
        "on": [_run(DECODE, 300, decode_on)] * 2,
        "grid dropout": [_run(slower, 300, [])] * 2,
    }
    return {"small": {"train": train, "decode": decode}}


WANTED = ["grid dropout", "fused projection + loss", "malloc thresholds"]


def test_rows_give_on_off_ratios_and_whether_each_lever_earns_its_place() -> None:
    rows = {row["lever"]: row for row in lever_rows(_runs(), WANTED)["small"]}
    dropout = rows["grid dropout"]["cells"]
    assert [round(r, 4) for r in dropout["train"]] == [round(3000 / 2950, 4), 1.0]
    assert [round(r, 2) for r in dropout["beam-batch"]] == [1.1, 1.1]  # throughput: on/off
    assert [round(r, 2) for r in dropout["greedy-single"]] == [1.1, 1.1]  # latency: off/on
    assert dropout["rss"] == [1.0, 1.0]  # the decoding process's
    assert rows["grid dropout"]["earns"] is True
    fused = rows["fused projection + loss"]
    assert fused["cells"]["beam-batch"] is None and fused["cells"]["rss"] == [1.5, 1.5]
    assert rows["malloc thresholds"]["earns"] is None  # applies to nothing measured
    assert earns({"train": [1.03, 1.05], "rss": [1.2]}) is False  # 4%, and RSS not above 20%
    assert earns({"train": [1.04, 1.06]}) is True  # a median of 5%
    assert earns({"train": None, "rss": [1.21]}) is True  # memory alone: above 20%


def test_the_markdown_is_the_agreed_table() -> None:
    report = {
        "header": {
            "cpu": "Some CPU",
            "host": "some-cpu",
            "torch": "2.9.0",
            "rounds": 2,
            "date": "2026-12-07",
            "quick": False,
        },
        "rows": lever_rows(_runs(), WANTED),
        "baseline": {"small": "training 3,050 target tokens/s"},
    }
    lines = render(report).splitlines()
    assert lines[0].startswith("Lever table on Some CPU (some-cpu), PyTorch 2.9.0, 2 ")
    assert "2026-12-07" in lines[0] and "QUICK" not in lines[0]
    at = lines.index("### SMALL")
    assert lines[at + 2] == (
        "| lever | mode | training tokens/s | beam 4, batch 64 | greedy, batch 64 | "
        "beam 4, one sentence | greedy, one sentence | peak RSS | earns its place |"
    )
    assert lines[at + 3] == "|---|---|" + "---:|" * (len(FIGURES) - 1) + "---|"  # no bf16
    assert lines[at + 4] == (
        "| grid dropout | train, decode | 1.01× (1.00–1.02) | 1.10× (1.10–1.10) | "
        "1.10× (1.10–1.10) | 1.10× (1.10–1.10) | 1.10× (1.10–1.10) | 1.00× (1.00–1.00) | yes |"
    )
    assert lines[at + 5] == (
        "| fused projection + loss | train | 1.52× (1.50–1.55) | — | — | — | — | "
        "1.50× (1.50–1.50) | yes |"
    )
    assert lines[at + 6].startswith("| malloc thresholds | train, decode | — |")
    assert lines[at + 6].endswith("| — | — |")
    quick = render({**report, "header": {**report["header"], "quick": True}})
    assert "QUICK" in quick.splitlines()[0]
    assert cell(None) == "—" and cell([1.0, 1.2, 1.1]) == "1.10× (1.00–1.20)"


def test_every_lever_can_be_named() -> None:
    rows = lever_rows(_runs(), list(NAMES))["small"]
    assert [row["lever"] for row in rows] == list(NAMES)


def test_a_bf16_training_run_adds_its_column_and_judges_the_bf16_levers() -> None:
    """Where the host trains in bfloat16 too, its figure is a column; a lever only bfloat16
    uses is judged by it, its RSS the bf16 training process's."""
    runs = _runs()
    on = ["grid dropout", "attention in float32"]
    runs["small"]["train-bf16"] = {
        "on": [_run({"train-bf16": 5000.0}, 500, on)] * 2,
        "grid dropout": [_run({"train-bf16": 5000.0}, 500, [])] * 2,
        "attention in float32": [_run({"train-bf16": 4000.0}, 550, [])] * 2,
    }
    wanted = ["grid dropout", "attention in float32", "fused projection + loss"]
    rows = {row["lever"]: row for row in lever_rows(runs, wanted)["small"]}
    attention = rows["attention in float32"]
    assert attention["cells"]["train-bf16"] == [1.25, 1.25] and attention["earns"] is True
    assert attention["cells"]["train"] is None and attention["cells"]["beam-batch"] is None
    assert attention["cells"]["rss"] == [1.1, 1.1]
    assert rows["grid dropout"]["cells"]["train-bf16"] == [1.0, 1.0]
    assert rows["fused projection + loss"]["cells"]["train-bf16"] is None  # not applied there
    report = {
        "header": {
            "cpu": "C",
            "host": "c",
            "torch": "2.13",
            "rounds": 2,
            "date": "d",
            "quick": False,
        },
        "rows": lever_rows(runs, wanted),
    }
    lines = render(report).splitlines()
    at = lines.index("### SMALL")
    assert lines[at + 2].startswith(
        "| lever | mode | training tokens/s | training tokens/s, bf16 |"
    )
    assert lines[at + 3] == "|---|---|" + "---:|" * len(FIGURES) + "---|"
    assert lines[at + 5].startswith(
        "| attention in float32 | train, decode | — | 1.25× (1.25–1.25) |"
    )


def test_training_batches_vary_in_shape_and_keep_the_workloads_tokens() -> None:
    from benchmarks.common import SMALL, training_batches

    batches = training_batches(SMALL, 12)
    shapes = {tuple(b.tgt_in.shape) for b in batches}
    assert len(shapes) > 6  # a real run's batches: rows a product has not met before
    tokens = SMALL.batch * SMALL.tgt_len
    for b in batches:
        assert b.tgt_in.shape == b.tgt_out.shape and b.src_ids.size(0) == b.tgt_in.size(0)
        assert tokens - b.tgt_in.size(1) < b.tgt_in.numel() <= tokens
    assert [b.tgt_in.shape for b in training_batches(SMALL, 12)] == [
        b.tgt_in.shape for b in batches
    ]
