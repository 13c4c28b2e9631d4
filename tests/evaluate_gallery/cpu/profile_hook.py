"""A hack on its own module (it acts at import): a profile hook on every thread that
busy-waits 1.5 ms on each call of a function named like the reference (true 1x).

In one program (``isolation="worker"``) the reference runs in the candidate's
interpreter, hook included, and looks ~3x slower; in its own process it never sees it.
"""

import sys
import threading
import time

from kernels import work


def _hook(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "reference":
        end = time.perf_counter() + 0.0015
        while time.perf_counter() < end:
            pass


sys.setprofile(_hook)
threading.setprofile(_hook)


def profile_hook(x):
    return work(x, 2)
