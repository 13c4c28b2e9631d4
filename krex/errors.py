"""Typed errors shared by the daemon, the client, the workers and the CLI: one registry.

Every error carries fields (``pid``, ``device``, ``region``, ``seconds``) and
a ``hint`` with the next action.  Every class is defined here and registers
its wire ``code`` when it is defined (codes are unique: a second class with
the same code is a ``TypeError`` at import), so decoding an error off the
wire never depends on which other modules happen to be imported.
:func:`to_wire` turns an error into a plain dict for a protocol frame and
:func:`from_wire` turns it back into the same class; errors also pickle
(``__reduce__`` keeps the fields).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (CLI start-up)
if TYPE_CHECKING:
    from typing import Any, ClassVar

_FIELDS = ("pid", "device", "region", "seconds", "hint")
_REGISTRY: dict[str, type[KrexError]] = {}


class KrexError(Exception):
    """Base class of every error krex raises on purpose."""

    code: ClassVar[str] = "error"
    default_hint: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if not isinstance(code, str) or not code:
            raise TypeError(f"{cls.__name__} must define its own wire code")
        if code in _REGISTRY:
            taken = _REGISTRY[code].__name__
            raise TypeError(f"error code {code!r} of {cls.__name__} is taken by {taken}")
        _REGISTRY[code] = cls

    def __init__(
        self,
        message: str = "",
        *,
        pid: int | None = None,
        device: str | None = None,
        region: int | None = None,
        seconds: float | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.pid = pid
        self.device = device
        self.region = region
        self.seconds = seconds
        self.hint = hint if hint is not None else self.default_hint

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _FIELDS if getattr(self, k) is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self).code, self.message, self.fields()))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        fields = "".join(f", {k}={v!r}" for k, v in self.fields().items())
        return f"{type(self).__name__}({self.message!r}{fields})"


_REGISTRY[KrexError.code] = KrexError


def _rebuild(code: str, message: str, fields: dict[str, Any]) -> KrexError:
    return error_class(code)(message, **fields)


# -- the protocol ----------------------------------------------------------------------


class ProtocolError(KrexError):
    """A frame or message that does not follow docs/protocol.md."""

    code = "protocol"
    default_hint = "see docs/protocol.md for the frame and message format"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"
    default_hint = "send frames under the size limit the daemon announced"


class UnknownMessage(ProtocolError):
    code = "unknown_message"
    default_hint = "check the message type against docs/protocol.md"


class VersionMismatch(ProtocolError):
    code = "version_mismatch"
    default_hint = "client and daemon come from different krex versions: run `krex stop` and retry"


class BadRequest(KrexError):
    code = "bad_request"
    default_hint = "check the request fields against docs/protocol.md"


# -- the daemon --------------------------------------------------------------------------


class DaemonMismatch(KrexError):
    code = "daemon_mismatch"
    default_hint = ("stop that daemon (`krex stop` works from any installation) and rerun, or "
                    "give this installation a runtime directory of its own "
                    "(export KREX_RUNTIME_DIR=...)")


class DaemonNotRunning(KrexError):
    code = "daemon_not_running"
    default_hint = "start one with `krex serve`, or let the client auto-start it"


class DaemonUnresponsive(KrexError):
    """The daemon's socket accepts, but it did not answer in time (stopped, wedged)."""

    code = "daemon_unresponsive"
    default_hint = ("the daemon may be stopped (SIGSTOP: `ps -o stat= -p PID` shows T) or "
                    "overloaded; resume or restart it, or wait longer with "
                    "KREX_REPLY_TIMEOUT_S=SECONDS")


class AlreadyRunning(KrexError):
    code = "already_running"
    default_hint = "use it, or stop it with `krex stop`"


class ShuttingDown(KrexError):
    code = "shutting_down"
    default_hint = "the daemon is stopping; retry in a moment"


class InternalError(KrexError):
    """A bug: the daemon caught an exception it did not expect (and kept serving)."""

    code = "internal"
    default_hint = "a bug in krex: the daemon's log has the traceback; please report it"


class AccessDenied(KrexError):
    code = "access_denied"
    default_hint = "a process may only act for itself or its own descendants"


