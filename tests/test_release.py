"""The version is stated once for users: pyproject.toml, ``aiayn --version`` and the CHANGELOG
agree."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import aiayn
from aiayn.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_package_version_is_pyprojects() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert aiayn.__version__ == project["version"]


def test_cli_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"aiayn {aiayn.__version__}"


def test_changelog_has_unreleased_then_this_version_first() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert headings[0] == "Unreleased"
    released = re.match(r"(\d+\.\d+\.\d+) — \d{4}-\d{2}-\d{2}$", headings[1])
    assert released is not None, headings[1]
    assert released.group(1) == aiayn.__version__
