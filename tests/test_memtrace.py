"""``krex.memtrace``'s allocator figures follow memory that tracemalloc does not see.

Each figure is read before and after the memory it counts is taken (and, for
Python's arenas, given back): a reading that stayed put would not be evidence.
"""

from __future__ import annotations

import ctypes
import gc

import pytest

from krex import memtrace


def test_pymalloc_figures_follow_small_objects():
    before = memtrace.allocators()["pymalloc"]
    if not before:
        pytest.skip("this Python has no sys._debugmallocstats")
    keep = [object() for _ in range(400_000)]  # 16 bytes each in pymalloc's pools: ≈ 6 MB
    during = memtrace.allocators()["pymalloc"]
    assert during["in_use"] - before["in_use"] > 5_000_000, (before, during)
    assert during["arenas"] > before["arenas"]
    del keep
    gc.collect()
    after = memtrace.allocators()["pymalloc"]
    assert during["in_use"] - after["in_use"] > 5_000_000, (during, after)


def test_malloc_figures_follow_native_allocations():
    before = memtrace.allocators()["malloc"]
    if not before:
        pytest.skip("glibc's mallinfo2 is not available here")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(100)]  # under the mmap threshold
    try:
        during = memtrace.allocators()["malloc"]
    finally:
        for b in blocks:
            libc.free(b)
    after = memtrace.allocators()["malloc"]
    taken = 100 * 64 * 1024  # give or take what other code allocates meanwhile
    assert during["in_use"] - before["in_use"] >= 0.9 * taken, (before, during)
    assert during["in_use"] - after["in_use"] >= 0.9 * taken, (during, after)