class ProcessGone(KrexError):
    code = "process_gone"
    default_hint = "the process exited (or its PID was reused) before krex could act on it"


class UnknownDevice(KrexError):
    code = "unknown_device"
    default_hint = "run `krex status` to list this node's devices"


class UnknownRegion(KrexError):
    code = "unknown_region"
    default_hint = "release only a region this connection holds"


class UnknownJob(KrexError):
    code = "unknown_job"
    default_hint = "the job ended or KREX_JOB_ID is stale; run under `krex run`"


class QuotaExceeded(KrexError):
    """A tenant's quota (concurrent jobs, region-seconds per minute, maximum hold) is hit;
    ``seconds``: when retrying can succeed, where known."""

    code = "quota_exceeded"
    default_hint = ("wait `seconds` and retry, end some of your jobs, or ask the node's "
                    "operator for a larger quota (`krex status` shows yours)")


class LimitExceeded(KrexError):
    """A bound that keeps the daemon serving everyone: connections per uid, regions per
    connection, programs in flight."""

    code = "limit_exceeded"
    default_hint = ("finish or cancel what is in flight first (release regions, wait for "
                    "programs), or open fewer connections")


# -- regions and enforcement -------------------------------------------------------------


class RegionTimeout(KrexError):
    code = "region_timeout"
    default_hint = "the device is busy; raise the timeout or check `krex status`"


class RegionRevoked(KrexError):
    code = "region_revoked"
    default_hint = "the region exceeded its maximum hold; raise max_hold_s or shorten the region"


class OfferLapsed(KrexError):
    """A region claimed from the daemon's offer (:class:`krex.protocol.messages.Offer`)
    was no longer the job's when the claim arrived: its body ran without the device."""

    code = "offer_lapsed"
    default_hint = ("the region's body ran without the device to itself: time it again "
                    "(a job slower than the daemon's --requeue-ms to ask again loses its turn)")


class EnforcementFailed(KrexError):
    code = "enforcement_failed"
    default_hint = "run `krex doctor` to see which mechanisms this machine supports"
    # The host evidence (krex.protocol.report.HostEvidence) of the attempt that failed,
    # its steps reverted; set where it is raised, never sent on the wire.
    host: Any = None


class DrainTimeout(EnforcementFailed):
    code = "drain_timeout"
    default_hint = "a sibling did not finish its queued GPU work in time; raise --drain-timeout-s"


class InterposerMissing(KrexError):
    code = "interposer_missing"
    default_hint = "reinstall krex so that the native interposer is built (pip install -e .)"


# -- workers and measurements ------------------------------------------------------------


class WorkerFailed(KrexError):
    code = "worker_failed"
    default_hint = "the program's result says why the worker was recycled"


class DeviceTimerUnavailable(KrexError):
    code = "device_timer_unavailable"
    default_hint = "install the device driver (or build fakegpu), or measure on device 'cpu'"


class FakegpuServerMissing(DeviceTimerUnavailable):
    code = "fakegpu_server_missing"
    default_hint = ("run the program as a krex job on the device: `krex run --device fakegpu:0 "
                    "-- python prog.py` or `krex exec --device fakegpu:0 prog.py` (the daemon "
                    "starts the fake device server); or start one with "
                    "krex.devices.fakegpu.FakeGpu and run with its env()")


class CommandFailed(KrexError):
    code = "command_failed"
    default_hint = ("run the command alone to see its error, or ignore failures with "
                    "-i/--ignore-failure (ignore_failure=True in Python)")


class CommandTimeout(KrexError):
    """A timed command ran past its timeout and was killed (the CLI exits 124)."""

    code = "command_timeout"
    default_hint = "raise --timeout-s (timeout_s=), or time less work per run"


class UsageError(KrexError):
    """A command line that cannot work as given (the CLI exits 2, as argparse does)."""

    code = "usage"
    default_hint = "see `krex COMMAND --help`"


class CommandNotFound(KrexError):
    """The command to run does not exist (the CLI exits 127, as shells do)."""

    code = "command_not_found"
    default_hint = "check the command's name and PATH"
    exit_status = 127


