"""A fakegpu holder for the amdsmi audit (tests/fakeamdsmi): takes one region on
fakegpu:0 and prints its report.

argv: JSON {"processes": [pids listed from the start, with 64 MiB each], "mid": {fake
amdsmi state set inside the region}}.
"""

import json
import sys
import time

import amdsmi  # the fake: tests/fakeamdsmi on PYTHONPATH

import krex

plan = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
amdsmi.update(**{**amdsmi.DEFAULT,
                 "processes": [{"pid": pid, "mem": 64 << 20} for pid in plan.get("processes", [])]})
with krex.region(device="fakegpu:0", label="amdsmi") as r:
    time.sleep(0.02)
    if plan.get("mid"):
        amdsmi.update(**plan["mid"])
    time.sleep(0.05)
print(json.dumps(r.report.to_dict()))
