"""service: krex for agent fleets — HTTP, MCP, ``/metrics`` and a live node page.

In: HTTP requests (``krex service``, a FastAPI app under uvicorn) and MCP tool
calls (``krex mcp``, the ``mcp`` SDK, stdio or streamable HTTP), each on
behalf of a tenant (an API token's tenant: every request needs one, see
``guard``).  Out:
jobs — an evaluation, an exec, a bench — run through the node daemon as a
client (``krex.client``, ``krex.evaluate``, ``krex.measure``), their results
in a form an agent reads, the records store, Prometheus metrics and the node
page.  Transports only: no scheduling, no enforcement; the daemon shares the
devices.  The optional dependencies (extra ``server``) are imported only here,
and only by ``krex service`` / ``krex mcp``.

Modules: ``config`` (``ServiceConfig``), ``tenants`` (tenants, quotas, hashed
tokens), ``guard`` (Host, Origin and token of every HTTP request), ``jobs``
(the job store: idempotency keys, states, long-poll, cancel; SQLite), ``work``
(what each job kind runs, and the one place a tenant is handed to the daemon),
``child`` (an evaluation or a bench in a process of its own: what a cancel
kills), ``schemas`` (validated request bodies), ``node`` (the daemon watched:
status, recent regions, attribution to tenants), ``metrics`` (Prometheus),
``page`` (the live node page), ``app`` (the HTTP routes), ``mcp_server`` (the
MCP tools), ``summary`` (results an agent can read). See docs/service.md.
"""
