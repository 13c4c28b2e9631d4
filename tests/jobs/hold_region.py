"""A holder job: enters one region, holds it, and records what it saw.

argv: OUT_FILE HOLD_S [THREADS] [SIBLING_PID] [MAX_HOLD_S]
Writes JSON: t_in/t_out (monotonic ns), the report, and during the region the
CPU affinity of every thread of this process and of the sibling.
"""

import json
import os
import sys
import threading
import time

import krex

out, hold_s = sys.argv[1], float(sys.argv[2])
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
sibling = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4] != "0" else None
max_hold = float(sys.argv[5]) if len(sys.argv) > 5 else None
stop = threading.Event()


def spin():
    while not stop.is_set():
        pass


def affinity(pid):
    tids = os.listdir(f"/proc/{pid}/task")
    return {tid: sorted(os.sched_getaffinity(int(tid))) for tid in tids}


workers = [threading.Thread(target=spin) for _ in range(threads - 1)]
for w in workers:
    w.start()
before = affinity(os.getpid())
with krex.region(label="hold", max_hold_s=max_hold) as r:
    t_in = time.monotonic_ns()
    time.sleep(min(hold_s / 2, 0.05))
    inside = affinity(os.getpid())
    inside_sibling = affinity(sibling) if sibling else None
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        pass
    t_out = time.monotonic_ns()
report = r.report  # the release is not waited for: its reply says the region is undone
after = affinity(os.getpid())
stop.set()
for w in workers:
    w.join()
with open(out, "w") as f:
    json.dump({"t_in": t_in, "t_out": t_out, "report": r.report.to_dict(), "before": before,
               "inside": inside, "inside_sibling": inside_sibling, "after": after}, f)
