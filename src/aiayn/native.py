"""Native kernels, registered by the code that loads them for the code that uses them.

:mod:`aiayn.accel.panels` loads aiayn's AVX2 kernels on CPUs that suit them;
:mod:`aiayn.inference.search`, which imports nothing of ``aiayn.accel``, takes greedy
search's choice of token from here. Each kernel has one typed slot: None where nothing is
registered, and then the caller's PyTorch code runs.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

# The index (int64) of the first maximum of each row of a float32 CPU matrix (rows, V), as
# ``scores.max(dim=-1).indices`` gives it (NaN counting as the maximum).
FirstArgmax = Callable[[Tensor], Tensor]

_first_argmax: FirstArgmax | None = None


def register_first_argmax(kernel: FirstArgmax | None) -> None:
    """Make ``kernel`` greedy search's choice of token on the CPU (None: withdraw it)."""
    global _first_argmax
    _first_argmax = kernel


def first_argmax() -> FirstArgmax | None:
    """The registered choice of token, or None."""
    return _first_argmax
