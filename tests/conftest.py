"""Fixtures shared by the whole suite; plain helpers live in tests/helpers.py."""

import os

import pytest
import torch

from aiayn import native
from aiayn.accel import panels
from aiayn.data.sources.bible import write_bible_corpus
from tests.helpers import BIBLE_MISSING, make_reverse_data

# The suite's models are tiny: on one thread they run several times faster than on two, above
# all on a shared CPU (tests/model and tests/inference: less than half the CPU time). A test
# that needs more threads sets them and puts them back. The processes the tests start run on
# one thread too: a compiled step's key names the thread count it was compiled for.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def single_thread():
    """One thread for the test, whatever the thread count before it (the suite's is one)
    (``pytestmark = pytest.mark.usefixtures("single_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bible_cache(tmp_path_factory):
    """A cache directory holding the embedded Bible corpus text (``bible/``), built once from
    the SWORD modules that scripts/setup_env.sh installs."""

    if BIBLE_MISSING:
        pytest.skip(BIBLE_MISSING)
    root = tmp_path_factory.mktemp("bible")
    write_bible_corpus(root / "bible")
    return root


@pytest.fixture(scope="session")
def reverse_data_dir(tmp_path_factory):
    """A prepared data directory (aiayn prepare) of the word-reversal task, built once."""
    return make_reverse_data(tmp_path_factory.mktemp("reverse"))


@pytest.fixture
def intel_cpu(monkeypatch):
    """The CPU reads as Intel's: float32 weights are packed for MKL, and only on request."""
    from aiayn.accel import linear

    monkeypatch.setattr(linear, "cpu_vendor", lambda: "GenuineIntel")


@pytest.fixture
def amd_cpu(monkeypatch):
    """The CPU reads as AMD's: float32 weights are packed for oneDNN, by default."""
    from aiayn.accel import linear

    monkeypatch.setattr(linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(linear.platform, "machine", lambda: "x86_64")


_PANELS_BUILT: list = []  # the panels' product, built once for the session


def panel_library_copy(path):
    """Put the panels' product (aiayn.accel.panels) at ``path``: a copy of the session's one
    build (20 s), made at the first call."""
    import shutil
    import tempfile
    from pathlib import Path

    if not _PANELS_BUILT:
        folder = Path(tempfile.mkdtemp(prefix="aiayn-panels-"))
        _REAL_BUILD(folder / path.name)
        _PANELS_BUILT.append(folder / path.name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(_PANELS_BUILT[0], path)
    path.chmod(0o700)
    assert path.name == panels.library_path(path.parent).name


_REAL_BUILD = panels._build
panel_library_copy.real = _REAL_BUILD  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _panels_per_test(monkeypatch):
    """Each test starts without the panels' product in use, and leaves it so; a build a test
    asks for (``translate --compiled-step`` builds it beside the step) copies the session's
    one build instead of compiling it again (:func:`panel_library_copy`)."""
    monkeypatch.setattr(panels, "_loaded", None)
    # greedy's choice by the kernel only where a test loads the file (which registers it)
    monkeypatch.setattr(native, "_first_argmax", None)
    monkeypatch.setattr(panels, "_build", panel_library_copy)
