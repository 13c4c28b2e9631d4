"""What the back-to-back job scripts share: a busy wait, and a warm-up region then a
wait until a common start (so every job's first region is its first in the race)."""

import time

import krex


def busy(ms: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < ms / 1e3:
        pass


def warm_up_then_wait(start: float) -> None:
    with krex.region("cpu", label="warm-up"):
        pass
    while time.monotonic() < start:
        time.sleep(0.001)
