"""An unmanaged CPU hog that records where it ran, by its own observation.

argv: CORE OUT_FILE
Pins itself to CORE and spins; samples its current CPU (/proc/self/stat field
39) between two monotonic timestamps, keeping a sample whenever the CPU
changes and at least every millisecond.  On SIGTERM writes JSON
``[[t_before_s, t_after_s, cpu], ...]`` to OUT_FILE and exits.
"""

import json
import os
import signal
import sys
import time

core, out = int(sys.argv[1]), sys.argv[2]
os.sched_setaffinity(0, {core})
samples = []


def stop(signum, frame):
    with open(out + ".tmp", "w") as f:
        json.dump(samples, f)
    os.rename(out + ".tmp", out)
    os._exit(0)


signal.signal(signal.SIGTERM, stop)
stat = open("/proc/self/stat", "rb", buffering=0)
last_cpu, last_t = -1, 0.0
while True:
    t0 = time.monotonic()
    stat.seek(0)
    cpu = int(stat.read().rpartition(b")")[2].split()[36])
    t1 = time.monotonic()
    if cpu != last_cpu or t1 - last_t > 0.001:
        samples.append((t0, t1, cpu))
        last_cpu, last_t = cpu, t1
