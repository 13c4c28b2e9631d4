"""glibc's malloc in the long-running services: a fixed mmap threshold.

glibc serves an allocation of 128 KiB or more with ``mmap`` — until such a
block is freed: then it raises that threshold to the freed block's size (up to
32 MiB), so later large buffers (request bodies, programs' output, JSON texts)
come from the heap, between long-lived allocations, and what they leave when
freed stays there, fragmented. Traced under the full load (docs/notes/service-memory.md),
the HTTP service's Python objects were flat while memory malloc had freed and
kept grew by ≈ 0.3 MiB a minute; with the threshold fixed, a third of that.
:func:`fix_mmap_threshold` fixes it (``mallopt(M_MMAP_THRESHOLD)``, which also
stops glibc adjusting it) at the services' start.

``KREX_MALLOC_MMAP_THRESHOLD`` sets it in bytes (default 131072, glibc's
starting value; ``0`` leaves glibc's dynamic threshold); glibc's own
``MALLOC_MMAP_THRESHOLD_``, when set, is left in charge.
"""

from __future__ import annotations

import ctypes
import os

from krex.errors import BadRequest

ENV = "KREX_MALLOC_MMAP_THRESHOLD"
DEFAULT = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_mmap_threshold(n: int | None = None) -> int | None:
    """Fix glibc's mmap threshold at ``n`` bytes (default: ``KREX_MALLOC_MMAP_THRESHOLD``,
    else 128 KiB). The threshold set, or None where nothing changed (not glibc, ``0``,
    or the user's ``MALLOC_MMAP_THRESHOLD_`` in the environment)."""
    if n is None:
        if "MALLOC_MMAP_THRESHOLD_" in os.environ:
            return None
        raw = os.environ.get(ENV, "").strip()
        try:
            n = int(raw) if raw else DEFAULT
        except ValueError:
            raise BadRequest(f"{ENV} must be a number of bytes, not {raw!r}",
                             hint=f"unset it, or {ENV}=0 for glibc's dynamic threshold") from None
    if n <= 0:
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None  # not glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return n if mallopt(_M_MMAP_THRESHOLD, n) == 1 else None


__all__ = ["DEFAULT", "ENV", "fix_mmap_threshold"]
