"""``krex mcp`` over stdio, driven by the MCP SDK's own client; and ``evaluate`` over HTTP.

The session lists the five tools with their schemas and runs ``evaluate`` end to
end against a real daemon (an honest candidate that is 2x faster: verdict
``faster``, its record readable through ``get_record``); a tool given bad
arguments answers an error, not a crash, and the session goes on.
"""

from __future__ import annotations

import json
import os
import socket

import anyio
import pytest
from evaluate_helpers import CPU, spec
from helpers import PY

mcp = pytest.importorskip("mcp", reason="the `server` extra is not installed")
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

TOOLS = {"evaluate", "bench_command", "exec_program", "node_status", "get_record"}
FASTER = {"source": "import numpy as np\n\n\ndef fast(x):\n"
                    "    return x * np.sqrt(x * x + np.float32(1.0))\n", "function": "fast"}


def structured(result) -> dict:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        data = result.structured_content
        return data.get("result", data) if set(data) == {"result"} else data
    return json.loads(result.content[0].text)


async def session_run(tmp_path, body) -> None:
    params = StdioServerParameters(
        command=PY, args=["-m", "krex", "mcp", "--state-dir", str(tmp_path / "state"),
                          "--records", str(tmp_path / "records.sqlite3"), "--runners", "2"],
        env=dict(os.environ))
    with open(tmp_path / "mcp-stderr.log", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            await body(session)


def test_mcp_session_lists_tools_and_runs_evaluate_end_to_end(daemon, tmp_path):
    seen: dict = {}

    async def body(session: ClientSession) -> None:
        tools = (await session.list_tools()).tools
        seen["tools"] = {t.name: t.input_schema for t in tools}
        ev = structured(await session.call_tool("evaluate", {
            "reference": spec(CPU, "kernels.py:reference"), "candidate": FASTER,
            "inputs": spec(CPU, "inputs.py:make"), "cache": "hot", "seeds": 2}))
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
    assert ev["ci_low"] <= ev["speedup"] <= ev["ci_high"] and ev["ci_low"] > 1.0
    assert ev["reference"]["p50_ms"] > ev["candidate"]["p50_ms"] > 0
    assert ev["record_id"] and seen["record"]["id"] == ev["record_id"]
    assert seen["bad"].is_error and "exactly one of" in seen["bad"].content[0].text
    missing = seen["missing"].content[0].text
    assert seen["missing"].is_error and "record_not_found" in missing and "hint:" in missing
    assert seen["exec"]["exit_code"] == 0 and "mcp ['z']" in seen["exec"]["stdout"]
    assert {d["name"] for d in seen["node"]["devices"]} >= {"cpu"}


def test_mcp_over_streamable_http(daemon, tmp_path):
    """The second transport: loopback only, the same tools."""
    from helpers import krex, reap, wait_for
    from mcp.client.streamable_http import streamable_http_client
    from test_service_http import free_port

    port = free_port()
    proc = krex("mcp", "--transport", "streamable-http", "--http", f"127.0.0.1:{port}",
                "--state-dir", str(tmp_path / "state"), "--records",
                str(tmp_path / "records.sqlite3"))
    seen: dict = {}

    async def body() -> None:
        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            seen["tools"] = {t.name for t in (await session.list_tools()).tools}
            seen["exec"] = structured(await session.call_tool(
                "exec_program", {"program": "import sys\nsys.exit(3)\n"}))

    def listening() -> bool:
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, timeout_s=60, interval_s=0.1)
        anyio.run(body)
    finally:
        reap(proc, timeout_s=15)
    assert TOOLS <= seen["tools"]
    assert seen["exec"]["exit_code"] == 3 and seen["exec"]["status"] == "error"


def test_mcp_http_listens_on_loopback_only(tmp_path):
    from helpers import run_krex

    out = run_krex("mcp", "--transport", "streamable-http", "--http", "0.0.0.0:8766",
                   "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 1 and "loopback only" in out.stderr
