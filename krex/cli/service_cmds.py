"""``krex service`` (HTTP API, /metrics, node page), ``krex service token``, ``krex mcp``.

The service is its own process, a client of the node daemon (not a flag of
``krex serve``): a crash or a leak in the web stack never takes the daemon —
which holds freezes and gates — down with it, the daemon never imports the
optional extra, and one daemon can serve several front ends.  The extra
``server`` (FastAPI, uvicorn, mcp, prometheus-client) is imported only when
one of these commands runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from krex.errors import BadRequest, ServiceMissing


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", help="jobs database, tokens, job files (default "
                                       "$XDG_STATE_HOME/krex/service)")
    p.add_argument("--records", help="records database (default as for krex evaluate)")
    p.add_argument("--runners", type=int, default=8, help="jobs run at once (default 8)")
    p.add_argument("--keep-finished", type=int, metavar="N",
                   help="finished jobs kept in the jobs database, newest first; older ones "
                        "are pruned (default 20000)")
    p.add_argument("--jobs-max-mb", type=float, default=256.0, metavar="MB",
                   help="the jobs database's size at most: past it the oldest finished jobs "
                        "are pruned, whatever their count (default 256)")
    p.add_argument("--records-max-mb", type=float, metavar="MB",
                   help="the records database's size at most: past it, after an evaluation "
                        "job, the oldest evaluations are deleted (default: never; the file "
                        "is shared with krex evaluate's history)")
    p.add_argument("--max-long-polls", type=int, default=256, metavar="N",
                   help="long polls (GET /v1/jobs/ID?wait_s=) waiting at once, one tenant's "
                        "at most half; more are refused with 503 and Retry-After "
                        "(default 256)")


def _http_access(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-loopback", action="store_true",
                   help="UNSAFE on a shared machine: a request without a token from a "
                        "loopback address is tenant `local`, so every local user (and every "
                        "program they run) can run code as this service's user. Default: "
                        "every request needs a token (the service's own is in the file "
                        "`token` of --state-dir)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME[:PORT]",
                   help="also answer requests whose Host is NAME (any port) or NAME:PORT "
                        "(repeatable; the listener's address and localhost always pass; "
                        "others get 421, pages of other origins 403)")


def add_service(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="HTTP API for agents: jobs, node status, records, "
                                       "/metrics and a live node page",
                       description="Serve krex over HTTP (docs/service.md). Loopback by "
                                   "default. Every request needs an API token: the "
                                   "service's own (tenant `local`) is made at first start "
                                   "in the file `token` of --state-dir; `krex service "
                                   "token add TENANT` makes one per tenant.")
    p.add_argument("--http", default="127.0.0.1:8765", metavar="HOST:PORT",
                   help="where to listen (default 127.0.0.1:8765)")
    p.add_argument("--max-body-kb", type=int, default=256, help="request body limit (KiB)")
    _http_access(p)
    p.add_argument("--require-token", action="store_true",
                   help=argparse.SUPPRESS)  # the default now: accepted for old scripts
    _common(p)
    p.set_defaults(func=cmd_service)
    tsub = p.add_subparsers(dest="service_command", metavar="ACTION")
    token = tsub.add_parser("token", help="API tokens: add, list, remove")
    token.add_argument("action", choices=("add", "list", "remove"))
    token.add_argument("tenant", nargs="?", help="tenant name (add, remove)")
    token.add_argument("--max-active-jobs", type=int, default=32,
                       help="queued + running jobs at most (default 32)")
    token.add_argument("--max-jobs-per-minute", type=int, default=600,
                       help="submits per minute at most (default 600)")
    token.add_argument("--state-dir", help="as for krex service")
    token.set_defaults(func=cmd_token)


def add_mcp(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mcp", help="MCP server for agents (stdio or streamable HTTP)",
                       description="Serve krex's tools over MCP: evaluate, bench_command, "
                                   "exec_program, node_status, get_record.")
    p.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio")
    p.add_argument("--http", default="127.0.0.1:8766", metavar="HOST:PORT",
                   help="streamable-http: where to listen (loopback only; default "
                        "127.0.0.1:8766)")
    p.add_argument("--tenant", default="local",
                   help="the tenant its jobs run for; over streamable-http each request "
                        "needs this tenant's token (`local`'s: the file `token` of "
                        "--state-dir)")
    _http_access(p)
    _common(p)
    p.set_defaults(func=cmd_mcp)


def _config(args: argparse.Namespace, host: str = "127.0.0.1", port: int = 0,
            **extra: Any) -> Any:
    from krex.service.config import ServiceConfig

    return ServiceConfig(host=host, port=port, state_dir=args.state_dir or "",
                         records=args.records, runners=args.runners,
                         max_long_polls=args.max_long_polls, jobs_max_mb=args.jobs_max_mb,
                         records_max_mb=args.records_max_mb,
                         **({"keep_finished": args.keep_finished}
                            if args.keep_finished is not None else {}), **extra)


def _need_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import mcp  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ServiceMissing(f"krex service needs the `server` extra: {exc}") from None


def cmd_service(args: argparse.Namespace) -> int:
    from krex.service.config import parse_address

    _need_extra()
    from krex.service.malloc import fix_mmap_threshold

    fix_mmap_threshold()  # see krex/service/malloc.py
    import uvicorn

    from krex.service.app import Service, create_app

    host, port = parse_address(args.http)
    config = _config(args, host, port, max_body_bytes=args.max_body_kb * 1024,
                     **_access(args, host))
    service = Service(config)
    print(f"krex service on http://{args.http}/ (node page /#token=TOKEN, OpenAPI "
          f"/openapi.json, metrics /metrics; state {config.state_dir})", file=sys.stderr)
    _tell_token(service)
    try:
        uvicorn.run(create_app(service), host=host, port=port, log_level="warning",
                    timeout_graceful_shutdown=5)
    finally:
        service.close()
    return 0


def _access(args: argparse.Namespace, host: str) -> dict[str, Any]:
    from krex.service.config import is_loopback

    if args.trust_loopback and not is_loopback(host):
        raise BadRequest(f"--trust-loopback needs a loopback listener, not {host}",
                         hint="leave it out: clients send a token")
    return {"trust_loopback": args.trust_loopback, "allow_hosts": tuple(args.allow_host)}


def _tell_token(service: Any) -> None:
    config = service.config
    made = "made now" if service.token_made else "kept"
    print(f"krex: every request needs `Authorization: Bearer TOKEN`; this service's own "
          f"token (tenant `local`, {made}) is in {config.token_path} (mode 0600)"
          + ("; --trust-loopback: requests from loopback without a token are tenant "
             "`local`" if config.trust_loopback else ""), file=sys.stderr, flush=True)


def cmd_token(args: argparse.Namespace) -> int:
    from krex.service.config import ServiceConfig
    from krex.service.tenants import Quotas, TokenStore

    store = TokenStore(ServiceConfig(state_dir=args.state_dir or "").tokens_path)
    if args.action == "list":
        own = ServiceConfig(state_dir=args.state_dir or "").token_path
        if os.path.exists(own):
            print(f"krex: the service's own token (tenant `local`) is in {own}",
                  file=sys.stderr)
        for t in store.tenants():
            print(f"{t.name}\tmax_active_jobs={t.quotas.max_active_jobs}\t"
                  f"max_jobs_per_minute={t.quotas.max_jobs_per_minute}")
        return 0
    if not args.tenant:
        raise BadRequest(f"krex service token {args.action} needs a tenant name",
                         hint="e.g. krex service token add agent-7")
    if args.action == "remove":
        if not store.remove(args.tenant):
            raise BadRequest(f"no tenant {args.tenant!r}", hint="krex service token list")
        return 0
    token = store.add(args.tenant, Quotas(args.max_active_jobs, args.max_jobs_per_minute))
    print(token)
    print(f"krex: token for tenant {args.tenant!r} (shown once; stored hashed in "
          f"{store.path})", file=sys.stderr)
    return 0


def serve_http(server: Any, service: Any, tenant: str) -> None:
    """``krex mcp``'s streamable HTTP behind the service's guard: its Host and Origin
    lists and ``tenant``'s token (the SDK's own rebinding check, which knows neither
    ``--allow-host`` nor tokens, is replaced by it)."""
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings

    from krex.service.app import authenticator
    from krex.service.guard import Guard, allowed

    config = service.config
    app = server.streamable_http_app(host=config.host, transport_security=(
        TransportSecuritySettings(enable_dns_rebinding_protection=False)))
    guarded = Guard(app, allowed(config.host, config.port, config.allow_hosts),
                    authenticator(service, only=tenant))
    uvicorn.run(guarded, host=config.host, port=config.port,
                log_level=server.settings.log_level.lower(),
                timeout_graceful_shutdown=5)


def cmd_mcp(args: argparse.Namespace) -> int:
    from krex.service.config import is_loopback, parse_address
    from krex.service.tenants import check_name

    _need_extra()
    from krex.service.malloc import fix_mmap_threshold

    fix_mmap_threshold()  # see krex/service/malloc.py
    from krex.service.app import Service
    from krex.service.mcp_server import build

    host, port = parse_address(args.http)
    if args.transport == "streamable-http" and not is_loopback(host):
        raise BadRequest(f"krex mcp listens on loopback only, not {host}",
                         hint="use `krex service` with API tokens for other hosts")
    service = Service(_config(args, host, port, **_access(args, host)),
                      jobs_name="jobs-mcp.sqlite3")
    server = build(service, tenant=check_name(args.tenant))
    try:
        if args.transport == "stdio":
            server.run("stdio")
        else:
            print(f"krex mcp on http://{args.http}/mcp (tenant {args.tenant})",
                  file=sys.stderr)
            _tell_token(service)
            serve_http(server, service, args.tenant)
    finally:
        service.close()
    return 0
