"""The benchmark report: each decoding figure pooled over rounds, with the rounds' spread."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.common import INSTRUCTION_SETS, cpu_instructions, host_slug, json_text
from benchmarks.report import decoding_goals, decoding_table, render
from benchmarks.run_all import merge_decode, merge_train


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


def _all_modes(batch_s: float, single_s: float, rss: float) -> dict:
    modes = {
        mode: {"times_s": [batch_s] * 3, "median_s": batch_s, "sentences_per_s": 64 / batch_s}
        for mode in ("beam-batch", "greedy-batch")
    } | {
        mode: {"times_s": [single_s] * 3, "median_s": single_s, "latency_ms": 1000 * single_s}
        for mode in ("beam-single", "greedy-single")
    }
    return {"modes": modes, "peak_rss_mb": rss, "build_s": 1.0, "background_cpus": 0.0}


def test_base_decoding_has_its_table_and_goals_against_ct2_at_its_best_thread_count():
    loaded = _all_modes(2.0, 0.030, 900.0) | {"step_load_s": 0.4}
    base = {
        "aiayn": merge_decode([loaded, loaded]) | {"step_compile_s": 38.0},
        "ct2-float32": merge_decode([_all_modes(4.0, 0.040, 950.0)]),
        # CTranslate2 at 1 thread: the faster batches, the slower single sentences.
        "ct2-float32-1thread": merge_decode([_all_modes(1.0, 0.050, 800.0)]),
    }
    small = {"aiayn": merge_decode([_all_modes(1.0, 0.010, 300.0)])}
    text = render(
        {
            "meta": {
                "date": "d",
                "mode": "full",
                "wall_s": 60.0,
                "load_start": 0.0,
                "load_end": 0.0,
                "machine": {
                    "cpu": "c",
                    "logical_cpus": 2,
                    "threads": 2,
                    "cuda": False,
                    "python": "3",
                    "platform": "p",
                },
                "versions": {},
            },
            "decode": small,
            "decode_base": base,
            "matmul": {"gflops": 100.0},
        }
    )
    assert "### Decoding BASE (64 sentences" in text
    # The compiled step's time to compile and to load, counted apart from the figures.
    assert "compiled in 38 s (once, in a process of its own before the rounds), loaded in " \
        "0.40 s (in each timed process)" in text  # fmt: skip
    # CTranslate2's best: its 1-thread run for batches, its 2-thread run for one sentence.
    assert "- Decoding BASE beam-batch: ≥ CTranslate2 float32 (64.0 sent/s at 1 thread): " \
        "32.0 sent/s (0.50×) — **not met**" in text  # fmt: skip
    assert "- Decoding BASE greedy one at a time: ≤ 1.5× CTranslate2's latency (40.0 ms at " \
        "2 threads): 30.0 ms (0.75×) — met" in text  # fmt: skip
    # Memory is not a race: within 1.25× the leanest peer's peak RSS meets the goal.
    assert "- Decoding BASE memory: peak RSS ≤ 1.25× the leanest float32 peer's (800 MB): " \
        "900 MB (1.12×) — met" in text  # fmt: skip
    # Above 1.25× it is not met.
    heavy = loaded | {"peak_rss_mb": 1001.0}
    base["aiayn"] = merge_decode([heavy]) | {"step_compile_s": 38.0}
    lines = decoding_goals(base, "BASE ")
    assert "- Decoding BASE memory: peak RSS ≤ 1.25× the leanest float32 peer's (800 MB): " \
        "1,001 MB (1.25×) — **not met**" in lines  # fmt: skip


def test_the_goals_take_ct2s_oneDNN_at_avx2_where_it_is_the_fastest_setting():
    decode = {
        "aiayn": merge_decode([_all_modes(1.0, 0.020, 300.0)]),
        "ct2-float32": merge_decode([_all_modes(1.2, 0.015, 350.0)]),
        "ct2-float32-1thread": merge_decode([_all_modes(1.5, 0.030, 340.0)]),
        # Limited to AVX2: faster batches than aiayn's, slower single sentences.
        "ct2-float32-avx2": merge_decode([_all_modes(0.8, 0.016, 360.0)]),
    }
    lines = "\n".join(decoding_table(decode))
    assert "| CTranslate2 float32, oneDNN limited to AVX2 |" in lines
    text = render(
        {
            "meta": {
                "date": "d", "mode": "full", "wall_s": 60.0, "load_start": 0.0,
                "load_end": 0.0, "versions": {},
                "machine": {"cpu": "c", "logical_cpus": 2, "threads": 2, "cuda": False,
                            "python": "3", "platform": "p"},
            },
            "decode": decode,
            "matmul": {"gflops": 100.0},
        }
    )  # fmt: skip
    assert "- Decoding greedy-batch: ≥ CTranslate2 float32 (80.0 sent/s at 2 threads, " \
        "oneDNN AVX2): 64.0 sent/s (0.80×) — **not met**" in text  # fmt: skip
    assert "- Decoding greedy one at a time: ≤ 1.5× CTranslate2's latency (15.0 ms at " \
        "2 threads): 20.0 ms (1.33×) — met" in text  # fmt: skip


def test_an_isa_limit_reaches_every_child_and_the_avx2_row_its_setting(monkeypatch):
    from benchmarks import run_all

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert "ONEDNN_MAX_CPU_ISA" not in run_all.child_env("aiayn")
    assert run_all.child_env("ct2-float32-avx2")["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    monkeypatch.setattr(run_all, "ISA_LIMIT", dict(run_all.ISA_LIMITS["avx2"]))
    for system in ("aiayn", "ct2-float32", None):  # None: the ceiling, the compile
        env = run_all.child_env(system)
        assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
        assert env["TORCHINDUCTOR_CPP_MARCH"] == "x86-64-v3"


def test_peak_rss_is_the_process_own_not_its_parent_s() -> None:
    """A benchmark process started by a larger one reports its own peak: Linux's ``ru_maxrss``
    would carry the parent's (800 MB more here) into it."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux): elsewhere the peak is ru_maxrss")
    ballast = bytearray(800 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # every page resident
    child = "from benchmarks.common import peak_rss_mb; print(peak_rss_mb())"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, check=True, cwd=root
    )
    del ballast
    assert float(done.stdout) < 600.0  # importing torch: about 220 MB


