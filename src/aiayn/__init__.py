"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017)."""

from aiayn.config import DataConfig, DecodeConfig, ModelConfig, RunConfig, TrainConfig
from aiayn.model.cache import DecoderCache
from aiayn.model.transformer import Transformer

__version__ = "0.1.0"

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
