"""The run configs that ship with aiayn (``configs/`` in the repository is this folder):
``aiayn train --config NAME`` takes one by name, from wherever aiayn is installed.

- ``base``, ``big``: the paper's recipes (Table 3), for GPUs.
- ``multi30k``: Multi30k English→German on 2 CPU cores in 45 minutes.
- ``bible_lm``, ``bible_mlm``, ``bible_classify``: the other families on the embedded corpus
  (CPU, minutes).
- ``finetune``: a translation model (e.g. one imported from Marian) going on training on
  new text (``train.init_from``).
- ``tiny``: smoke runs.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent


def recipe_names() -> list[str]:
    """The names ``--config`` accepts."""
    return sorted(path.stem for path in FOLDER.glob("*.toml"))


def resolve_recipe(given: str | Path) -> Path:
    """``given`` as a path when it exists (or looks like one), else the shipped recipe of that
    name (``multi30k`` or ``multi30k.toml``); a name that is neither stays as given, so that
    the config loader reports the missing file."""
    path = Path(given)
    if path.exists() or len(path.parts) > 1:
        return path
    name = path.name.removesuffix(".toml")
    shipped = FOLDER / f"{name}.toml"
    return shipped if shipped.is_file() else path
