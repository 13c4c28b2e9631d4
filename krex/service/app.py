"""The HTTP API (FastAPI): jobs, node status, records, ``/metrics`` and the node page.

Routes (OpenAPI at ``/openapi.json``):

* ``POST /v1/jobs/{evaluate,exec,bench}`` — submit; header ``Idempotency-Key``
  (a retried submit returns the same job: 200, a new job: 201);
* ``GET /v1/jobs`` (the tenant's jobs), ``GET /v1/jobs/{id}?wait_s=N`` (long
  poll), ``POST /v1/jobs/{id}/cancel``;
* ``GET /v1/node`` (the daemon's status and the service's queues),
  ``GET /v1/node/summary`` (the node page's data), ``GET /v1/records``,
  ``GET /v1/records/{id}``, ``GET /metrics``, ``GET /`` (the page).

Every request passes :class:`krex.service.guard.Guard` first: an allowed
``Host`` and ``Origin``, and a token on every route but ``/`` (the page, which
reads its token from its fragment) and ``/v1/health``.

Errors are ``{"error": {"code", "what", "hint"}}`` with the right status:
400 malformed JSON, 401 token, 403 foreign Origin, 404 job/record, 409
idempotency conflict, 413 body too large, 421 Host not this service's, 422
invalid fields, 429 quota, 503 no daemon.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and
# the local aliases (who_t, key_t) must be evaluated where they are defined.

import math
import re
import time
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response

from krex.errors import (
    BadRequest,
    DaemonNotRunning,
    IdempotencyConflict,
    JobNotFound,
    KrexError,
    QuotaExceeded,
    RecordNotFound,
    RecordsError,
    ServiceBusy,
    ServiceQuotaExceeded,
    Unauthorized,
)
from krex.service import schemas, scope
from krex.service.config import ServiceConfig, is_loopback
from krex.service.guard import Guard, allowed
from krex.service.jobs import JobStore, error_body
from krex.service.longpoll import LongPolls
from krex.service.metrics import Metrics
from krex.service.node import NodeWatcher
from krex.service.page import PAGE
from krex.service.tenants import Tenant, TokenStore, own_token, resolve
from krex.service.work import Work, daemon_client

KEY = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
STATUS = {Unauthorized: 401, JobNotFound: 404, RecordNotFound: 404, IdempotencyConflict: 409,
          ServiceQuotaExceeded: 429, QuotaExceeded: 429, BadRequest: 400,
          DaemonNotRunning: 503, RecordsError: 503, ServiceBusy: 503}
OPEN_PATHS = ("/", "/v1/health")  # no token: the page (static; its data needs one), liveness


class Service:
    """Everything one service process runs: tokens, jobs, the node watcher, metrics."""

    def __init__(self, config: ServiceConfig, jobs_name: str = "jobs.sqlite3") -> None:
        import os

        from krex import memtrace

        memtrace.install()  # KREX_TRACEMALLOC=PATH: what this process keeps (off: nothing)
        _owner_only(config)
        self.config = config
        self.tokens = TokenStore(config.tokens_path)
        self.token, self.token_made = own_token(self.tokens, config.token_path)
        self.node = NodeWatcher(daemon_client, config.node_poll_s,
                                config.timeline_s)
        self.work = Work(config, finished=self._finished)
        self.jobs = JobStore(os.path.join(config.state_dir, jobs_name), self.work.kinds(),
                             config.runners, admit=self.work.admit, stop=self.work.stop,
                             keep_finished=config.keep_finished,
                             max_bytes=int(config.jobs_max_mb * 2**20))
        self.metrics = Metrics(self.jobs, self.node)
        self.long_polls = self.metrics.long_polls = LongPolls(config.max_long_polls)
        self.node.on_region = self.metrics.region
        self.node.start()

    def record(self, tenant: str, record_id: str) -> dict[str, Any]:
        """One stored evaluation ``tenant`` may read, with its region reports."""
        from krex.records import RecordStore

        with RecordStore(self.config.records) as store:
            found = store.get(record_id, scope.records_of(tenant))
            if found is None:
                raise RecordNotFound(f"no single record {record_id!r}")
            return {**found, "regions": store.regions(found["id"])}

    def summary(self, tenant: str, seconds: float) -> dict[str, Any]:
        """What the node page shows, as ``tenant`` may see it."""
        return scope.summary(self.node.summary(seconds), tenant)

    def _finished(self, job: Any, result: dict[str, Any]) -> None:
        self.node.job_finished(job, result)
        if job.kind == "evaluate":
            self.metrics.evaluation(result.get("verdict"), job.tenant)

    def close(self) -> None:
        from krex import memtrace

        self.work.close()
        self.jobs.close()
        self.node.stop()
        memtrace.dump()


def _owner_only(config: ServiceConfig) -> None:
    """What the service writes is its own (umask 077), and so are the stores it finds:
    a job's code runs as another user that may enter the state directory (its job's
    folder is in there), never read the databases or the tokens."""
    import os

    from krex.records.store import default_path

    os.umask(0o077)
    os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
    names = [os.path.join(config.state_dir, n) for n in os.listdir(config.state_dir)]
    records = config.records or default_path()
    for path in [*names, *(records + s for s in ("", "-wal", "-shm", "-journal"))]:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_mode & 0o077 and not os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o600)


def create_app(service: Service) -> FastAPI:
    from krex.version import __version__

    app = FastAPI(title="krex", version=__version__, docs_url=None, redoc_url=None,
                  description="Concurrent kernel benchmarking on shared GPUs: jobs for agents.")
    app.state.service = service
    app.add_middleware(BodyLimit, limit=service.config.max_body_bytes)
    config = service.config
    app.add_middleware(Guard, hosts=allowed(config.host, config.port, config.allow_hosts),
                       authenticate=authenticator(service), open_paths=OPEN_PATHS)
    _errors(app)
    _job_routes(app, service)
    _node_routes(app, service)
    return app


# -- errors ------------------------------------------------------------------------------


def problem(status: int, code: str, what: str, hint: str | None = None,
            **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "what": what, "hint": hint, **extra}},
                        status_code=status)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(KrexError)
    async def krex_error(request: Request, exc: KrexError) -> JSONResponse:
        status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 500)
        body = error_body(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status in (429, 503) and exc.seconds is not None:
            headers = {"Retry-After": str(max(1, math.ceil(exc.seconds)))}
        extra = {"retry_after_s": exc.seconds} if status == 429 else {}
        response = problem(status, body["code"], body["what"], body["hint"], **extra)
        if headers:
            response.headers.update(headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return problem(400, "malformed_json", "the request body is not valid JSON",
                           "send a JSON object with Content-Type: application/json")
        fields = [{"field": ".".join(str(p) for p in e.get("loc", ())[1:]) or "body",
                   "what": e.get("msg"), "type": e.get("type")} for e in errors]
        what = "; ".join(f"{f['field']}: {f['what']}" for f in fields[:5])
        return problem(422, "invalid_request", what, "see /openapi.json for the schema",
                       fields=fields)


class BodyLimit:
    """413 for a body over ``limit`` bytes: by its Content-Length, or as it streams in."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        response = problem(413, "body_too_large", f"request bodies are limited to "
                           f"{self.limit} bytes", "send less: a program or source over the "
                           "limit belongs in a file on the node (`path`)")
        await response(scope, receive, send)


