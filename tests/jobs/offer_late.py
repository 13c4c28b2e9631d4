"""A job that is offered its re-queued region and lets the offer go stale, then asks.

It takes plain regions back to back (taking no offer), so that it and the other job
are queued at each other's releases, until, after a release, an offer comes (the
daemon re-queued this job; its turn came and it was thawed).  (A job that paused
between its regions was seldom queued at the other's release: it is frozen while
the other holds, so it asks only in the gaps.)  It
then sleeps past the claim window and its grace (argv[2]: the daemon's --requeue-ms in
seconds; argv[3], default 3: the sleep, in windows), so the daemon lapses the region,
and asks again:

- ``normal``: as the client does: the stale offer is not taken;
- ``late``: the client is made to take it anyway (its claim leaves after the window):
  it must wait for the claim's answer and, the region lapsed, ask as usual;
- ``lie``: the offer is made to say its window is still open, so the client takes it
  without waiting: the region's release must raise ``offer_lapsed``, never pass as held;
- ``split``: the offer is taken at once, but its claim reaches the daemon's socket in
  two parts, the second after the sleep: as a claim sent in time but read late by a
  daemon short of CPU.  Unread input on the connection holds the lapse back (at most
  ``MAX_LAPSE_WAITS`` more windows), so it is the job's region.

Prints one JSON line: the offered region, the region it got, whether that came from
the offer, and the error code its release raised (if any)."""

import json
import sys
import threading
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
take_offers = c.conn._offer_for
c.conn._offer_for = lambda message: None  # type: ignore[method-assign]
for i in range(300):
    r = c.acquire(job, "cpu")["region"]
    busy(5)
    c.release(r)
    if i < 5:  # the chain of handoffs forms
        continue
    def fresh() -> list[dict]:  # not of a region this job was granted already
        return [o for o in c.conn.offers.values() if o["region"] > c.conn._newest_region]

    until = time.monotonic() + 0.3  # the other's region (20 ms), then this job's offer
    while not fresh() and time.monotonic() < until:
        c.conn._read_ready()
        time.sleep(0.001)
    if fresh():
        offer = dict(max(fresh(), key=lambda o: o["region"]))
        break
c.conn._offer_for = take_offers  # type: ignore[method-assign]
if offer is None:
    st = c.status()
    print(json.dumps({"counters": st["counters"], "early": list(c.conn._early),
                      "revoked": c.conn.revoked, "newest": c.conn._newest_region,
                      "scheduler": st["scheduler"]}), file=sys.stderr)
assert offer is not None, "no offer came"
if mode == "split":
    class _Split:  # the claim's first bytes now, the rest after the sleep (a thread's)
        def __init__(self, sock):
            self._sock = sock
            self._tail = None

        def __getattr__(self, name):
            return getattr(self._sock, name)

        def sendall(self, data):
            if self._tail is not None:  # later frames follow the claim's
                self._tail.join()
                return self._sock.sendall(data)
            self._sock.sendall(data[:3])

            def rest():
                time.sleep(windows * window_s)
                self._sock.sendall(data[3:])

            self._tail = threading.Thread(target=rest)
            self._tail.start()
            return None

    c.conn.sock = _Split(c.conn.sock)
else:
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
