"""Device-clock evidence for gpu_check.py's overlap check.

argv: ROLE DEVICE OUT_JSON ARG
- ``sibling``: streams 1 ms stamp kernels in batches of 64 (a queue up to 64 ms deep),
  synchronising after each batch, for ARG seconds or until SIGTERM; prints "running"
  once its first batch is queued; writes ``{"stamps": [[start_ns, end_ns], ...]}``.
- ``holder``: takes ARG regions; in each, 4 stamp kernels of 1 ms then a sync; writes
  ``{"regions": [[[start_ns, end_ns] x 4], ...], "clean": [...], "reasons": [...]}``.
Every stamp is the device's own global timer (fakegpu: its execution log).
"""

import json
import signal
import sys
import time

from gpu_driver import Driver

role, device, out, arg = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
drv = Driver(device)
stop = False


def on_term(signum, frame):
    global stop
    stop = True


def sibling() -> dict:
    signal.signal(signal.SIGTERM, on_term)
    st = drv.stamper(1.0, 1 << 17)
    end = time.monotonic() + arg
    first = True
    while not stop and time.monotonic() < end:
        for _ in range(64):
            st.launch()
        if first:
            print("running", flush=True)
            first = False
        drv.synchronize()
    return {"stamps": [list(s) for s in st.stamps() if s[1]]}


def holder() -> dict:
    import krex

    st = drv.stamper(1.0, 1 << 12)
    regions, clean, reasons = [], [], []
    for _ in range(int(arg)):
        first = st.n
        with krex.region(device=device, label="gpu_check overlap") as r:
            for _ in range(4):
                st.launch()
            drv.synchronize()
        regions.append((first, st.n))
        clean.append(bool(r.report.clean))
        reasons.append([reason.to_dict() for reason in r.report.reasons])
        time.sleep(0.02)
    stamps = st.stamps()
    return {"regions": [[list(s) for s in stamps[a:b]] for a, b in regions], "clean": clean,
            "reasons": reasons}


result = sibling() if role == "sibling" else holder()
with open(out, "w") as f:
    json.dump(result, f)
