"""Typed protocol messages and their validation.

Each message is a frozen dataclass registered under its ``type`` string.
:func:`parse_message` checks the type and every field, and raises
:class:`~krex.errors.UnknownMessage` or :class:`~krex.errors.BadRequest` with
the offending field named.  Requests carry an optional ``id`` that the
daemon echoes as ``re`` in the reply.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from krex.errors import BadRequest, KrexError, ProtocolError, UnknownMessage, to_wire

VERSION = 1
MAX_TEXT = 256  # labels, names, tenant ids: longer is a bad request
PAGE_MAX = 500  # records per ``regions`` / ``jobs`` reply: the rest comes by ``before``

_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    type: ClassVar[str] = ""
    id: int | None = field(default=None, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.type:
            _REGISTRY[cls.type] = cls

    def to_dict(self) -> dict[str, Any]:
        out = {"type": self.type}
        for name in _names(type(self)):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def _names(cls: type[Message]) -> tuple[str, ...]:
    """The field names of a message class, looked up once (every frame sent uses them)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


_NAMES: dict[type[Message], tuple[str, ...]] = {}


# -- requests (client -> daemon) ---------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    type: ClassVar[str] = "hello"
    version: int
    client: str = ""


@dataclass(frozen=True)
class Register(Message):
    """Register the peer process itself: as a member of ``job_id``, or as an ad-hoc job."""

    type: ClassVar[str] = "register"
    job_id: int | None = None
    name: str | None = None
    device: str | None = None
    tenant: str | None = None  # an ad-hoc job's tenant (trusted peers only)


@dataclass(frozen=True)
class CreateJob(Message):
    """Create a managed job owned by the peer (``krex run``); its processes come later."""

    type: ClassVar[str] = "create_job"
    device: str | None = None
    name: str | None = None
    mode: str = "region"
    tenant: str | None = None  # the job's tenant (trusted peers only; default: the peer's uid)


@dataclass(frozen=True)
class AttachJob(Message):
    """Declare ``pid`` (the peer itself or a descendant) the root process of ``job_id``."""

    type: ClassVar[str] = "attach_job"
    job_id: int
    pid: int


@dataclass(frozen=True)
class EndJob(Message):
    type: ClassVar[str] = "end_job"
    job_id: int
    exit_code: int | None = None


@dataclass(frozen=True)
class Acquire(Message):
    """Ask for a region; the reply ``granted`` comes when it is granted."""

    type: ClassVar[str] = "acquire"
    job_id: int
    device: str | None = None
    label: str | None = None
    max_hold_s: float | None = None
    timeout_s: float | None = None
    whole_job: bool = False
    tenant: str | None = None  # charge this region to a tenant (trusted peers only)
    # the region of an ``offer`` this acquire takes: granted already, or an error
    # (``offer_lapsed``), never queued
    claim: int | None = None


@dataclass(frozen=True)
class Release(Message):
    """End a held region.  ``again``: a request id; the job's next region is asked for
    first, as an ``acquire`` with that id and the released region's own parameters (its
    grant or error comes as that acquire's reply), so the job is queued again before the
    device is handed on (``krex.regions``)."""

    type: ClassVar[str] = "release"
    region: int
    again: int | None = None


@dataclass(frozen=True)
class Cancel(Message):
    """Withdraw the ``acquire`` whose request id was ``acquire`` on this connection.

    Queued: it is dropped.  Granted meanwhile (the grant may be in flight): the
    region is released.  The reply says which (``cancelled``)."""

    type: ClassVar[str] = "cancel"
    acquire: int


@dataclass(frozen=True)
class Revoke(Message):
    """End a held region now (its owner's uid, or an operator); its holder is told."""

    type: ClassVar[str] = "revoke"
    region: int
    reason: str | None = None


@dataclass(frozen=True)
class Status(Message):
    type: ClassVar[str] = "status"


@dataclass(frozen=True)
class Ping(Message):
    """Liveness: answered at once, whatever else the connection waits for."""

    type: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Regions(Message):
    """Recent finished regions, optionally only those of some jobs."""

    type: ClassVar[str] = "regions"
    job_ids: list[int] | None = None
    limit: int = PAGE_MAX
    before: int | None = None  # the ``next_before`` of the previous page


@dataclass(frozen=True)
class Jobs(Message):
    """Jobs (live, then recently ended) with where their time went."""

    type: ClassVar[str] = "jobs"
    job_ids: list[int] | None = None
    limit: int = PAGE_MAX
    before: int | None = None


