"""One region of SECONDS of kernels on DEVICE (gpu_check's device_truth throttle check).

argv: DEVICE SECONDS OUT_JSON.  Prints "in region" once granted, keeps 1 ms kernels
queued for SECONDS, and writes the region's report to OUT_JSON.
"""

import json
import sys
import time

from gpu_driver import Driver

import krex

device, seconds, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
drv = Driver(device)
kernel = drv.spin(1.0)
kernel()
drv.synchronize()
with krex.region(device=device, label="long") as r:
    print("in region", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(8):
            kernel()
        drv.synchronize()
with open(out, "w") as f:
    json.dump(r.report.to_dict(), f)
