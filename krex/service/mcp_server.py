"""The MCP server (``krex mcp``): krex's jobs as tools, over stdio or streamable HTTP.

Tools: ``evaluate``, ``bench_command``, ``exec_program``, ``node_status``,
``get_record``.  Each validates its arguments with the same models as the
HTTP API (``schemas``), runs as a job of this process's own job store (one
tenant: ``--tenant``, default ``local``; over streamable HTTP every request
needs that tenant's token: ``krex.cli.service_cmds.serve_http``) and answers with a result an agent
can read (``summary``): verdict, speedup and interval, findings with their
next action, p50/p95, noise, record id.  A job that fails answers with its
error (code, what, hint) as the tool's error.  A call the client cancels
(MCP's cancel notification) cancels its job: a running program is stopped.

Memory: the SDK's streamable-HTTP transport parses each POST body with
``pydantic_core.from_json``, whose default keeps every short string it meets in
a process-wide cache of 16384 slots (≈ 0.9 MiB once full): each call's unique
strings (a program's arguments, ids) filled it over ~16k calls, which a
long-lived ``krex mcp`` showed as RSS growing for its first quarter hour
(docs/notes/service-memory.md).  :func:`parse_without_string_cache` makes the transport
keep only the bodies' keys (few, repeated); ``KREX_MCP_JSON_STRING_CACHE=1``
leaves the SDK as it is (the control of ``tests/test_service_memory.py``).
"""

from __future__ import annotations

import os
import types
from typing import Any

import anyio
import pydantic_core
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import ValidationError

from krex.errors import KrexError
from krex.service import schemas
from krex.service.app import Service

INSTRUCTIONS = """krex times GPU (and CPU) kernels correctly on a shared node: each
measurement holds the device exclusively only while it times. Use `evaluate` to ask
"is my candidate correct and faster than the reference?" (read `verdict`, `speedup`
with `ci_low`/`ci_high`, and every finding's `next_action`); `bench_command` to time a
whole command; `exec_program` to run a Python program in a warm worker; `node_status`
to see devices, holders and queues; `get_record` to read a stored evaluation."""


STRING_CACHE_ENV = "KREX_MCP_JSON_STRING_CACHE"  # 1: leave the SDK's body parsing as it is


def parse_without_string_cache() -> bool:
    """Make the SDK's streamable-HTTP transport parse bodies caching only their keys;
    True if it does now (False: ``KREX_MCP_JSON_STRING_CACHE=1``, or an SDK without
    that module attribute)."""
    from mcp.server import streamable_http

    if os.environ.get(STRING_CACHE_ENV) == "1":
        return False
    if getattr(streamable_http, "pydantic_core", None) is not pydantic_core:
        return isinstance(getattr(streamable_http, "pydantic_core", None),
                          types.SimpleNamespace)
    names = {n: getattr(pydantic_core, n) for n in dir(pydantic_core) if not n.startswith("__")}
    streamable_http.pydantic_core = types.SimpleNamespace(  # type: ignore[assignment]
        **{**names, "from_json": _from_json_keys_cached})
    return True


def _from_json_keys_cached(data: Any, **kw: Any) -> Any:
    return pydantic_core.from_json(data, **{"cache_strings": "keys", **kw})


