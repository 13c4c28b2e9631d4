"""Candidates that reach for the evaluation's evidence from plain Python (issue 42).

Each fooled the one-program evaluation (``isolation="worker"``: the reference, the
timed loop and the summary in the candidate's own interpreter) -- judged ``faster``
with no finding, whatever its true speed.  With ``isolation="process"`` each must be
caught with a named finding or made harmless (the verdict its true speed deserves).
The true speedups over ``kernels.reference`` (work twice) are in the comments.
"""

import gc
import os
import sys
import time

import numpy as np
from kernels import once, work


# -- the evaluation's own state, found with gc: speedup x3 (true 1x) ------------------------
def _inflate() -> bool:
    for obj in gc.get_objects():
        if type(obj) is dict and isinstance(obj.get("comparison"), dict):
            c = obj["comparison"]
            if c.get("speedup") and not c.get("_inflated"):
                for key in ("speedup", "ci_low", "ci_high"):
                    c[key] *= 3
                c["_inflated"] = True
                return True
    return False


_done = [False]


def gc_summary(x):
    try:
        caller = sys._getframe(1).f_code.co_name
    except ValueError:
        caller = ""
    if caller != "__call__" and not _done[0]:  # not from the timed loop: scan
        _done[0] = _inflate()
    return work(x, 2)


# -- the timed loop recognised by its caller's frame: 1/8 of the work there (true 2x) -------
def frame_timed(x):
    try:
        caller = sys._getframe(1).f_code
    except ValueError:
        caller = None
    if caller is not None and caller.co_name == "__call__" \
            and caller.co_filename.endswith("probe.py"):
        out = np.zeros_like(x)
        n = x.shape[0] // 8
        out[:n] = once(x[:n])
        return out
    return once(x)


# -- a fake ndarray whose __array__ does the work when krex copies it (true 2x) ---------------
class ndarray:  # noqa: N801  (named like numpy's on purpose)
    __module__ = "numpy"

    def __init__(self, x):
        self._x, self.shape, self.dtype = x, x.shape, x.dtype

    def __array__(self, dtype=None, copy=None):
        return once(self._x)


def fake_ndarray(x):
    return ndarray(x)


# -- kin: a double-forked process that steals CPU from whatever runs beside it (true 1x) ------
_spinner = [False]


def _double_fork_spinner(seconds: float) -> None:
    if os.fork() != 0:
        return
    try:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # bounded: never outlives the test by much
            pass
    finally:
        os._exit(0)


def fork_spinner(x):
    if not _spinner[0]:
        _spinner[0] = True
        _double_fork_spinner(3.0)
        os.wait()
    return work(x, 2)


# -- kin: a subclass of numpy.ndarray whose methods do the work late (true 2x) ----------------
class Lazy(np.ndarray):
    pass


def ndarray_subclass(x):
    return once(x).view(Lazy)


# -- kin: krex's timer patched for the timed loop, restored before the end (true 1x) ----------
_saved: list = []
_restored = [False]


def patch_restored(x):
    from krex.measure import timers

    try:
        caller = sys._getframe(1).f_code.co_name
    except ValueError:
        caller = ""
    if caller == "_timed_outputs" and _saved:  # the timing is over: put it back unseen
        timers.CpuTimer.elapsed_ms = _saved.pop()
        _restored[0] = True
    elif not _saved and not _restored[0]:
        real = timers.CpuTimer.elapsed_ms

        def elapsed_ms(self, pending, real=real):
            return real(self, pending) / 3

        _saved.append(real)
        timers.CpuTimer.elapsed_ms = elapsed_ms
    return work(x, 2)