@dataclass(frozen=True)
class Exec(Message):
    """Run a program in a warm worker of ``device``; ``output`` frames stream back live.

    ``request`` is an ``ExecRequest.to_dict()`` (path or pickled callable, args, cwd, env).
    """

    type: ClassVar[str] = "exec"
    request: dict[str, Any]
    device: str | None = None
    tenant: str | None = None  # regions the program takes are this tenant's (trusted peers)


@dataclass(frozen=True)
class ProgramUser(Message):
    """Whom the programs of ``tenant`` run as (operators): ``run_as`` -- a
    :class:`krex.protocol.runas.RunAs` dict, or null for the daemon's own user."""

    type: ClassVar[str] = "program_user"
    tenant: str | None = None


@dataclass(frozen=True)
class Stop(Message):
    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class StopProgram(Message):
    """Kill the warm worker running the program whose request named ``cwd``, with every
    process in its cgroup (what it started and double-forked away too); operators."""

    type: ClassVar[str] = "stop_program"
    cwd: str = ""


# -- replies and events (daemon -> client) -----------------------------------


@dataclass(frozen=True)
class Reply(Message):
    """Generic successful reply; ``data`` holds the result."""

    type: ClassVar[str] = "ok"
    re: int | None = None
    data: dict[str, Any] | None = None


@dataclass(frozen=True)
class ErrorReply(Message):
    type: ClassVar[str] = "error"
    re: int | None = None
    code: str = "error"
    message: str = ""
    hint: str | None = None
    pid: int | None = None
    device: str | None = None
    region: int | None = None
    seconds: float | None = None

    @classmethod
    def of(cls, exc: KrexError, re: int | None = None) -> ErrorReply:
        """The reply that carries ``exc`` (decoded by :func:`krex.errors.from_wire`)."""
        return cls(re=re, **to_wire(exc))


@dataclass(frozen=True)
class Revoked(Message):
    """Pushed to a holder whose region exceeded its maximum hold."""

    type: ClassVar[str] = "revoked"
    region: int
    reason: str = ""


@dataclass(frozen=True)
class Offer(Message):
    """Pushed when the region the daemon re-queued for a job at its release is granted
    (the job thawed): the job's next plain ``acquire`` on this connection may take it
    at once with ``claim`` (docs/protocol.md, "Offers").  ``claim_by_mono_s``: when it
    lapses (CLOCK_MONOTONIC); ``job_device`` / ``job_tenant``: the region is on the
    job's own device / charged to the job's own tenant (an acquire that names neither
    may take it)."""

    type: ClassVar[str] = "offer"
    region: int
    job_id: int
    device: str
    tenant: str
    claim_by_mono_s: float
    job_device: bool = True
    job_tenant: bool = True


@dataclass(frozen=True)
class Output(Message):
    """A chunk of a running program's stdout or stderr (reply to ``exec`` in progress)."""

    type: ClassVar[str] = "output"
    re: int | None = None
    stream: str = "stdout"
    data: str = ""


def message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


def parse_message(data: dict[str, Any]) -> Message:
    """Validate a decoded frame and build its message object."""
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("malformed message: missing string field 'type'")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise UnknownMessage(f"unknown message type {kind!r}")
    fields, names = _schema(cls)
    if not names.issuperset(data.keys()):
        raise BadRequest(f"{kind}: unknown field(s) {sorted(set(data) - names)}")
    values = {}
    for name, hint, required in fields:
        if name in data:
            values[name] = _check(kind, name, data[name], hint)
        elif required:
            raise BadRequest(f"{kind}: missing required field {name!r}")
    return cls(**values)


Schema = tuple[tuple[tuple[str, Any, bool], ...], frozenset[str]]


def _schema(cls: type[Message]) -> Schema:
    """``((name, hint, required), ...)`` of ``cls``'s fields and the names a frame may
    carry (its fields and ``type``), worked out once per class: a request is parsed on
    the daemon's grant path."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        fields = tuple((f.name, hints[f.name], f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING)
                       for f in dataclasses.fields(cls))
        _SCHEMAS[cls] = (fields, frozenset([f[0] for f in fields] + ["type"]))
    return _SCHEMAS[cls]


_SCHEMAS: dict[type[Message], Schema] = {}


def _check(kind: str, name: str, value: Any, hint: Any) -> Any:
    if _accepts(value, hint):
        return float(value) if hint in (float, float | None) and value is not None else value
    raise BadRequest(f"{kind}: field {name!r} has the wrong type ({type(value).__name__})")


def _accepts(value: Any, hint: Any) -> bool:
    if hint is str or hint is bool:  # the common cases first, without typing's helpers
        return isinstance(value, hint)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_accepts(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_accepts(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