def build(service: Service, tenant: str = "local", wait_s: float = 3600.0) -> MCPServer:
    parse_without_string_cache()
    server = MCPServer("krex", instructions=INSTRUCTIONS)
    who = service.tokens.named(tenant)  # its quotas: its entry in tokens.json, if any

    async def run(kind: str, args: dict[str, Any]) -> dict[str, Any]:
        try:
            body = schemas.BODIES[kind].model_validate(
                {k: v for k, v in args.items() if v is not None})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "arguments"
            raise ToolError(f"invalid_request: {where}: {first.get('msg')} (hint: see the "
                            f"tool's input schema)") from None
        try:
            job, _ = service.jobs.submit(who, kind, schemas.job_request(kind, body))
        except KrexError as exc:
            raise _tool_error(exc) from None
        try:
            done = await anyio.to_thread.run_sync(service.jobs.wait, who.name, job.id, wait_s,
                                                  abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            service.jobs.cancel(who.name, job.id)  # the client cancelled the call: stop it
            raise
        if done.error:
            hint = done.error.get("hint")
            raise ToolError(f"{done.error['code']}: {done.error['what']}"
                            + (f" (hint: {hint})" if hint else ""))
        return {"job_id": done.id, "state": done.state, **(done.result or {})}

    @server.tool()
    async def evaluate(reference: str | schemas.Source, candidate: str | schemas.Source,
                       inputs: str | schemas.Source, device: str | None = None,
                       seeds: int = 3, shapes: list[Any] | None = None,
                       atol: float | None = None, rtol: float | None = None,
                       cache: str = "cold", timeout_s: float = 120.0,
                       fresh: bool = False) -> dict[str, Any]:
        """Is the candidate correct against the reference, and faster?  Each of reference,
        candidate, inputs is "path.py:function" or {"source": ..., "function": ...};
        inputs(seed) or inputs(seed, shape) returns the arguments; atol/rtol override the
        output dtype's default tolerances.  Answers verdict
        (faster/slower/same/unclear/invalid), speedup [ci_low, ci_high], correct,
        findings (code, severity, message, next_action), p50/p95 and noise of each
        side, region_clean and record_id; reused (a decided record answered again) or
        pooled_pairs and extends (an unclear record's pairs pooled with new ones)."""
        return await run("evaluate", dict(
            reference=_plain(reference), candidate=_plain(candidate), inputs=_plain(inputs),
            device=device, seeds=seeds, shapes=shapes, atol=atol, rtol=rtol, cache=cache,
            timeout_s=timeout_s, fresh=fresh))

    @server.tool()
    async def evaluate_kernelbench(problem: str | schemas.FileSource,
                                   solution: str | schemas.FileSource,
                                   device: str | None = None, seeds: int = 3,
                                   atol: float | None = None, rtol: float | None = None,
                                   cache: str = "cold", timeout_s: float = 120.0,
                                   fresh: bool = False) -> dict[str, Any]:
        """evaluate, for a KernelBench pair: the problem file (Model, get_inputs,
        get_init_inputs) and the solution file (ModelNew), each "path.py" on this node or
        {"source": ...}.  Both models get the same seeded weights; answers as evaluate."""
        return await run("evaluate", dict(
            problem=_plain(problem), solution=_plain(solution), device=device, seeds=seeds,
            atol=atol, rtol=rtol, cache=cache, timeout_s=timeout_s, fresh=fresh))

    @server.tool()
    async def bench_command(command: str, device: str | None = None, runs: int | None = None,
                            budget_s: float = 1.0, warmup: int = 1) -> dict[str, Any]:
        """Time a shell command inside a region: p50_ms, p95_ms, noise_rel, runs,
        exit codes, region_clean, waited_s and held_s, warnings with their next action."""
        return await run("bench", dict(command=command, device=device, runs=runs,
                                       budget_s=budget_s, warmup=warmup))

    @server.tool()
    async def exec_program(program: str | None = None, path: str | None = None,
                           args: list[str] | None = None, device: str | None = None,
                           timeout_s: float = 60.0) -> dict[str, Any]:
        """Run a Python program (its source as `program`, or a `path` on this node) in a
        warm worker: state (succeeded only when it exited 0; else failed, timed_out,
        crashed), status, exit_code, stdout, stderr, traceback, duration_s."""
        return await run("exec", dict(program=program, path=path, args=args or [],
                                      device=device, timeout_s=timeout_s))

    @server.tool()
    async def node_status() -> dict[str, Any]:
        """Devices and who holds them, queues, warm workers, recent regions' tenants'
        shares and recent evaluations."""
        await anyio.to_thread.run_sync(service.node.poll_once)
        return service.summary(tenant, 300.0)

    @server.tool()
    async def get_record(record_id: str) -> dict[str, Any]:
        """A stored evaluation by id (or a unique prefix of 6+ characters), with its
        region reports."""
        try:
            return service.record(tenant, record_id)
        except KrexError as exc:
            raise _tool_error(exc) from None

    return server


def _tool_error(exc: KrexError) -> ToolError:
    """A krex error as the tool's answer (an agent reads its code, what and hint)."""
    return ToolError(f"{exc.code}: {exc.message}" + (f" (hint: {exc.hint})" if exc.hint else ""))


def _plain(value: Any) -> Any:
    return value.model_dump() if isinstance(value, schemas.Source | schemas.FileSource) else value
