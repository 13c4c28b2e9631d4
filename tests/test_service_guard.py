"""Who may talk to ``krex service`` and ``krex mcp``: tokens always, Host and Origin checked.

Through a real service on loopback (``krex.service.guard``): a request without a
token is refused even from 127.0.0.1 (``--trust-loopback`` is the only way back);
the service's own token is made at first start, owner-only, and the service says
where it is; a request whose ``Host`` is not the listener's (DNS rebinding) gets
421, one from a foreign ``Origin`` 403, while the listener's own address,
``localhost`` and a host given with ``--allow-host`` pass.
"""

from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
from service_support import Service


@pytest.fixture
def service(daemon, tmp_path):
    s = Service(tmp_path / "state", "--runners", "1")
    try:
        yield s
    finally:
        s.stop()


def test_a_loopback_request_without_a_token_is_refused(service, tmp_path):
    token_file = tmp_path / "state" / "token"
    assert token_file.exists(), "the service makes its own token at first start"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs/exec"), ("GET", "/v1/node"),
                         ("GET", "/v1/records"), ("GET", "/metrics"),
                         ("GET", "/openapi.json"), ("GET", "/v1/no/such/route")):
        body = {"program": "pass\n"} if method == "POST" else None
        status, err = service.call(method, path, body, token=False)
        assert status == 401, (path, status, err)
    # Negative control: the same requests with the token (tenant `local`).
    status, job = service.call("POST", "/v1/jobs/exec", {"program": "print(1)\n"})
    assert status == 201 and job["tenant"] == "local", job
    assert service.wait(job["id"])["state"] == "succeeded"
    assert service.call("GET", "/openapi.json")[0] == 200
    assert service.call("GET", "/v1/health", token=False)[0] == 200  # liveness stays open
    service.proc.terminate()
    _, said = service.proc.communicate(timeout=15)
    assert str(token_file) in said, said  # the service tells where its token is


def test_trust_loopback_is_the_way_back_to_tokenless_loopback(daemon, tmp_path):
    s = Service(tmp_path / "state", "--runners", "1", "--trust-loopback")
    try:
        status, job = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"}, token=False)
        assert status == 201 and job["tenant"] == "local", job
        assert s.wait(job["id"], token=False)["state"] == "succeeded"
        status, _ = s.call("GET", "/v1/jobs", headers={"Authorization": "Bearer krex_wrong"})
        assert status == 401  # a wrong token is still wrong
    finally:
        s.stop()


def test_a_rebinding_host_or_a_foreign_origin_is_refused(daemon, tmp_path):
    s = Service(tmp_path / "state", "--runners", "1", "--allow-host", "node.example")
    try:
        for host in ("evil.example", f"evil.example:{s.port}", "127.0.0.1.evil.example",
                     f"127.0.0.2:{s.port}"):
            status, err = s.call("GET", "/v1/jobs", headers={"Host": host})
            assert status == 421 and err["error"]["code"] == "misdirected_request", (host, err)
        status, _ = s.call("GET", "/", headers={"Host": "evil.example"})
        assert status == 421  # the node page too
        status, _ = s.call("GET", "/v1/health", headers={"Host": "evil.example"})
        assert status == 421
        for origin in ("http://evil.example", f"http://evil.example:{s.port}", "null"):
            status, err = s.call("GET", "/v1/jobs", headers={"Origin": origin})
            assert status == 403 and err["error"]["code"] == "forbidden_origin", (origin, err)
        # Negative controls: the listener's own address, localhost, an allowed host pass.
        for host, origin in ((f"127.0.0.1:{s.port}", f"http://127.0.0.1:{s.port}"),
                             (f"localhost:{s.port}", f"http://localhost:{s.port}"),
                             ("localhost:9000", "http://localhost:9000"),  # an ssh tunnel
                             (f"node.example:{s.port}", f"https://node.example:{s.port}")):
            status, _ = s.call("GET", "/v1/jobs", headers={"Host": host, "Origin": origin})
            assert status == 200, (host, origin, status)
            assert s.call("GET", "/", headers={"Host": host}, token=False)[0] == 200
    finally:
        s.stop()


@pytest.mark.parametrize("listen, host, ok", [
    ("127.0.0.1", "127.0.0.1:8765", True),
    ("127.0.0.1", "LOCALHOST:8765", True),
    ("127.0.0.1", "localhost:2222", True),  # an ssh tunnel's port
    ("127.0.0.1", "[::1]:8765", True),
    ("127.0.0.1", "127.0.0.1:9999", True),  # loopback names: any port (no page sends them)
    ("127.0.0.1", "127.0.0.2:8765", False),
    ("127.0.0.1", "evil.example:8765", False),
    ("127.0.0.1", "localhost.evil.example:8765", False),
    ("127.0.0.1", "", False),
    ("::1", "[::1]:8765", True),
    ("::1", "[::2]:8765", False),
    ("10.0.0.5", "10.0.0.5:8765", True),
    ("10.0.0.5", "10.0.0.6:8765", False),
    ("127.0.0.1", "node.example:1234", True),  # --allow-host node.example: any port
    ("127.0.0.1", "gpu7:8000", True),  # --allow-host gpu7:8000
    ("127.0.0.1", "gpu7:8001", False),
])
def test_allowed_hosts(listen, host, ok):
    from krex.service.guard import allowed

    hosts = allowed(listen, 8765, ["node.example", "gpu7:8000"])
    assert hosts.host(host) is ok
    assert hosts.origin(f"http://{host}") is (ok and bool(host))


def test_allowed_origins():
    from krex.service.guard import allowed

    hosts = allowed("127.0.0.1", 8765)
    assert hosts.origin("https://localhost:8765")
    for bad in ("null", "file://", "ftp://localhost:8765", "http://evil.example",
                "http://localhost:8765@evil.example", ""):
        assert not hosts.origin(bad), bad