class _TooLarge(Exception):
    pass


# -- tenants ------------------------------------------------------------------------------


def _tenant_dependency(service: Service) -> Any:
    def tenant(request: Request,
               authorization: Annotated[str | None, Header()] = None) -> Tenant:
        peer = request.client.host if request.client else ""
        return resolve(service.tokens, authorization, loopback_peer=is_loopback(peer),
                       trust_loopback=service.config.trust_loopback)
    return tenant


def authenticator(service: Service, only: str | None = None) -> Any:
    """The guard's check: the request's token is known (and ``only``'s, when given)."""
    def check(headers: dict[bytes, bytes], peer: str) -> None:
        raw = headers.get(b"authorization")
        tenant = resolve(service.tokens, raw.decode("latin-1") if raw else None,
                         loopback_peer=is_loopback(peer),
                         trust_loopback=service.config.trust_loopback)
        if only is not None and raw is not None and tenant.name != only:
            raise Unauthorized(f"this server serves tenant {only!r}; the token is "
                               f"{tenant.name!r}'s", hint=f"send {only!r}'s token")
    return check


# -- jobs ----------------------------------------------------------------------------------


def _job_routes(app: FastAPI, service: Service) -> None:
    who_t = Annotated[Tenant, Depends(_tenant_dependency(service))]
    key_t = Annotated[str | None, Header(alias="Idempotency-Key")]

    def submit(kind: str, body: schemas._Body, tenant: Tenant, key: str | None) -> JSONResponse:
        if key is not None and not KEY.match(key):
            raise BadRequest("Idempotency-Key: 1-128 of A-Z a-z 0-9 . _ : -",
                             hint="e.g. a UUID")
        job, new = service.jobs.submit(tenant, kind, schemas.job_request(kind, body), key)
        return JSONResponse(job.to_dict(), status_code=201 if new else 200)

    @app.post("/v1/jobs/evaluate", status_code=201, tags=["jobs"])
    def submit_evaluate(body: schemas.EvaluateBody, tenant: who_t,
                        key: key_t = None) -> JSONResponse:
        """Submit an evaluation: correct? faster? trustworthy?  (docs/evaluate.md)"""
        return submit("evaluate", body, tenant, key)

    @app.post("/v1/jobs/exec", status_code=201, tags=["jobs"])
    def submit_exec(body: schemas.ExecBody, tenant: who_t, key: key_t = None) -> JSONResponse:
        """Submit a Python program to run in a warm worker."""
        return submit("exec", body, tenant, key)

    @app.post("/v1/jobs/bench", status_code=201, tags=["jobs"])
    def submit_bench(body: schemas.BenchBody, tenant: who_t, key: key_t = None) -> JSONResponse:
        """Submit a command to time inside a region."""
        return submit("bench", body, tenant, key)

    @app.get("/v1/jobs", tags=["jobs"])
    def list_jobs(tenant: who_t, state: Annotated[str | None, Query(
            pattern="^(queued|running|succeeded|failed|timed_out|crashed|cancelled)$")] = None,
            limit: Annotated[int, Query(ge=1, le=1000)] = 50,
            before: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
        """The tenant's jobs, newest first; ``next`` (when not null) is the ``before`` of
        the next page."""
        jobs, nxt = service.jobs.list(tenant.name, state, limit, before)
        return {"jobs": [j.to_dict() for j in jobs], "next": nxt}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def get_job(job_id: str, tenant: who_t, wait_s: Annotated[float, Query(
            ge=0, le=service.config.max_wait_s)] = 0.0) -> dict[str, Any]:
        """A job; with ``wait_s`` it answers once the job is done or ``wait_s`` passed."""
        if wait_s <= 0:
            return service.jobs.get(tenant.name, job_id).to_dict()
        with service.long_polls.slot(tenant.name):
            job = await anyio.to_thread.run_sync(service.jobs.wait, tenant.name, job_id,
                                                 wait_s, limiter=service.long_polls.threads)
        return job.to_dict()

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
    def cancel_job(job_id: str, tenant: who_t) -> dict[str, Any]:
        """Cancel: a queued job at once; a running one ends ``cancelled`` (result discarded)."""
        return service.jobs.cancel(tenant.name, job_id).to_dict()


# -- node, records, metrics, page -------------------------------------------------------------


def _node_routes(app: FastAPI, service: Service) -> None:
    who_t = Annotated[Tenant, Depends(_tenant_dependency(service))]

    @app.get("/v1/health", tags=["node"])
    def health() -> dict[str, Any]:
        from krex.version import __version__

        return {"ok": True, "krex_version": __version__, "time_s": time.time()}

    @app.get("/v1/node", tags=["node"])
    def node(tenant: who_t) -> dict[str, Any]:
        """The daemon's status (devices, holders, queues, jobs, workers) and the service's."""
        snap = service.node.snapshot()
        if snap["status"] is None:
            service.node.poll_once()
            snap = service.node.snapshot()
        if snap["status"] is None:
            raise DaemonNotRunning(f"the node daemon does not answer: {snap['error']}",
                                   hint="start it with `krex serve` (or let the client "
                                        "auto-start it)")
        return {"daemon": scope.status(snap["status"], tenant.name),
                "service": service.jobs.stats()}

    @app.get("/v1/node/summary", tags=["node"])
    def node_summary(tenant: who_t, seconds: Annotated[float, Query(gt=0, le=3600)] = 300
                     ) -> dict[str, Any]:
        """What the node page shows (another tenant's regions as ``other``)."""
        return service.summary(tenant.name, seconds)

    @app.get("/v1/records", tags=["records"])
    def records(tenant: who_t, limit: Annotated[int, Query(ge=1, le=1000)] = 50
                ) -> dict[str, Any]:
        """The tenant's stored evaluations, newest first (flat rows)."""
        from krex.records import RecordStore

        with RecordStore(service.config.records) as store:
            return {"records": store.rows(limit, scope.records_of(tenant.name))}

    @app.get("/v1/records/{record_id}", tags=["records"])
    def record(record_id: str, tenant: who_t) -> dict[str, Any]:
        """One of the tenant's stored evaluations (id or a unique prefix of 6+) and its
        region reports."""
        return service.record(tenant.name, record_id)

    @app.get("/metrics", tags=["node"])
    def metrics(tenant: who_t) -> Response:
        """Prometheus text format."""
        return Response(scope.metrics(service.metrics.text(), tenant.name),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE)
