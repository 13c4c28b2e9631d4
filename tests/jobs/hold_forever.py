"""A test job: enters a region, says so on stdout, and holds it until killed."""

import sys
import time

import krex

max_hold = float(sys.argv[1]) if len(sys.argv) > 1 else None
with krex.region(label="forever", max_hold_s=max_hold) as r:
    print("inside", flush=True)
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 3600)
print("revoked" if r.report.revoked else "released", r.report.clean, flush=True)
