"""The one list of levers (aiayn.accel.levers): what accelerate() reports is named there, and
each lever can be left out by name (``disable``), and then is not applied."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from aiayn.accel import Acceleration, accelerate, cpu_has_bfloat16, memory, use_compiled_step
from aiayn.accel.levers import BY_NAME, LEVERS, NAMES, disabled_levers, markdown_table
from aiayn.accel.linear import onednn_packing_available
from aiayn.config import ModelConfig
from aiayn.inference.loading import assign_weights
from aiayn.model.transformer import Transformer
from tests.helpers import write_to_disk

pytestmark = pytest.mark.usefixtures("amd_cpu", "single_thread")


def _model(train: bool = False) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_layers=1)
    return Transformer(config).train(train)


def _mapped(folder: Path) -> Transformer:
    """The model with its weights mapped from a file, as Translator maps a checkpoint."""
    model = _model()
    path = folder / "weights.pt"
    if not path.is_file():
        write_to_disk(path, model.state_dict())
    assign_weights(model, torch.load(path, mmap=True, weights_only=True))
    return model


# (name, a fresh model, accelerate's keywords): the cases whose levers are compared
Case = tuple[str, Callable[[Path], Transformer], dict[str, object]]
CASES: list[Case] = [
    ("train", lambda _: _model(True), {"mode": "train", "process_settings": True}),
    ("decode", _mapped, {"mode": "decode", "process_settings": True}),
]
if onednn_packing_available() and cpu_has_bfloat16():
    CASES += [
        ("train bf16", lambda _: _model(True), {"mode": "train", "precision": "bf16"}),
        (
            "decode bf16",
            lambda folder: _mapped(folder).to(torch.bfloat16),
            {"mode": "decode", "precision": "bf16"},
        ),
    ]


def _levers(case: Case, folder: Path, disable: frozenset[str] = frozenset()) -> list[str]:
    _, build, keywords = case
    acceleration = accelerate(build(folder), disable=disable, **keywords)  # type: ignore[arg-type]
    try:
        return list(acceleration.levers)
    finally:
        acceleration.undo()


def test_the_list_names_each_lever_once_with_all_it_says() -> None:
    assert len(set(NAMES)) == len(LEVERS) == len(BY_NAME)
    for lever in LEVERS:
        assert lever.name and lever.mode and lever.applies and lever.swaps and lever.undone
        assert set(lever.mode.split(", ")) <= {"train", "decode"}
        assert set(lever.needs) <= set(NAMES)
    assert {lever.name for lever in LEVERS if lever.process} == {"malloc thresholds"}
    table = markdown_table().splitlines()
    assert len(table) == 2 + len(LEVERS) and all(row.count("|") == 6 for row in table)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_each_lever_reported_is_listed_and_can_be_left_out(case: Case, tmp_path: Path) -> None:
    if memory._glibc() is None:
        pytest.skip("the process levers need glibc")
    everything = _levers(case, tmp_path)
    assert everything and set(everything) <= set(NAMES)
    for name in everything:
        left_out = disabled_levers({name})
        without = _levers(case, tmp_path, frozenset({name}))
        assert name not in without
        # The others stay, but for those that had it to work on (the pages of weights that
        # packs replace: without packs, none).
        assert set(without) <= set(everything) - left_out, name
        assert without == [lever for lever in everything if lever in without]


def test_the_levers_that_need_another_go_with_it() -> None:
    assert "compiled decoder step" in disabled_levers({"one buffer per decode"})
    # and what needs what needs it
    assert "aiayn's AVX2 panels" in disabled_levers({"one buffer per decode"})
    assert "aiayn's AVX2 panels" in disabled_levers({"packed weights"})
    assert disabled_levers("grid dropout") == {"grid dropout"}  # one name, not its letters


def test_an_unknown_lever_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'packed weight'.*'packed weights'"):
        accelerate(_model(), "decode", disable={"packed weight"})


def test_a_compiled_step_left_out_is_not_loaded() -> None:
    model = _model()
    acceleration = accelerate(model, "decode", disable={"compiled decoder step"})
    said: list[str] = []
    assert use_compiled_step(model, acceleration, True, said.append) is None
    assert not said and "compiled decoder step" not in acceleration.levers
    # aiayn's AVX2 product is loaded by the compiled step's loader: its levers go with it,
    # as the reading of the steps' weights in place does.
    assert isinstance(acceleration, Acceleration) and acceleration.disabled == {
        "compiled decoder step",
        "compiled weights read in place",
        "encoder attention by aiayn's kernel",
        "aiayn's AVX2 panels",
    }