@pytest.mark.parametrize(
    ("vendor", "model", "instructions", "family", "slug"),
    [
        ("GenuineIntel", "Intel(R) Xeon(R) Processor", ["avx2", "avx512f"], 6, "xeon"),
        ("AuthenticAMD", "AMD EPYC", ["avx2", "avx512f"], 25, "epyc-zen4"),
        ("AuthenticAMD", "AMD EPYC", ["avx2", "fma"], 25, "epyc-zen3"),
        ("AuthenticAMD", "AMD EPYC 7B12", ["avx2"], 23, "epyc-zen2"),
        ("AuthenticAMD", "AMD Ryzen 9 7950X 16-Core Processor", ["avx512f"], 25,
         "amd-ryzen-9-7950x-16-core"),
        ("", "", [], 0, "unknown"),
    ],
)  # fmt: skip
def test_each_host_has_a_short_name_for_its_result_files(vendor, model, instructions, family, slug):
    assert host_slug(vendor, model, instructions, family) == slug


def test_this_host_s_name_is_a_file_name():
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", host_slug())


def test_results_json_keeps_each_measurement_on_one_line_and_six_digits():
    result = {"modes": {"beam": {"rounds": [1.5] * 40, "median_s": 0.5}, "greedy": {}},
              "cpu": "c" * 120}  # fmt: skip
    text = json_text(result)
    assert json.loads(text) == result
    beam = '"beam": {"rounds": [' + ", ".join(["1.5"] * 40) + '], "median_s": 0.5},'
    assert beam in [line.strip() for line in text.splitlines()]
    assert len(text.splitlines()) == 7  # {, "modes": {, beam, greedy, }, "cpu", }
    assert json_text({"a": [1, 2]}) == '{"a": [1, 2]}\n'
    assert json.loads(json_text({"t": 0.48289264450431})) == {"t": 0.482893}


def test_merged_figures_keep_their_count_of_timings_not_the_timings():
    run = {"times_s": [0.5, 0.7, 0.6], "peak_rss_mb": 300.0, "build_s": 1.0,
           "background_cpus": 0.0}  # fmt: skip
    train = merge_train([run, run], "small")
    assert train["samples"] == 6 and train["median_s"] == 0.6 and "times_s" not in train
    decode = merge_decode([_round(0.5, 0.020), _round(0.8, 0.030)])
    assert decode["modes"]["greedy-single"]["samples"] == 10
    assert not any("times_s" in mode for mode in decode["modes"].values())
