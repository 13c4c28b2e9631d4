"""A sibling for benchmarks/gpu_check.py: keeps kernels of MS ms queued on DEVICE, forever.

argv: DEVICE [MS=1.0] [DEPTH=8]
Launches DEPTH kernels, synchronises, repeats: up to DEPTH x MS of work is queued
on the device whenever a region is granted.  Works on a GPU (PTX spin kernel)
and on fakegpu, through the driver API with ctypes (see gpu_driver.py).
"""

import sys

from gpu_driver import Driver

device = sys.argv[1]
ms = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
depth = int(sys.argv[3]) if len(sys.argv) > 3 else 8
drv = Driver(device)
kernel = drv.spin(ms)
kernel()
drv.synchronize()
print("running", flush=True)
while True:
    for _ in range(depth):
        kernel()
    drv.synchronize()
