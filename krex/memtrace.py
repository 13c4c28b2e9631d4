"""Memory tracing of a long-lived process: what it keeps, by traceback.

The services read ``KREX_TRACEMALLOC=PATH``, the daemon ``KREX_DAEMON_TRACEMALLOC=PATH``
(two names: a daemon the service starts inherits its environment).  Off (the
default) it costs nothing: :func:`install` returns at once.  With the variable
set, the process starts :mod:`tracemalloc` (frames:
``KREX_TRACEMALLOC_FRAMES``, default 12) and, on each ``SIGUSR1``, takes a
snapshot: the first one is the *mark*; each later one writes ``PATH``
(atomically, JSON) with what grew since the mark — the top allocations by
traceback (``Snapshot.compare_to``), the Python objects by type
(``gc.get_objects()``), the traced total, the process's RSS, and what each
allocator holds (``allocators``: Python's own arenas from
``sys._debugmallocstats``, glibc's heap from ``mallinfo2``: memory that
tracemalloc does not see, in use or kept free) — and a
``"seq"`` that counts the dumps, so a driver knows when its answer is written.
The process writes it once more at :func:`dump` (the service's close).

The reason it exists: a long-lived ``krex mcp`` grew ≈ 0.45 MiB/min under
load while the HTTP service levelled off; ``benchmarks/bench_service_memory.py``
drives calls and reads these dumps to tell what fills and stops from what
grows per call, for the daemon too (``--daemon``).
"""

from __future__ import annotations

import collections
import gc
import os
import signal
import threading
import tracemalloc
from typing import Any

from krex import resultfile

ENV = "KREX_TRACEMALLOC"
DAEMON_ENV = "KREX_DAEMON_TRACEMALLOC"
FRAMES_ENV = "KREX_TRACEMALLOC_FRAMES"
TRIM_ENV = "KREX_TRACEMALLOC_TRIM"  # set: each dump also returns free heap memory (malloc_trim)
TOP = 40  # tracebacks reported
TYPES = 40  # object types reported


class _Tracer:
    def __init__(self, path: str) -> None:
        self.path = path
        self.mark: tracemalloc.Snapshot | None = None
        self.mark_types: collections.Counter[str] = collections.Counter()
        self.seq = 0
        self.lock = threading.Lock()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.dump()

    def dump(self) -> None:
        with self.lock:
            gc.collect()
            snap = _snapshot()
            types = _types()
            if self.mark is None:
                self.mark, self.mark_types = snap, types
                report: dict[str, Any] = {"mark": True}
            else:
                report = _compare(self.mark, snap, self.mark_types, types)
            self.seq += 1
            report.update(seq=self.seq, traced_bytes=tracemalloc.get_traced_memory()[0],
                          rss_bytes=_rss(), threads=threading.active_count(),
                          maps=_maps(), allocators=allocators())
            if os.environ.get(TRIM_ENV):
                _trim()
                report["rss_after_trim_bytes"] = _rss()
            resultfile.write(self.path, report)


_tracer: _Tracer | None = None


def install(env: str = ENV) -> bool:
    """Start tracing if the variable ``env`` names a path; True if it does."""
    global _tracer
    path = os.environ.get(env)
    if not path or _tracer is not None:
        return _tracer is not None
    frames = int(os.environ.get(FRAMES_ENV) or 12)
    if frames > 0:  # 0: object counts, RSS and maps only (tracing costs memory itself)
        tracemalloc.start(frames)
    _tracer = _Tracer(path)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _tracer.on_signal)
    return True


def dump() -> None:
    """Write the report now (a no-op while tracing is off)."""
    if _tracer is not None:
        _tracer.dump()


def _snapshot() -> tracemalloc.Snapshot:
    if not tracemalloc.is_tracing():
        return tracemalloc.Snapshot([], 1)
    return tracemalloc.take_snapshot().filter_traces((
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, __file__, all_frames=True)))  # its own (a signal's stack)


def _types() -> collections.Counter[str]:
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                               for o in gc.get_objects())


def _compare(mark: tracemalloc.Snapshot, now: tracemalloc.Snapshot,
             mark_types: collections.Counter[str],
             types: collections.Counter[str]) -> dict[str, Any]:
    stats = now.compare_to(mark, "traceback")
    grown = [{"size_diff": s.size_diff, "count_diff": s.count_diff, "size": s.size,
              "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback]}
             for s in stats[:TOP]]
    delta = {t: types[t] - mark_types.get(t, 0) for t in set(types) | set(mark_types)}
    top_types = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:TYPES]
    return {"mark": False, "size_diff": sum(s.size_diff for s in stats),
            "top": grown, "types": dict(top_types), "objects": sum(types.values()),
            "objects_diff": sum(types.values()) - sum(mark_types.values())}


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _maps() -> dict[str, int]:
    """Resident KiB by kind of mapping: the brk heap, anonymous maps (malloc arenas,
    thread stacks, mimalloc), and files (code, SQLite's mmap)."""
    out = {"heap_kib": 0, "anon_kib": 0, "anon_maps": 0, "file_kib": 0}
    try:
        with open("/proc/self/smaps") as f:
            kind = "file"
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    name = head[5] if len(head) > 5 else ""
                    kind = "heap" if name == "[heap]" else "anon" if not name else "file"
                    out["anon_maps"] += kind == "anon"
                elif head[0] == "Rss:":
                    out[f"{kind}_kib"] += int(head[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def allocators() -> dict[str, dict[str, int]]:
    """Bytes each allocator holds: ``pymalloc`` (Python's small-object arenas: in
    blocks in use, in free blocks and pools, the arenas' total) and ``malloc``
    (glibc's ``mallinfo2`` over every arena: in use, free but kept, mmapped).
    Empty where unavailable."""
    return {"pymalloc": _pymalloc(), "malloc": _mallinfo()}


_PYMALLOC = {"# arenas allocated current": "arenas", "# arenas highwater mark": "arenas_highwater",
             "# bytes in allocated blocks": "in_use", "# bytes in available blocks": "free_blocks",
             "unused pools": "free_pools", "Total": "total"}


def _pymalloc() -> dict[str, int]:
    """``sys._debugmallocstats`` writes to the C stderr: it is read from a file that
    fd 2 points to meanwhile (other threads' stderr lands there for that moment)."""
    import sys
    import tempfile

    debug = getattr(sys, "_debugmallocstats", None)
    if debug is None:
        return {}
    out: dict[str, int] = {}
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(tmp.fileno(), 2)
            debug()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        for line in tmp.read().decode(errors="replace").splitlines():
            head, _, value = line.rpartition("=")
            key = next((k for prefix, k in _PYMALLOC.items() if prefix in head), None)
            if key is not None and key not in out:
                try:
                    out[key] = int(value.strip().replace(",", ""))
                except ValueError:
                    pass
    return out


def _mallinfo() -> dict[str, int]:
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}  # not glibc, or older than 2.33
    fn.restype = MallInfo2
    m = fn()
    return {"in_use": m.uordblks, "free": m.fordblks, "heap": m.arena, "mmapped": m.hblkhd}


def _trim() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
