"""Long polls are bounded, in all and per tenant, and refused past the bound with 503 and
Retry-After instead of queueing (issue 44), through a real service.

``--max-long-polls 4``: one tenant may have 2 waiting at once.  Alice's third is refused
while her two wait; Bob's two are accepted (his own half), and then the service is full
for everyone.  Control: once the waits end, a long poll is accepted again.
"""

from __future__ import annotations

import threading

import pytest
from helpers import run_krex, wait_for
from service_support import Service

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
pytestmark = pytest.mark.timeout(120)

SLEEP = "import sys, time; time.sleep(float(sys.argv[1]))"


def test_long_polls_past_the_bound_are_refused_with_retry_after(daemon, tmp_path):
    state = tmp_path / "state"
    tokens = {name: run_krex("service", "token", "add", name, "--state-dir",
                             str(state)).stdout.strip() for name in ("alice", "bob")}
    auth = {name: {"Authorization": f"Bearer {t}"} for name, t in tokens.items()}
    s = Service(state, "--runners", "1", "--max-long-polls", "4")
    waits: list[threading.Thread] = []
    try:
        def submit(who: str, seconds: float) -> str:
            status, job = s.call("POST", "/v1/jobs/exec", {"program": SLEEP, "args": [
                str(seconds)], "device": "cpu"}, headers=auth[who])
            assert status in (200, 201, 202), job
            return job["id"]

        blocker = submit("alice", 30)  # holds the one runner: the jobs below stay queued
        queued = {who: submit(who, 0) for who in ("alice", "bob")}

        def poll(who: str, wait_s: float) -> tuple[int, dict]:
            return s.call("GET", f"/v1/jobs/{queued[who]}?wait_s={wait_s}",
                          headers=auth[who])

        def waiting() -> int:
            status, body = s.call("GET", "/metrics")
            line = next(x for x in body["text"].splitlines()
                        if x.startswith("krex_service_long_polls_waiting "))
            return int(float(line.split()[1]))

        def park(who: str) -> None:
            before = waiting()
            t = threading.Thread(target=poll, args=(who, 30), daemon=True)
            t.start()
            waits.append(t)
            wait_for(lambda: waiting() == before + 1, timeout_s=20, interval_s=0.02)

        park("alice")
        park("alice")
        status, body = poll("alice", 0.2)
        assert status == 503, body
        assert body["error"]["code"] == "service_busy", body
        assert "tenant 'alice' has 2 long polls" in body["error"]["what"], body
        status, _ = poll("bob", 0.2)
        assert status == 200, "bob's own half is free"
        park("bob")
        park("bob")
        status, body = poll("bob", 0.2)
        assert status == 503 and "4 long polls are waiting" in body["error"]["what"], body
        # the Retry-After header, seen through the raw response
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"{s.base}/v1/jobs/{queued['bob']}?wait_s=1",
                                     headers=auth["bob"])
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 503 and err.value.headers["Retry-After"] == "1"
        # control: the waits end (the blocker is cancelled, the queued jobs run) ...
        s.call("POST", f"/v1/jobs/{blocker}/cancel", headers=auth["alice"])
        for t in waits:
            t.join(60)
        # ... and a long poll is accepted again
        status, job = poll("alice", 1)
        assert status == 200 and job["state"] == "succeeded", job
    finally:
        s.stop()
