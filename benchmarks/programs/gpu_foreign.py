"""A process with a context on DEVICE that krex does not manage (gpu_check's device_truth).

argv: DEVICE.  Makes the device's primary context current, allocates a little memory (so
NVML lists it as a compute process), prints "ready" and sleeps until killed.  Started
without ``krex run``: no gate, no drain, no freeze reaches it.
"""

import ctypes
import sys
import time

from gpu_driver import Driver

drv = Driver(sys.argv[1])
ptr = ctypes.c_uint64()
drv.check("cuMemAlloc", drv.lib.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))
print("ready", flush=True)
while True:
    time.sleep(60)