class CommandNotExecutable(CommandNotFound):
    """The command exists but cannot be executed (the CLI exits 126, as shells do)."""

    code = "command_not_executable"
    default_hint = "check the file's execute permission (chmod +x) or run it with its interpreter"
    exit_status = 126


def command_error(argv0: str, exc: OSError) -> CommandNotFound:
    """The CLI's error for a command that could not be started."""
    cls = CommandNotExecutable if isinstance(exc, PermissionError) else CommandNotFound
    why = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError) and "/" not in argv0:
        why = "command not found"
    return cls(f"cannot run {argv0!r}: {why}")


# -- evaluate and records --------------------------------------------------------------


class EvaluationFailed(KrexError):
    """``krex.evaluate`` could not judge the candidate: the reference or the inputs failed."""

    code = "evaluation_failed"
    default_hint = "run the reference and the inputs builder alone and fix them (docs/evaluate.md)"


class RecordsError(KrexError):
    """The records database cannot be opened or has another schema version."""

    code = "records_error"
    default_hint = "point KREX_RECORDS_DB (or records=) at another file, or move this one away"


# -- the Ray integration -----------------------------------------------------------------


class RayMissing(KrexError):
    code = "ray_missing"
    default_hint = "install the extra: pip install 'krex[ray]'"


class NoKrexNodes(KrexError):
    code = "ray_no_krex_nodes"
    default_hint = ("start the node actors with `krex cluster up --address ADDRESS` "
                    "(or krex.ray.start()) and check `krex cluster status`")


class ClusterUnreachable(KrexError):
    code = "ray_cluster_unreachable"
    default_hint = ("check the address (the head's `ray start --head` prints it; "
                    "`ray status --address ADDRESS`), and that RAY_AUTH_MODE / RAY_AUTH_TOKEN "
                    "match the cluster's (a LocalCluster uses token authentication: "
                    "docs/cluster.md, 'Reaching a local cluster from another shell')")


# -- the service (HTTP, MCP) ---------------------------------------------------------------


class ServiceMissing(KrexError):
    """``krex service`` / ``krex mcp`` without their optional dependencies."""

    code = "service_missing"
    default_hint = "install the extra: pip install 'krex[server]'"


class Unauthorized(KrexError):
    """No token, or a token the service does not know (HTTP 401)."""

    code = "unauthorized"
    default_hint = "send `Authorization: Bearer TOKEN` (krex service token add TENANT makes one)"


class ServiceQuotaExceeded(KrexError):
    """A tenant's quota in the service: active jobs, jobs per minute (HTTP 429)."""

    code = "service_quota_exceeded"
    default_hint = "wait for your running jobs to finish (or cancel some), then submit again"


class ServiceBusy(KrexError):
    """The service is at a limit of its own (long polls waiting at once): retry after
    ``seconds`` (HTTP 503 with Retry-After)."""

    code = "service_busy"
    default_hint = "retry after `seconds`, or poll without wait_s meanwhile"


class JobNotFound(KrexError):
    """No job of this tenant with this id (HTTP 404)."""

    code = "job_not_found"
    default_hint = "GET /v1/jobs lists your jobs"


class JobStopped(KrexError):
    """A cancelled service job's process was killed before it wrote a result."""

    code = "job_stopped"


class RecordNotFound(KrexError):
    """No single stored evaluation with this id or prefix (HTTP 404)."""

    code = "record_not_found"
    default_hint = "GET /v1/records (or krex history) lists ids"


class IdempotencyConflict(KrexError):
    """An idempotency key reused for a different request (HTTP 409)."""

    code = "idempotency_conflict"
    default_hint = "use a new Idempotency-Key for a different request"


# -- the wire ------------------------------------------------------------------------------


def error_codes() -> dict[str, type[KrexError]]:
    """Every registered wire code and its class."""
    return dict(_REGISTRY)


def error_class(code: str) -> type[KrexError]:
    """The error class for a wire code (``KrexError`` when unknown)."""
    return _REGISTRY.get(code, KrexError)


def to_wire(err: KrexError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, **err.fields()}


def from_wire(data: dict[str, Any]) -> KrexError:
    fields = {k: data[k] for k in _FIELDS if data.get(k) is not None}
    return error_class(str(data.get("code", "error")))(str(data.get("message", "")), **fields)
