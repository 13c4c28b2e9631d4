"""``krex mcp`` over stdio, driven by the MCP SDK's own client; and ``evaluate`` over HTTP.

The session lists the five tools with their schemas and runs ``evaluate`` end to
end against a real daemon (an honest candidate that is 2x faster: verdict
``faster``, its record readable through ``get_record``); a tool given bad
arguments answers an error, not a crash, and the session goes on.
"""

from __future__ import annotations

import json
import socket

import anyio
import pytest
from evaluate_helpers import CPU, spec
from mcp_support import session_run, structured
from skill_fields import EVALUATE_FIELDS, FINDING_FIELDS, keys_of

mcp = pytest.importorskip("mcp", reason="the `server` extra is not installed")
from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

TOOLS = {"evaluate", "evaluate_kernelbench", "bench_command", "exec_program", "node_status",
         "get_record"}
FASTER = {"source": "import numpy as np\n\n\ndef fast(x):\n"
                    "    return x * np.sqrt(x * x + np.float32(1.0))\n", "function": "fast"}


def test_mcp_session_lists_tools_and_runs_evaluate_end_to_end(daemon, tmp_path):
    seen: dict = {}

    async def body(session: ClientSession) -> None:
        tools = (await session.list_tools()).tools
        seen["tools"] = {t.name: t.input_schema for t in tools}
        ev = structured(await session.call_tool("evaluate", {
            "reference": spec(CPU, "kernels.py:reference"), "candidate": FASTER,
            "inputs": spec(CPU, "inputs.py:make"), "cache": "hot", "seeds": 2,
            "atol": 1e-4, "rtol": 1e-3}))
        seen["evaluate"] = ev
        seen["record"] = structured(await session.call_tool("get_record",
                                                            {"record_id": ev["record_id"]}))
        bad = await session.call_tool("exec_program", {"program": "pass", "path": "/x.py"})
        seen["bad"] = bad
        seen["missing"] = await session.call_tool("get_record", {"record_id": "nosuchrecord"})
        seen["exec"] = structured(await session.call_tool(
            "exec_program", {"program": "import sys\nprint('mcp', sys.argv[1:])\n",
                             "args": ["z"]}))
        seen["node"] = structured(await session.call_tool("node_status", {}))

    anyio.run(session_run, tmp_path, body)
    assert TOOLS <= set(seen["tools"])
    assert {"reference", "candidate", "inputs"} <= set(seen["tools"]["evaluate"]["properties"])
    ev = seen["evaluate"]
    assert ev["verdict"] == "faster" and ev["correct"] is True, ev
    top = EVALUATE_FIELDS - FINDING_FIELDS  # SKILL.md's fields (findings: if any)
    assert top <= keys_of(ev), top - keys_of(ev)
    assert ev["ci_low"] <= ev["speedup"] <= ev["ci_high"] and ev["ci_low"] > 1.0
    assert ev["reference"]["p50_ms"] > ev["candidate"]["p50_ms"] > 0
    assert ev["record_id"] and seen["record"]["id"] == ev["record_id"]
    # the tolerances WRONG_OUTPUT's next action points at reach the evaluation
    assert {"atol", "rtol"} <= set(seen["tools"]["evaluate"]["properties"])
    assert (seen["record"]["options"]["atol"], seen["record"]["options"]["rtol"]) == (1e-4, 1e-3)
    assert seen["bad"].is_error and "exactly one of" in seen["bad"].content[0].text
    missing = seen["missing"].content[0].text
    assert seen["missing"].is_error and "record_not_found" in missing and "hint:" in missing
    assert seen["exec"]["exit_code"] == 0 and "mcp ['z']" in seen["exec"]["stdout"]
    assert {d["name"] for d in seen["node"]["devices"]} >= {"cpu"}


def start_mcp_http(tmp_path, *flags: str):
    """``krex mcp --transport streamable-http`` on a free port, once it listens."""
    from helpers import krex, wait_for
    from service_support import free_port

    port = free_port()
    proc = krex("mcp", "--transport", "streamable-http", "--http", f"127.0.0.1:{port}",
                "--state-dir", str(tmp_path / "state"), "--records",
                str(tmp_path / "records.sqlite3"), *flags)

    def listening() -> bool:
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, timeout_s=60, interval_s=0.1)
    return proc, port


def post_mcp(port: int, headers: dict[str, str]) -> int:
    """The status of an MCP ``initialize`` POSTed with ``headers``."""
    import urllib.error
    import urllib.request

    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"}}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/mcp", method="POST",
                                 data=json.dumps(body).encode(), headers={
                                     "Content-Type": "application/json",
                                     "Accept": "application/json, text/event-stream",
                                     **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_mcp_over_streamable_http(daemon, tmp_path):
    """The second transport: loopback only, the same tools, with the tenant's token."""
    from helpers import reap
    from mcp.shared._httpx_utils import create_mcp_http_client

    proc, port = start_mcp_http(tmp_path)
    token = (tmp_path / "state" / "token").read_text().strip()
    seen: dict = {}

    async def body() -> None:
        async with create_mcp_http_client(headers={"Authorization": f"Bearer {token}"}) as c, \
                streamable_http_client(f"http://127.0.0.1:{port}/mcp", http_client=c) as (
                    read, write), ClientSession(read, write) as session:
            await session.initialize()
            seen["tools"] = {t.name for t in (await session.list_tools()).tools}
            seen["exec"] = structured(await session.call_tool(
                "exec_program", {"program": "import sys\nsys.exit(3)\n"}))

    try:
        anyio.run(body)
    finally:
        reap(proc, timeout_s=15)
    assert TOOLS <= seen["tools"]
    assert seen["exec"]["exit_code"] == 3 and seen["exec"]["status"] == "error"
    assert seen["exec"]["state"] == "failed" and seen["exec"]["outcome"] == "failed"


def test_mcp_over_http_needs_its_tenants_token_and_an_allowed_host(tmp_path):
    """No token, another tenant's token, a rebinding Host, a foreign Origin: refused
    before the SDK sees the request.  Negative controls: the served tenant's token
    passes, and ``--trust-loopback`` lets a loopback request without one through."""
    from helpers import reap, run_krex

    other = run_krex("service", "token", "add", "other", "--state-dir",
                     str(tmp_path / "state")).stdout.strip()
    proc, port = start_mcp_http(tmp_path)
    try:
        token = (tmp_path / "state" / "token").read_text().strip()
        mine = {"Authorization": f"Bearer {token}"}
        assert post_mcp(port, {}) == 401
        assert post_mcp(port, {"Authorization": f"Bearer {other}"}) == 401
        assert post_mcp(port, {**mine, "Host": "evil.example"}) == 421
        assert post_mcp(port, {**mine, "Host": f"127.0.0.2:{port}"}) == 421
        assert post_mcp(port, {**mine, "Origin": "http://evil.example"}) == 403
        assert post_mcp(port, mine) == 200
        assert post_mcp(port, {**mine, "Host": f"localhost:{port}",
                               "Origin": f"http://localhost:{port}"}) == 200
    finally:
        reap(proc, timeout_s=15)
    proc, port = start_mcp_http(tmp_path, "--trust-loopback")
    try:
        assert post_mcp(port, {}) == 200
        assert post_mcp(port, {"Host": "evil.example"}) == 421  # still checked
    finally:
        reap(proc, timeout_s=15)


def test_mcp_http_listens_on_loopback_only(tmp_path):
    from helpers import run_krex

    out = run_krex("mcp", "--transport", "streamable-http", "--http", "0.0.0.0:8766",
                   "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 1 and "loopback only" in out.stderr
