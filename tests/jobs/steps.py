"""Regions and pauses in a given order, for tests of the daemon's re-queueing.

Arguments are steps: ``r<hold_s>`` a region held (busy) that long, ``r<hold_s>/<max_s>``
with that maximum hold, ``R<path>`` a region held until a file exists, ``p<n>x<hold_s>``
``n`` regions held that long, pipelined (``krex.regions``; no line for the last one),
``s<seconds>`` a
sleep outside any region, ``t<path>`` touch a file, ``w<path>`` wait for a file.  Prints
one JSON line per region: when it was asked for and entered (this process's monotonic
clock) and the daemon's report."""

import os
import sys
import time
import warnings

from b2b_common import busy, emit

import krex

warnings.simplefilter("ignore")  # a revoked region is part of what is tested
for step in sys.argv[1:]:
    kind, arg = step[0], step[1:]
    if kind in "rR":
        hold, _, most = arg.partition("/") if kind == "r" else (arg, "", "")
        asked = time.monotonic()
        with krex.region("cpu", max_hold_s=float(most) if most else None) as r:
            entered = time.monotonic()
            if kind == "r":
                busy(float(hold) * 1e3)
            while kind == "R" and not os.path.exists(hold):
                time.sleep(0.002)
        emit({"asked": asked, "entered": entered, "report": r.report.to_dict()})
    elif kind == "p":
        n, _, hold = arg.partition("x")
        prev = None
        for r in krex.regions(int(n), "cpu"):
            if prev is not None and prev[0].report is not None:  # set as this one began
                emit({"asked": prev[1], "entered": prev[1],
                      "report": prev[0].report.to_dict()})
            prev = (r, time.monotonic())
            busy(float(hold) * 1e3)
    elif kind == "s":
        time.sleep(float(arg))
    elif kind == "t":
        open(arg, "w").close()
    elif kind == "w":
        while not os.path.exists(arg):
            time.sleep(0.002)
