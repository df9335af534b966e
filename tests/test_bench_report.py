"""The benchmark report: each decoding figure pooled over rounds, with the rounds' spread."""

from __future__ import annotations

from benchmarks.common import INSTRUCTION_SETS, cpu_instructions
from benchmarks.report import decoding_table
from benchmarks.run_all import merge_decode


def _round(batch_s: float, single_s: float) -> dict:
    return {
        "modes": {
            "beam-batch": {"times_s": [batch_s] * 3, "median_s": batch_s,
                           "sentences_per_s": 64 / batch_s},
            "greedy-single": {"times_s": [single_s] * 5, "median_s": single_s},
        },
        "peak_rss_mb": 300.0, "build_s": 1.0, "background_cpus": 0.0,
    }  # fmt: skip


def test_decoding_figures_pool_the_rounds_and_show_their_spread():
    merged = merge_decode([_round(0.5, 0.020), _round(0.8, 0.030), _round(0.64, 0.025)])
    beam = merged["modes"]["beam-batch"]
    assert beam["sentences_per_s"] == 100.0  # 64 / the median of all timings, 0.64 s
    assert sorted(beam["rounds"]) == [80.0, 100.0, 128.0]
    assert merged["modes"]["greedy-single"]["rounds"] == [20.0, 30.0, 25.0]
    row = next(line for line in decoding_table({"aiayn": merged}) if line.startswith("| aiayn"))
    assert "| 100.0 (80.0–128.0) |" in row and "| 25.0 (20.0–30.0) |" in row


def test_the_instruction_sets_are_the_listed_ones_in_order():
    found = cpu_instructions()
    assert found == [name for name in INSTRUCTION_SETS if name in found]
