"""The load tool against a real ``aiayn serve``: a short run with bad input alongside (every
good request answered, every bad one refused, the server still healthy, exit 0), and its
verdicts on runs that went wrong."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from benchmarks import serving_load

from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_short_load_run_with_bad_input(reverse_checkpoint: Path, tmp_path: Path, monkeypatch):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("alpha bravo\ncharlie delta echo\n\nfoxtrot\n", encoding="utf-8")
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "load.json"
    code = serving_load.main(
        [
            str(reverse_checkpoint),
            "--sentences",
            str(sentences),
            "--clients",
            "4",
            "--seconds",
            "1",
            "--bad-input-clients",
            "4",
            "--per-kind",
            "1",
            "--body-timeout",
            "0.5",
            "--serve-option=--threads",
            "--serve-option=1",
            "--no-unbatched",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert code == 0, report["problems"]
    modes = [(p["mode"], p["clients"]) for p in report["phases"]]
    assert modes == [("batching", 4), ("batching + bad input", 4)]
    for phase in report["phases"]:
        assert phase["errors"] == 0 and phase["sentences"] == phase["requests"] > 0
        assert phase["statuses"] == {"200": phase["requests"]}
        assert phase["p50_ms"] <= phase["p99_ms"] and phase["peak_rss_mib"] > 50
    assert report["exit_statuses"] == [0]
    assert set(report["bad_input"]) == set(serving_load.ATTACKS)
    for kind, answers in report["bad_input"].items():
        assert answers and set(answers) <= serving_load.EXPECTED[kind], (kind, answers)
    assert "cores" in report["cpu"]


def test_the_verdicts_name_what_went_wrong():
    good = serving_load.Phase("batching", 8, seconds=1.0, sentences=10, requests=10)
    good.statuses["200"] = 10
    lost = serving_load.Phase("batching", 8, seconds=1.0, sentences=9, requests=10, errors=1)
    lost.statuses.update({"200": 9, "503": 1})
    assert serving_load.check([good], {}, [0]) == []
    problems = serving_load.check(
        [good, lost],
        {"truncated JSON": Counter({"400": 3, "500": 1}), "slow body": Counter()},
        [0, -15],
    )
    assert problems == [
        "batching, 8 clients: 10 requests, 9 translated, answers {'200': 9, '503': 1}",
        "bad input 'truncated JSON': unexpected outcomes {'500': 1}",
        "bad input 'slow body': unexpected outcomes none ran",
        "the server exited with status -15",
    ]


def test_percentiles_are_nearest_rank():
    phase = serving_load.Phase("batching", 1, latencies=[i / 1000 for i in range(1, 101)])
    assert phase.percentile_ms(50) == pytest.approx(50)
    assert phase.percentile_ms(99) == pytest.approx(99)
    assert phase.percentile_ms(99.5) == pytest.approx(100)
    assert serving_load.Phase("batching", 1, latencies=[0.25]).percentile_ms(99) == 250
