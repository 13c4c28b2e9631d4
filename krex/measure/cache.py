"""Cache flushing between samples (``cache="cold"``).

``cpu``: write a buffer of at least twice the last-level cache, whose size
is read from ``/sys/devices/system/cpu/cpu0/cache``.  Device timers flush
their own L2 (see :mod:`krex.measure.events`).
"""

from __future__ import annotations

import ctypes
import os

DEFAULT_LLC_BYTES = 32 << 20
_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def parse_size(text: str) -> int:
    """'32768K' -> 33554432; '1M' -> 1048576; '512' -> 512."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale


def last_level_cache_bytes(cache_dir: str = _CACHE_DIR) -> int:
    """Size of the highest-level cache of cpu0, or 32 MiB when unknown."""
    best_level, best_size = -1, 0
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return DEFAULT_LLC_BYTES
    for entry in entries:
        level_size = _read_index(os.path.join(cache_dir, entry))
        if level_size and level_size[0] > best_level:
            best_level, best_size = level_size
    return best_size or DEFAULT_LLC_BYTES


def _read_index(path: str) -> tuple[int, int] | None:
    try:
        with open(os.path.join(path, "level")) as f:
            level = int(f.read())
        with open(os.path.join(path, "size")) as f:
            size = parse_size(f.read())
    except (OSError, ValueError):
        return None
    return level, size


class CpuCacheFlusher:
    """Overwrites a buffer ≥ 2x the last-level cache with memset (no numpy needed)."""

    def __init__(self, size_bytes: int | None = None) -> None:
        self.size_bytes = size_bytes or 2 * last_level_cache_bytes()
        self._buffer = (ctypes.c_char * self.size_bytes)()
        self._value = 0

    def flush(self) -> None:
        self._value = (self._value + 1) & 0xFF
        ctypes.memset(self._buffer, self._value, self.size_bytes)
