"""The services fix glibc's mmap threshold (krex/service/malloc.py), as glibc reports it.

In a fresh interpreter: a 1 MiB block is allocated and freed, then a 512 KiB one
is allocated; ``mallinfo2`` says whether that one was ``mmap``ped (given back whole
when freed) or taken from the heap.  Control: with glibc's dynamic threshold the
freed 1 MiB block raised it, and the 512 KiB block comes from the heap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from krex.errors import BadRequest
from krex.service.malloc import ENV, fix_mmap_threshold

PROBE = textwrap.dedent("""
    import ctypes
    from krex.memtrace import allocators
    from krex.service.malloc import fix_mmap_threshold
    print("fixed", fix_mmap_threshold())
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(1 << 20))  # mmapped, and (dynamic threshold) raises it to 1 MiB
    before = allocators()["malloc"]["mmapped"]
    block = libc.malloc(512 << 10)
    print("mmapped", allocators()["malloc"]["mmapped"] - before)
    libc.free(block)
""")


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def _probe(value: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, ENV: value},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.mark.skipif(not _glibc(), reason="the mmap threshold is glibc's")
def test_a_fixed_threshold_keeps_large_blocks_out_of_the_heap():
    fixed = _probe("")  # the services' default
    assert fixed["fixed"] == str(128 * 1024) and int(fixed["mmapped"]) >= 512 << 10, fixed
    dynamic = _probe("0")  # control: glibc's dynamic threshold
    assert dynamic["fixed"] == "None" and int(dynamic["mmapped"]) == 0, dynamic


def test_the_users_setting_is_left_in_charge_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is None
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv(ENV, "big")
    with pytest.raises(BadRequest, match=ENV):
        fix_mmap_threshold()
