"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The names below are loaded when first used, so that ``import aiayn.data`` (or ``aiayn
--help``) does not import the model and PyTorch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS = {
    "DataConfig": "aiayn.config",
    "DecodeConfig": "aiayn.config",
    "ModelConfig": "aiayn.config",
    "RunConfig": "aiayn.config",
    "TrainConfig": "aiayn.config",
    "DecoderCache": "aiayn.model.cache",
    "Transformer": "aiayn.model.transformer",
}

__all__ = [
    "DataConfig",
    "DecodeConfig",
    "DecoderCache",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "Transformer",
    "__version__",
]

if TYPE_CHECKING:
    from aiayn.config import DataConfig, DecodeConfig, ModelConfig, RunConfig, TrainConfig
    from aiayn.model.cache import DecoderCache
    from aiayn.model.transformer import Transformer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
