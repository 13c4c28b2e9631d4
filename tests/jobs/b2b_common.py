"""What the back-to-back job scripts share: a busy wait, a warm-up region then a wait
until a common start (so every job's first region is its first in the race), and a
line written whole to stdout."""

import json
import os
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


def emit(obj: object) -> None:
    """``obj`` as one JSON line on stdout, written whole.  These jobs are frozen while
    another holds the device; a freeze that comes while a write longer than the pipe
    waits for its reader cuts that write short, and an unbuffered stream
    (``PYTHONUNBUFFERED=1``) drops the rest (docs/enforce.md): a CI run lost a loop's
    rows past 64 KiB.  So write the rest until it is all out."""
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(1, data):]
