"""What a pool is asked to be, what it is asked to run, and what comes back.

Plain dataclasses with no behaviour beyond (de)serialisation: the daemon
turns them into protocol messages, the pool and the worker pass them along.
``ExecResult.to_dict()`` is JSON-able (bytes become base64 strings).
"""

from __future__ import annotations

import base64
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from krex.protocol.outcome import outcome

Status = Literal["ok", "error", "timeout", "crashed", "recycled", "cancelled"]

# ``status`` is the outcome of the *program*; ``recycled``/``recycle_reason``
# say what happened to the *worker*.  "recycled" is reserved for a program
# that could not run because its worker was lost before it started.
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "crashed", "recycled", "cancelled")

EXIT_TIMEOUT = 124


@dataclass
class PoolSpec:
    """The shape of one device's pool of warm workers."""

    device: str  # "cpu", "fakegpu:0", "cuda:0", "rocm:0"
    min_workers: int = 1
    max_workers: int = 2
    max_programs: int = 100  # a worker serves at most N programs, then is recycled
    preload: list[str] = field(default_factory=lambda: ["numpy"])
    default_timeout_s: float | None = None
    memory_growth_limit_mb: float = 512  # device (RSS on cpu) growth beyond this -> recycle
    # Per-worker device memory cap: fakegpu's driver enforces it (allocations past it
    # fail with CUDA_ERROR_OUT_OF_MEMORY); on cuda, torch's caching allocator when torch
    # is preloaded (the CUDA driver has no per-process cap).  None: no cap.
    device_memory_cap_mb: float | None = None
    idle_shutdown_s: float = 30.0  # idle workers above min_workers stop after this long
    # Workers kept ready beyond the busy ones (within max_workers): the next program after
    # a crash or a recycle does not wait for a new worker to start.
    spare_workers: int = 1
    start_timeout_s: float = 120.0  # device init + preload must finish within this
    # A program that loads a native library from outside the system and Python
    # prefixes (a freshly built kernel .so) gets a fresh worker next time: loaded
    # code cannot be unloaded, and a rebuilt library at the same path would not load.
    recycle_on_native_load: bool = True
    # Worker environment variables that win over the request's environment
    # (a trailing "*" matches a prefix): what makes the worker a managed job.
    pinned_env: list[str] = field(default_factory=lambda: ["LD_PRELOAD", "KREX_*"])

    def __post_init__(self) -> None:
        if self.min_workers < 0 or self.max_workers < 1:
            raise ValueError("need min_workers >= 0 and max_workers >= 1")
        if self.min_workers > self.max_workers:
            raise ValueError("min_workers must not exceed max_workers")
        if self.spare_workers < 0:
            raise ValueError("spare_workers must be >= 0")
        if self.max_programs < 1:
            raise ValueError("max_programs must be >= 1")


@dataclass
class ExecRequest:
    """One program to run in a warm worker: a script path or a pickled callable."""

    kind: Literal["path", "callable"]
    path: str | None = None
    args: list[str] = field(default_factory=list)
    cwd: str = field(default_factory=os.getcwd)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))  # the full environment
    payload: bytes | None = None  # pickle.dumps((fn, args, kwargs)) for kind="callable"
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind == "path" and not self.path:
            raise ValueError("kind='path' needs a path")
        if self.kind == "callable" and self.payload is None:
            raise ValueError("kind='callable' needs a payload")
        if self.kind not in ("path", "callable"):
            raise ValueError(f"unknown kind {self.kind!r}")

    @classmethod
    def for_path(cls, path: str, args: list[str] | None = None, **kw: Any) -> ExecRequest:
        return cls(kind="path", path=os.path.abspath(path), args=list(args or []), **kw)

    @classmethod
    def for_callable(cls, fn: Any, *args: Any, **kwargs: Any) -> ExecRequest:
        """A request for ``fn(*args, **kwargs)``; ``fn`` must pickle by reference."""
        import pickle  # here: the client's start-up (krex exec) does not need it

        return cls(kind="callable", payload=pickle.dumps((fn, args, kwargs)))

    def to_dict(self) -> dict[str, Any]:
        return _encode(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecRequest:
        return cls(**_decode(cls, data))


@dataclass
class ExecResult:
    """What happened to one program, and to the worker that ran it."""

    status: Status
    exit_code: int
    exception: str | None = None  # "TypeError: message"
    traceback: str | None = None  # formatted in the worker
    value: bytes | None = None  # pickled return value of a callable
    worker_pid: int = 0
    recycled: bool = False
    recycle_reason: str | None = None
    duration_s: float = 0.0  # submit -> result
    dispatch_s: float | None = None  # submit -> first instruction of the program
    # The program's run in the worker, on the node's CLOCK_MONOTONIC (time.monotonic()),
    # the clock the daemon stamps regions with: what the worker asked for in between is
    # this program's.
    started_mono_s: float | None = None
    ended_mono_s: float | None = None
    restored: list[str] = field(default_factory=list)  # state the program changed, put back

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def outcome(self) -> str:
        """``succeeded`` (exit 0), ``failed``, ``timed_out``, ``crashed`` or ``cancelled``."""
        return outcome(self.status, self.exit_code, self.recycle_reason)

    def returned(self) -> Any:
        """The callable's return value, unpickled."""
        import pickle

        return None if self.value is None else pickle.loads(self.value)

    def to_dict(self) -> dict[str, Any]:
        return _encode(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecResult:
        return cls(**_decode(cls, data))


_BYTES_FIELDS = ("payload", "value")


def _encode(data: dict[str, Any]) -> dict[str, Any]:
    for name in _BYTES_FIELDS:
        if isinstance(data.get(name), bytes):
            data[name] = base64.b64encode(data[name]).decode("ascii")
    return data


def _decode(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in fields(cls)}
    out = {k: v for k, v in data.items() if k in known}
    for name in _BYTES_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = base64.b64decode(out[name])
    return out
