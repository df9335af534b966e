"""The paired benchmark: turns in a rotating order, and ratios taken pair by pair."""

from __future__ import annotations

import itertools
import json

import pytest
from benchmarks.common import host_slug
from benchmarks.paired_decode import paired_figure, peers, render, take_turns, write


def run_of(figure: dict, instructions: list[str]) -> dict:
    """A paired run of one figure, SMALL's greedy batch, as ``main`` records it."""
    return {
        "date": "2026-11-29", "time": "04:00", "cpu": "Some CPU", "instructions": instructions,
        "threads": 2, "commit": "abc1234", "minutes": 3.0,
        "versions": {"ctranslate2": "4.8.5", "torch": "2.13.0"},
        "workloads": {"small": {"greedy-batch": figure}},
    }  # fmt: skip


def test_each_system_runs_once_a_turn_first_and_last_alike():
    order: list[str] = []

    def system(name: str, seconds: float):
        def call(turn: int) -> float:
            order.append(name)
            return seconds + turn

        return call

    names = ["aiayn", "ct2-float32", "ct2-float32-1thread"]
    times = take_turns({n: system(n, float(i)) for i, n in enumerate(names)}, 6)
    assert times == {n: [float(i + t) for t in range(6)] for i, n in enumerate(names)}
    turns = [order[i : i + 3] for i in range(0, 18, 3)]
    assert all(sorted(turn) == sorted(names) for turn in turns)
    assert sorted(turn[0] for turn in turns) == sorted(names * 2)  # each first twice
    assert sorted(turn[-1] for turn in turns) == sorted(names * 2)  # and last twice
    # Each system runs right after each other one at least once.
    follows = {(a, b) for turn in turns for a, b in itertools.pairwise(turn)}
    assert follows == {(a, b) for a in names for b in names if a != b}


def test_the_ratio_is_taken_pair_by_pair_so_a_drifting_host_cancels():
    drift = [1.0, 1.6, 0.9, 2.0, 1.2]  # the host's speed, turn by turn
    times = {
        "aiayn": [0.40 * d for d in drift],
        "ct2-float32": [0.32 * d for d in drift],  # the faster CTranslate2 setting
        "ct2-float32-1thread": [0.50 * d for d in drift],
    }
    batch = paired_figure(times, batch=True, rows=64)
    assert batch["best_peer"] == "ct2-float32"
    assert batch["ratio"]["min"] == pytest.approx(0.8) == batch["ratio"]["max"]
    assert batch["figures"]["aiayn"] == pytest.approx(64 / (0.40 * 1.2))  # the median time
    assert batch["goal_met"] is False  # 0.8× the throughput
    single = paired_figure(times, batch=False, rows=1)
    assert single["ratio"]["median"] == pytest.approx(1.25)  # 1.25× the latency
    assert single["goal_met"] is True  # within 1.5×
    # Medians taken apart would not cancel the drift: the same times in another order.
    shuffled = dict(times, aiayn=sorted(times["aiayn"]))
    assert paired_figure(shuffled, batch=True, rows=64)["ratio"]["min"] < 0.6


def test_the_table_names_the_run_and_each_figures_spread():
    times = {"aiayn": [0.5, 0.6, 0.55], "ct2-float32": [0.6] * 3, "ct2-float32-1thread": [1.0] * 3}
    figure = paired_figure(times, batch=True, rows=64)
    table = render(run_of(figure, ["avx2"]))
    assert "Some CPU (avx2; 2 threads), the code of abc1234" in table
    row = next(line for line in table.splitlines() if line.startswith("| SMALL"))
    assert "| 116.4 | 106.7, 2 threads | 1.09× (1.05–1.15; 1.00–1.20) | 3 | met |" in row


def test_a_written_run_is_its_host_s_file_and_its_json_reads_back(tmp_path):
    times = {"aiayn": [0.5, 0.6, 0.55], "ct2-float32": [0.6] * 3, "ct2-float32-1thread": [1.0] * 3}
    run = run_of(paired_figure(times, batch=True, rows=64), ["avx2"])
    path = write(run, tmp_path)
    assert path == tmp_path / f"paired-{host_slug()}.md"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.with_suffix(".json").name, path.name]
    assert render(run) in path.read_text(encoding="utf-8")
    # The JSON keeps what the table shows (its floats to 6 significant digits).
    assert render(json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))) == render(run)


def test_ctranslate2_limited_to_avx2_takes_turns_only_where_the_cpu_has_avx512():
    assert peers(["avx2", "fma"]) == ["ct2-float32", "ct2-float32-1thread"]
    assert peers(["avx2", "fma", "avx512f"])[-1] == "ct2-float32-avx2"
    times = {
        "aiayn": [0.5, 0.6, 0.55],
        "ct2-float32": [0.7] * 3,
        "ct2-float32-1thread": [1.0] * 3,
        "ct2-float32-avx2": [0.6] * 3,  # the faster setting: the ratio is taken against it
    }
    figure = paired_figure(times, batch=True, rows=64)
    assert figure["best_peer"] == "ct2-float32-avx2"
    table = render(run_of(figure, ["avx512f"]))
    row = next(line for line in table.splitlines() if line.startswith("| SMALL"))
    assert "| 106.7, 2 threads, oneDNN limited to AVX2 | 1.09×" in row
