"""What steers one sentence's translation: terminology constraints and a forced prefix.

Every engine's search takes one :class:`Steering` per source (``TextTranslator._search_batch``);
the PyTorch engine's beam search meets constraints and forces the prefix
(:mod:`aiayn.inference.constrained`; docs/translation.md, "Terminology constraints and a forced
prefix"), CTranslate2's takes the prefix and refuses constraints.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Steering:
    """``constraints``: the token ids of each phrase that must appear in the output, whole
    and in the order of its tokens; ``prefix``: the token ids the output starts with (scored
    as the rest of it). The default steers nothing."""

    constraints: tuple[tuple[int, ...], ...] = ()
    prefix: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.constraints or self.prefix)
