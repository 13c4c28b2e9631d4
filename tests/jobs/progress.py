"""A sibling job: records a monotonic timestamp about every millisecond until told to stop.

argv: OUT_FILE [SECONDS]   (stops on SIGTERM, or after SECONDS)
"""

import signal
import sys
import time

out = open(sys.argv[1], "w", buffering=1)
limit = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 120)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("running", flush=True)
while time.monotonic() < limit:
    out.write(f"{time.monotonic_ns()}\n")
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass
