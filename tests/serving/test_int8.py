"""``--quantize int8`` is CTranslate2's int8: ``aiayn translate --quantize int8`` and ``aiayn
serve --quantize int8`` decode with CTranslate2's ``int8_float32`` compute type from the int8
export cached beside the checkpoint, as ``--engine ctranslate2 --quantize int8`` does, and as
the library's ``Ct2Translator.from_checkpoint(path, quantize="int8")`` does; the PyTorch engine
takes no int8 (torch.ao's dynamic quantization, deprecated, is gone from ``src/``); where
CTranslate2 is absent, ``--quantize int8`` stops in one line that says how to get it. The
model is the serving tests' word-reversal checkpoint (tests/serving/conftest.py)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.inference.translator import Translator
from tests.helpers import ROOT
from tests.serving.conftest import ServerProcess

pytestmark = pytest.mark.usefixtures("single_thread")

needs_ct2 = pytest.mark.skipif(
    importlib.util.find_spec("ctranslate2") is None,
    reason="CTranslate2 is not installed (pip install 'aiayn[interop]')",
)

TEXTS = ["alpha bravo charlie", "", "delta echo foxtrot golf hotel", "india", "juliet kilo"]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


def translate(
    capsys: pytest.CaptureFixture[str], checkpoint: Path, source: Path, *options: str
) -> tuple[list[str], str]:
    """The lines ``aiayn translate`` prints, and its stderr."""
    capsys.readouterr()
    args = ["translate", str(checkpoint), "-i", str(source), "--threads", "1", "--device", "cpu"]
    assert main([*args, *options]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    return captured.out.splitlines(), captured.err


@needs_ct2
def test_translate_quantize_int8_is_ctranslate2_int8(
    reverse_checkpoint: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aiayn.interop.ct2_translator import Ct2Translator

    out, err = translate(capsys, reverse_checkpoint, source, "--quantize", "int8", "--beam", "2")
    assert "on cpu (CTranslate2, int8_float32)" in err
    export = reverse_checkpoint.with_name(f"{reverse_checkpoint.stem}.ct2-int8")
    assert json.loads((export / "aiayn.json").read_text())["quantization"] == "int8"
    assert len(out) == len(TEXTS) and out[1] == "" and all(out[i] for i in (0, 2, 3, 4))
    # The same as naming the engine, and as the library's int8 translator.
    named, _ = translate(
        capsys, reverse_checkpoint, source, "--quantize", "int8", "--beam", "2",
        "--engine", "ctranslate2",
    )  # fmt: skip
    library, _ = Ct2Translator.from_checkpoint(
        reverse_checkpoint, quantize="int8", threads=1, decode_overrides={"beam_size": 2}
    )
    assert library.compute_type == "int8_float32"
    assert out == named == library.translate(TEXTS)
    # Without --quantize, the PyTorch engine in float32, as before.
    _, fp32_err = translate(capsys, reverse_checkpoint, source, "--beam", "2")
    assert "CTranslate2" not in fp32_err and "on cpu" in fp32_err


@needs_ct2
def test_quantize_int8_refuses_the_pytorch_engine_and_its_options(
    reverse_checkpoint: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for command, extra, message in (
        ("translate", ["--engine", "torch"], "leave out --engine torch"),
        ("serve", ["--engine", "torch"], "leave out --engine torch"),
        (
            "translate",
            ["--pack-weights"],
            "--pack-weights is an option of --engine torch (--quantize int8 decodes with "
            "CTranslate2)",
        ),
        ("serve", ["--no-mmap"], "--no-mmap is an option of --engine torch (--quantize int8"),
        ("translate", ["--beam-rule", "paper"], "use --beam-rule fairseq, or leave out --quantize"),
    ):
        where = ["-i", str(source)] if command == "translate" else ["--port", "0"]
        args = [command, str(reverse_checkpoint), *where, "--quantize", "int8", *extra]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err


def test_quantize_int8_without_ctranslate2_says_how_to_get_it(
    reverse_checkpoint: Path,
    source: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 fails
    for command, where in (("translate", ["-i", str(source)]), ("serve", ["--port", "0"])):
        assert main([command, str(reverse_checkpoint), *where, "--quantize", "int8"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert "--quantize int8 decodes with CTranslate2's int8 weights" in err
        assert "CTranslate2 is not installed: pip install 'aiayn[interop]'" in err


@needs_ct2
def test_serve_quantize_int8(
    reverse_checkpoint: Path, source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``aiayn serve --quantize int8`` in its own process: CTranslate2's int8, answering what
    ``aiayn translate --quantize int8`` prints."""
    printed, _ = translate(capsys, reverse_checkpoint, source, "--quantize", "int8")
    server = ServerProcess(reverse_checkpoint, "--quantize", "int8")
    try:
        server.wait_ready()
        status, answer = server.post("/v1/translate", {"text": TEXTS})
        model = server.get("/v1/model")
    finally:
        server.stop()
    assert status == 200 and [t["text"] for t in answer["translations"]] == printed
    assert (model["engine"], model["compute_type"], model["attention"]) == (
        "ctranslate2",
        "int8_float32",
        False,
    )
    assert server.proc.returncode == 0 and "on cpu (CTranslate2, int8_float32)" in server.stderr


def test_the_library_has_no_torch_int8() -> None:
    """No module of ``src/aiayn`` imports or calls ``torch.ao`` (its dynamic quantization is
    deprecated), and the PyTorch translator takes no ``quantize``."""
    uses = []
    for path in sorted((ROOT / "src" / "aiayn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.module == "torch":
                    names += [f"torch.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.ao"):
                names = [ast.unparse(node)]
            uses += [
                f"{path.name}: {n}" for n in names if n == "torch.ao" or n.startswith("torch.ao.")
            ]
    assert uses == []
    with pytest.raises(TypeError, match="quantize"):
        Translator.from_checkpoint("unused.pt", quantize="int8")  # type: ignore[call-arg]
