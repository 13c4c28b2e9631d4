"""An MCP session with ``krex mcp`` over stdio, through the MCP SDK's own client (no
tests here).  Importing this module skips the importing test module where the ``server``
extra (which brings the SDK) is not installed."""

from __future__ import annotations

import json
import os

import pytest
from helpers import PY

pytest.importorskip("mcp", reason="the `server` extra is not installed")
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


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
