"""A fakegpu holder for the NVML audit (tests/fakenvml): lists its own pid as a compute
process on the fake NVML device (otherwise steady: its defaults), takes one region on
fakegpu:0, and prints its report.

argv: JSON {"state": {fake NVML state to start from}, "also": [pids listed from the
start], "mid": {fake NVML state set inside the region}, "mid_pids": [pids listed from
inside the region on], "restore": {state set back "mid_s" seconds later (default
0.02), so the release reading sees the device steady again}}.
"""

import json
import os
import sys
import time

import pynvml  # the fake: tests/fakenvml on PYTHONPATH

import krex

plan = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
listed = [os.getpid(), *plan.get("also", [])]
# a steady device to start from, whatever the job before left
pynvml.update(**{**pynvml.DEFAULT, **plan.get("state", {}),
                 "processes": [{"pid": pid, "used_mib": 64} for pid in listed]})
with krex.region(device="fakegpu:0", label="nvml") as r:
    time.sleep(0.02)
    mid = dict(plan.get("mid", {}))
    if plan.get("mid_pids"):
        listed += plan["mid_pids"]
        mid["processes"] = [{"pid": pid, "used_mib": 64} for pid in listed]
    if mid:
        pynvml.update(**mid)
    time.sleep(plan.get("mid_s", 0.02))
    if plan.get("restore"):
        pynvml.update(**plan["restore"])
        time.sleep(0.01)
print(json.dumps(r.report.to_dict()))
