"""A test job: enters N regions (from T threads) and records its own timestamps.

argv: OUT_FILE N_REGIONS HOLD_MS [THREADS]
Each line: {"job", "thread", "req", "in", "out"} in time.monotonic_ns().
"""

import json
import os
import sys
import threading
import time

import krex

out_path, n, hold_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
lock = threading.Lock()
lines = []


def spin(ms):
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def worker(t):
    for _ in range(n):
        req = time.monotonic_ns()
        with krex.region(label=f"t{t}"):
            t_in = time.monotonic_ns()
            spin(hold_ms)
            t_out = time.monotonic_ns()
        with lock:
            lines.append({"job": os.environ.get("KREX_JOB_ID", str(os.getpid())), "thread": t,
                          "req": req, "in": t_in, "out": t_out})


failures = []


def guarded(t):
    try:
        worker(t)
    except BaseException as exc:  # noqa: BLE001 - a dead thread must fail the job, not vanish
        failures.append(f"thread {t}: {exc!r}")


ts = [threading.Thread(target=guarded, args=(t,)) for t in range(threads)]
for th in ts:
    th.start()
for th in ts:
    th.join()
with open(out_path, "w") as f:
    f.write("\n".join(json.dumps(x) for x in lines) + "\n")
if failures:
    sys.exit("region_recorder: " + "; ".join(failures))
