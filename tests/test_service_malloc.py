"""The services cap glibc's malloc arenas (krex/service/malloc.py).

A fresh interpreter starts 8 threads that all allocate at once and counts the
arenas in glibc's own ``malloc_info`` report; and a real ``krex service``, after
serving requests, is looked at from outside: its threads' arenas are the 64 MiB
aligned heaps in ``/proc/PID/maps``.  Controls: the same without the cap make
more arenas than the cap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from krex.service.malloc import ENV, limit_arenas

COUNT = textwrap.dedent("""
    import ctypes, os, sys, tempfile, threading
    from krex.service.malloc import limit_arenas
    print("cap", limit_arenas(), flush=True)
    libc = ctypes.CDLL("libc.so.6")
    barrier = threading.Barrier(8)
    keep = []
    def work():
        barrier.wait()
        keep.append(ctypes.create_string_buffer(1 << 16))  # malloc, not Python's arenas
        barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    libc.fdopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    fd, path = tempfile.mkstemp()
    f = libc.fdopen(fd, b"w")  # malloc_info writes its XML report to a FILE*
    libc.malloc_info(0, f)
    libc.fclose(f)
    print("arenas", open(path).read().count("<heap nr="))
    os.unlink(path)
""")


def _arenas(cap: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", COUNT], env={**env, ENV: cap},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    return lines["cap"], int(lines["arenas"])


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(not _glibc(), reason="malloc arenas are glibc's")
def test_the_services_cap_the_arenas_their_threads_make():
    cap, capped = _arenas("2")
    assert cap == "2" and capped <= 2, (cap, capped)
    cap, free = _arenas("0")  # control: glibc's default, an arena per thread (to 8 a core)
    assert cap == "None" and free > 2, (cap, free)


HEAP = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's reservation, aligned


def _heaps(pid: int) -> int:
    """Thread arenas of ``pid``: anonymous, 64 MiB-aligned reservations of 64 MiB (the
    part in use read-write, the rest ``---p``).  The main arena is the brk heap."""
    rows = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            rows.append((start, end, parts[1], len(parts) > 5))
    n = 0
    for i, (start, end, perm, named) in enumerate(rows):
        if named or start % HEAP or perm != "rw-p":
            continue
        for nxt, nend, nperm, nnamed in rows[i + 1:]:
            if nxt != end or nnamed or nperm != "---p":
                break
            end = nend
        n += end - start == HEAP
    return n


@pytest.mark.skipif(not _glibc(), reason="malloc arenas are glibc's")
@pytest.mark.parametrize("cap", ["2", "0"])
def test_a_real_http_service_keeps_to_the_cap(daemon, tmp_path, monkeypatch, cap):
    """Control (``0``, glibc's default): the same service and requests make more."""
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from test_service_http import Service

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setenv(ENV, cap)
    s = Service(tmp_path / "state", "--runners", "2")
    try:
        for _ in range(20):
            for path in ("/v1/health", "/v1/node", "/metrics", "/"):
                s.call("GET", path)
        heaps = _heaps(s.proc.pid)
    finally:
        s.stop()
    if cap == "2":
        assert heaps <= 1, heaps  # + the main arena: 2
    else:
        assert heaps > 1, heaps


def test_the_users_malloc_arena_max_is_left_in_charge(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas() is None
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=ENV):
        limit_arenas()
