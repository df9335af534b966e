"""The package's layers point one way (the import-linter contracts in pyproject.toml): the
model imports only the config; data never imports the model; inference never imports
training; serving never imports training; search never imports the model; cli >
demo | serving | interop > training > inference > accel > model | data | evaluation >
config | devices | progress; and inside accel, decoding > compiled > attention | loss >
linear > panels | library_constants > cpu | memory | store | levers | dropout."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT


def test_the_layers_point_one_way(capsys: pytest.CaptureFixture[str]) -> None:
    cli = pytest.importorskip("importlinter.cli", reason="import-linter is not installed")
    code = cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report and "7 kept" in report
