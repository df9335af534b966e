"""Every committed result of a benchmark or experiment is what its script writes from the JSON
beside it: the Markdown can be regenerated, and the JSON holds what the report needs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from benchmarks import lever_table, paired_decode, report
from experiments import (
    comparison,
    constraints,
    ct2_export,
    ct2_nbest,
    families,
    hf_export,
    int8,
    long_attention,
    long_quality,
    marian_finetune,
    multi30k_recipe,
    score,
    table1,
)

ROOT = Path(__file__).resolve().parent.parent
RENDER: dict[str, Callable[[dict[str, Any]], str]] = {
    "bench-": report.render,
    "comparison": comparison._markdown,
    "constraints-": constraints.markdown,
    "ct2-export-": ct2_export.markdown,
    "ct2-nbest-": ct2_nbest.markdown,
    "families": families.report,
    "hf-export-": hf_export.markdown,
    "int8-": int8.markdown,
    "levers-": lever_table.render,
    "long-attention": long_attention.report,
    "long-quality": long_quality.report,
    "marian-finetune": marian_finetune.report,
    "multi30k-": multi30k_recipe._markdown,
    "score-": score.markdown,
    "table1": table1.report,
}
PAIRS = sorted(
    path
    for folder in ("benchmarks/results", "experiments/results")
    for path in (ROOT / folder).glob("*.json")
    if path.with_suffix(".md").exists()
)


def test_the_results_are_found():
    names = {path.stem for path in PAIRS}
    assert {"bench-epyc-zen4", "paired-epyc-zen4", "table1", "comparison"} <= names


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.stem)
def test_each_committed_markdown_is_its_json_rendered(path: Path):
    result = json.loads(path.read_text(encoding="utf-8"))
    markdown = path.with_suffix(".md").read_text(encoding="utf-8")
    if path.stem.startswith("paired-"):
        assert paired_decode.render(result) in markdown
        return
    [render] = [fn for prefix, fn in RENDER.items() if path.stem.startswith(prefix)]
    assert render(result) == markdown
