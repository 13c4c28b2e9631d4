"""Known hacks, each of which krex.evaluate must catch with the right finding."""

import ctypes
import os
import queue
import signal
import threading
import time

import numpy as np
from kernels import once, work

# -- work that outlives the call: a background thread fills the output later --------------
_jobs: queue.Queue = queue.Queue()


def _worker():
    while True:
        x, out = _jobs.get()
        np.copyto(out, work(x, 2))


threading.Thread(target=_worker, daemon=True, name="hack-worker").start()


def background_thread(x):
    out = np.empty_like(x)
    _jobs.put((x, out))
    return out  # filled by the thread shortly after (checks that read later see it right)


# -- output cached by input identity -------------------------------------------------------
_cache: dict = {}


def cache_by_identity(x):
    key = (id(x), x.ctypes.data)
    if key not in _cache:
        _cache[key] = once(x)
    return _cache[key]


# -- input mutation ------------------------------------------------------------------------
def mutate_input(x):
    out = once(x)
    np.multiply(x, 0.5, out=x)  # "scratch space"
    return out


def in_place(x):
    np.multiply(x, np.sqrt(x * x + np.float32(1.0)), out=x)
    return x


# -- early return doing no work (once it believes it is being timed) -----------------------
_calls = [0, None]


def early_return(x):
    _calls[0] += 1
    if _calls[0] > 12 and _calls[1] is not None:
        return _calls[1]
    _calls[1] = once(x)
    return _calls[1]


# -- the timer patched from the candidate module --------------------------------------------
_hidden = [0]
_real_ns = time.perf_counter_ns


def _patched_ns():
    return _real_ns() - _hidden[0]


def patch_perf_counter(x):
    if time.perf_counter_ns is not _patched_ns:
        time.perf_counter_ns = _patched_ns
    t0 = _real_ns()
    out = work(x, 2)
    _hidden[0] += _real_ns() - t0  # its own time vanishes from every later reading
    return out


def patch_krex_timer(x):
    from krex.measure import timers

    if not getattr(timers.CpuTimer.elapsed_ms, "_hacked", False):
        real = timers.CpuTimer.elapsed_ms

        def elapsed_ms(self, pending):
            return real(self, pending) / 3

        elapsed_ms._hacked = True
        timers.CpuTimer.elapsed_ms = elapsed_ms
    return work(x, 2)


# -- right for zeros, wrong for random ---------------------------------------------------------
def zeros_only(x):
    return np.zeros_like(x)


# -- reduced precision beyond tolerance ----------------------------------------------------------
def half_precision(x):
    h = x.astype(np.float16)
    return (h * np.sqrt(h * h + np.float16(1.0))).astype(np.float32)


# -- a crash and a hang ----------------------------------------------------------------------------
def crash(x):
    os.kill(os.getpid(), signal.SIGSEGV)


def segfault(x):
    return ctypes.string_at(0)


def hang(x):
    while True:
        time.sleep(0.01)
