"""Typed errors shared by the daemon, the client and the workers.

Every error carries fields (``pid``, ``device``, ``region``, ``seconds``) and
a ``hint`` with the next action.  Errors survive the daemon -> client ->
worker hops: :func:`to_wire` turns one into a plain dict for a protocol
frame and :func:`from_wire` turns it back into the same class.  They also
pickle (``__reduce__`` keeps the fields).
"""

from __future__ import annotations

from typing import Any

_FIELDS = ("pid", "device", "region", "seconds", "hint")


class KrexError(Exception):
    """Base class of every error krex raises on purpose."""

    code = "error"
    default_hint = ""

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

    def __reduce__(self):
        return (_rebuild, (type(self).code, self.message, self.fields()))

    def __str__(self) -> str:
        return self.message


def _rebuild(code: str, message: str, fields: dict[str, Any]) -> KrexError:
    return error_class(code)(message, **fields)


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


class DaemonNotRunning(KrexError):
    code = "daemon_not_running"
    default_hint = "start one with `krex serve`, or let the client auto-start it"


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


class RegionTimeout(KrexError):
    code = "region_timeout"
    default_hint = "the device is busy; raise the timeout or check `krex status`"


class RegionRevoked(KrexError):
    code = "region_revoked"
    default_hint = "the region exceeded its maximum hold; raise max_hold_s or shorten the region"


class EnforcementFailed(KrexError):
    code = "enforcement_failed"
    default_hint = "run `krex doctor` to see which mechanisms this machine supports"


class DrainTimeout(EnforcementFailed):
    code = "drain_timeout"
    default_hint = "a sibling did not finish its queued GPU work in time; raise --drain-timeout-s"


class InterposerMissing(KrexError):
    code = "interposer_missing"
    default_hint = "reinstall krex so that the native interposer is built (pip install -e .)"


class WorkerFailed(KrexError):
    code = "worker_failed"
    default_hint = "the program's result says why the worker was recycled"


class ShuttingDown(KrexError):
    code = "shutting_down"
    default_hint = "the daemon is stopping; retry in a moment"


class BadRequest(KrexError):
    code = "bad_request"
    default_hint = "check the request fields against docs/protocol.md"


class EvaluationFailed(KrexError):
    """``krex.evaluate`` could not judge the candidate: the reference or the inputs failed."""

    code = "evaluation_failed"
    default_hint = "run the reference and the inputs builder alone and fix them (docs/evaluate.md)"


class RecordsError(KrexError):
    """The records database cannot be opened or has another schema version."""

    code = "records_error"
    default_hint = "point KREX_RECORDS_DB (or records=) at another file, or move this one away"


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_class(code: str) -> type[KrexError]:
    """The error class for a wire code (``KrexError`` when unknown)."""
    for cls in [KrexError, *_all_subclasses(KrexError)]:
        if cls.code == code:
            return cls
    return KrexError


def to_wire(err: KrexError) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, **err.fields()}


def from_wire(data: dict[str, Any]) -> KrexError:
    fields = {k: data[k] for k in _FIELDS if data.get(k) is not None}
    return error_class(str(data.get("code", "error")))(str(data.get("message", "")), **fields)
