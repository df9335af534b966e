"""The model: attention, feed-forward, embeddings, layers, the encoder-decoder and its cache.

Imports nothing from ``aiayn.data``, ``aiayn.training`` or ``aiayn.inference``.
"""

from aiayn.model.cache import DecoderCache, LayerCache
from aiayn.model.transformer import Transformer, count_parameters

__all__ = ["DecoderCache", "LayerCache", "Transformer", "count_parameters"]
