"""What aiayn's commands change in their own process, said once for each command's ``--help``.

The library leaves the process alone (:func:`aiayn.accel.accelerate`'s ``process_settings``);
a command owns its process and asks for these settings explicitly."""

from __future__ import annotations

PROCESS_SETTINGS = (
    "On the CPU this command tunes its own process's glibc malloc thresholds; the library "
    "(Translator, Trainer) leaves them alone unless asked (process_settings=True)."
)
