"""A stand-in for a heavy framework import (``import torch``): burns CPU once.

Importing this module spends ``$KREX_EVAL_IMPORT_MS`` milliseconds of CPU
time (default 0).  Fresh processes pay it on every command; warm workers
preload it once (the daemon's ``preload`` list), as they would torch.
"""

from __future__ import annotations

import os
import time


def burn_cpu_ms(ms: float) -> int:
    """Spin on the CPU for ``ms`` milliseconds of this thread's CPU time."""
    end_ns = time.thread_time_ns() + int(ms * 1e6)
    acc = 0
    while time.thread_time_ns() < end_ns:
        for i in range(2000):
            acc += i * i
    return acc


IMPORT_MS = float(os.environ.get("KREX_EVAL_IMPORT_MS", "0") or 0)
burn_cpu_ms(IMPORT_MS)
