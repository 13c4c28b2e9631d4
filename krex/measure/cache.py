"""Cache flushing between samples (``cache="cold"``).

``cpu``: write a buffer as large as the caches the timed core can fill —
its private levels plus the shared last level, read from
``/sys/devices/system/cpu/cpuN/cache`` for the cores this process may run
on (the largest of them) — capped at :data:`FLUSH_CAP_BYTES`.  One write of
that size evicts what the previous sample left behind; on the 2-core
development machine a flush of twice the last level (210 MiB, the earlier
default) cost 3.4 × the capped 64 MiB one and left a call over 1–8 MiB of
data only 2–3 % colder (docs/notes/measure.md, "Defaults before and after").
Device timers flush their own L2 (see :mod:`krex.measure.events`).
"""

from __future__ import annotations

import ctypes
import os

DEFAULT_LLC_BYTES = 32 << 20  # when sysfs says nothing
FLUSH_CAP_BYTES = 64 << 20  # a flush costs ~0.1 ms per MiB on one core here
_CPU_DIR = "/sys/devices/system/cpu"
_CACHE_DIR = f"{_CPU_DIR}/cpu0/cache"


def parse_size(text: str) -> int:
    """'32768K' -> 33554432; '1M' -> 1048576; '512' -> 512."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale


def last_level_cache_bytes(cache_dir: str = _CACHE_DIR) -> int:
    """Size of the highest-level cache of a core (cpu0 by default), or 32 MiB when unknown."""
    levels = _levels(cache_dir)
    return levels[max(levels)] if levels else DEFAULT_LLC_BYTES


def core_cache_bytes(cache_dir: str = _CACHE_DIR) -> int:
    """Data a core can keep cached: its data and unified caches of every level, summed."""
    levels = _levels(cache_dir)
    return sum(levels.values()) if levels else DEFAULT_LLC_BYTES


def _levels(cache_dir: str) -> dict[int, int]:
    """{level: bytes} of the data and unified caches listed under ``cache_dir``."""
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return {}
    out: dict[int, int] = {}
    for entry in entries:
        found = _read_index(os.path.join(cache_dir, entry))
        if found:
            out[found[0]] = max(out.get(found[0], 0), found[1])
    return out


def _read_index(path: str) -> tuple[int, int] | None:
    if _read_text(os.path.join(path, "type")) == "Instruction":
        return None
    try:
        with open(os.path.join(path, "level")) as f:
            level = int(f.read())
        with open(os.path.join(path, "size")) as f:
            size = parse_size(f.read())
    except (OSError, ValueError):
        return None
    return level, size


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def timed_core_cache_bytes(cpus: set[int] | None = None, cpu_dir: str = _CPU_DIR) -> int:
    """The most any core this process may run on can cache (the timed core is one of them)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except OSError:
            cpus = {0}
    sizes = [core_cache_bytes(f"{cpu_dir}/cpu{c}/cache") for c in sorted(cpus)[:64]]
    return max(sizes, default=DEFAULT_LLC_BYTES)


def default_flush_bytes() -> int:
    """What the timed core can hold, at most :data:`FLUSH_CAP_BYTES`."""
    return min(timed_core_cache_bytes(), FLUSH_CAP_BYTES)


class CpuCacheFlusher:
    """Overwrites a buffer the size of the timed core's caches with memset (no numpy)."""

    def __init__(self, size_bytes: int | None = None) -> None:
        self.size_bytes = size_bytes or default_flush_bytes()
        self._buffer = (ctypes.c_char * self.size_bytes)()
        self._value = 0

    def flush(self) -> None:
        self._value = (self._value + 1) & 0xFF
        ctypes.memset(self._buffer, self._value, self.size_bytes)
