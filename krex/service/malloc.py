"""glibc's malloc in the long-running services: a bounded number of arenas.

glibc gives a thread that starts allocating an arena of its own while there are
fewer than eight per core; the services run many threads (uvicorn's, anyio's
pool that runs every blocking call, the SDK's), so the memory freed by one
thread stays in its arena, fragmented, for that arena's next users. Traced
under the full load (docs/benchmarks.md), the HTTP service's Python heap was
flat while its RSS crept up by ≈ 0.1 MiB a minute, in the threads' arenas.
:func:`limit_arenas` caps them (``mallopt(M_ARENA_MAX)``) before the service
starts a thread; the services do their work under the GIL, so the threads rarely
contend for an arena anyway.

``KREX_MALLOC_ARENA_MAX`` sets the cap (default 2; ``0`` leaves glibc's
default); glibc's own ``MALLOC_ARENA_MAX``, when set, is left in charge.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "KREX_MALLOC_ARENA_MAX"
DEFAULT = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_arenas(n: int | None = None) -> int | None:
    """Cap glibc's malloc arenas at ``n`` (default: ``KREX_MALLOC_ARENA_MAX``, else 2).
    The cap set, or None where nothing was changed (not glibc, ``0``, or the user's
    ``MALLOC_ARENA_MAX`` in the environment).  Call before starting threads: an arena
    already made stays."""
    if n is None:
        if "MALLOC_ARENA_MAX" in os.environ:
            return None
        raw = os.environ.get(ENV, "").strip()
        try:
            n = int(raw) if raw else DEFAULT
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of arenas (0: glibc's default),"
                             f" not {raw!r}") from None
    if n <= 0:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc (musl has no arenas to cap)
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return n if mallopt(_M_ARENA_MAX, n) == 1 else None


__all__ = ["DEFAULT", "ENV", "limit_arenas"]
