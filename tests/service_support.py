"""A real ``krex service`` for the service tests (no tests here).

:class:`Service` starts one on a free loopback port and speaks HTTP to it with the
standard library; :func:`regions_by_label` reads the daemon's own record of the
regions it charged.  The ``service`` and ``quota_daemon`` fixtures are in conftest.py.
Importing this module skips the importing test module where the ``server`` extra is
not installed.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import krex, reap, wait_for

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
pytest.importorskip("uvicorn", reason="the `server` extra is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A running ``krex service`` on a free loopback port."""

    def __init__(self, state: Path, *flags: str) -> None:
        self.port = free_port()
        self.state = state
        self.base = f"http://127.0.0.1:{self.port}"
        self.token: str | None = None  # the service's own token (tenant `local`), once made
        self.proc = krex("service", "--http", f"127.0.0.1:{self.port}", "--state-dir",
                         str(state), "--records", str(state / "records.sqlite3"), *flags)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited: {self.proc.communicate()}")
            try:
                return self.call("GET", "/v1/health")[0] == 200
            except OSError:
                return False
        wait_for(up, timeout_s=60, interval_s=0.1)
        if (state / "token").exists():
            self.token = (state / "token").read_text().strip()

    def call(self, method: str, path: str, body: object = None, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 60,
             token: bool = True) -> tuple[int, dict]:
        """A request; with the service's own token unless ``token=False`` (or ``headers``
        has another ``Authorization``)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        auth = {"Authorization": f"Bearer {self.token}"} if token and self.token else {}
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **auth,
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                text = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            text, status = e.read(), e.code
        try:
            return status, json.loads(text)
        except ValueError:
            return status, {"text": text.decode()}

    def wait(self, job_id: str, wait_s: float = 30, **kw) -> dict:
        status, job = self.call("GET", f"/v1/jobs/{job_id}?wait_s={wait_s}", **kw)
        assert status == 200, job
        return job

    def stop(self) -> None:
        reap(self.proc, timeout_s=15)


def regions_by_label() -> dict[str, list[str]]:
    """The daemon's own record of finished regions: label -> the tenants they were charged to."""
    from krex.client.connection import Client

    with Client(autostart=False) as client:
        out: dict[str, list[str]] = {}
        for r in client.regions():
            out.setdefault(str(r.get("label")), []).append(str(r.get("tenant")))
        return out
