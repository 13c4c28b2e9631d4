"""A job that is offered its re-queued region and lets the offer go stale, then asks.

It takes plain regions until, after a release, an offer comes (another job waited at
that release, so the daemon re-queued this one; its turn came and it was thawed).  It
then sleeps past the claim window and its grace (argv[2]: the daemon's --requeue-ms in
seconds; argv[3], default 3: the sleep, in windows), so the daemon lapses the region,
and asks again:

- ``normal``: as the client does: the stale offer is not taken;
- ``late``: the client is made to take it anyway (its claim leaves after the window):
  it must wait for the claim's answer and, the region lapsed, ask as usual;
- ``lie``: the offer is made to say its window is still open, so the client takes it
  without waiting: the region's release must raise ``offer_lapsed``, never pass as held.

Prints one JSON line: the offered region, the region it got, whether that came from
the offer, and the error code its release raised (if any)."""

import sys
import time

from b2b_common import busy, emit

from krex.client import connection
from krex.client.connection import Client
from krex.errors import KrexError

mode, window_s = sys.argv[1], float(sys.argv[2])
windows = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
c = Client(autostart=False)
job = c.register()["job_id"]
offer = None
for _ in range(20):
    r = c.acquire(job, "cpu")["region"]
    busy(5)
    c.release(r)
    until = time.monotonic() + 2
    while not c.conn.offers and time.monotonic() < until:
        c.conn._read_ready()
        time.sleep(0.001)
    if c.conn.offers:
        offer = dict(max(c.conn.offers.values(), key=lambda o: o["region"]))
        break
assert offer is not None, "no offer came"
time.sleep(windows * window_s)  # by default the window and its grace passed: lapsed
c.conn._read_ready()
if mode == "late":
    connection.OFFER_MARGIN_S = -3600.0
elif mode == "lie":
    c.conn.offers[offer["region"]]["claim_by_mono_s"] = time.monotonic() + 3600.0
grant = c.acquire(job, "cpu")
error = None
try:
    busy(5)
    c.release(grant["region"])
except KrexError as exc:
    error = exc.code
emit({"offer": offer["region"], "region": grant["region"],
      "offered": bool(grant.get("offered")), "error": error})
