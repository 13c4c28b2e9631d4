"""Take back-to-back regions (busy ``hold_ms`` each, then ``gap_ms`` of busy work
outside) from ``start`` (monotonic) for ``seconds``; print one JSON line: this job's
region count and time held (its own clock)."""

import sys
import time

from b2b_common import busy, emit, warm_up_then_wait

import krex

start, seconds, hold_ms, gap_ms = (float(a) for a in sys.argv[1:5])

warm_up_then_wait(start)
held = 0.0
regions = 0
while time.monotonic() < start + seconds:
    with krex.region("cpu", label="b2b"):
        t0 = time.monotonic()
        busy(hold_ms)
        held += time.monotonic() - t0
    regions += 1
    busy(gap_ms)
emit({"regions": regions, "held_s": held})
