"""How long a client waits for a daemon that may have stopped answering.

Shared by the full client (:mod:`krex.client.connection`) and the CLI's lean
path (:mod:`krex.cli.lean`), so both notice a stopped daemon the same way.  A
request the daemon answers at once must be answered within the reply timeout;
a wait that may legitimately be long (``acquire`` queued, ``exec`` running a
program) pings the daemon after ``PROBE_AFTER_S`` of silence and gives up
only when the ping, too, goes unanswered.  Standard library and
:mod:`krex.errors` only: this is on every CLI command's path.
"""

from __future__ import annotations

import os
import time

from krex.errors import KrexError

REPLY_TIMEOUT_S = 20.0  # a request the daemon answers at once (KREX_REPLY_TIMEOUT_S; 0: none)
PROBE_AFTER_S = 5.0  # silence in a long wait (acquire, exec) after which we ping
PATIENT = ("acquire", "exec")  # requests whose reply may legitimately take long


class Watch:
    """How long a wait for a reply may stay silent (``limit_s`` None: forever).

    Impatient: ``limit_s`` from the last frame heard.  Patient: a ``ping`` after
    ``probe_after_s`` of silence, then ``limit_s`` for any frame."""

    def __init__(self, limit_s: float | None, patient: bool) -> None:
        self.limit_s = limit_s
        self.patient = patient and limit_s is not None
        self.probe_after_s = min(PROBE_AFTER_S, limit_s / 2) if limit_s else None
        self.last_heard = time.monotonic()
        self.ping_sent: float | None = None

    def wait_s(self) -> float | None:
        if self.limit_s is None:
            return None
        if not self.patient:
            return self.last_heard + self.limit_s - time.monotonic()
        if self.ping_sent is None:
            assert self.probe_after_s is not None
            return self.last_heard + self.probe_after_s - time.monotonic()
        return self.ping_sent + self.limit_s - time.monotonic()

    def may_ping(self) -> bool:
        return self.patient and self.ping_sent is None

    def pinged(self, _rid: int) -> None:
        self.ping_sent = time.monotonic()

    def heard(self) -> None:
        self.last_heard = time.monotonic()
        self.ping_sent = None


def lock_pid(path: str) -> int | None:
    """The pid a daemon wrote in its lock file next to socket ``path`` (when readable)."""
    try:
        with open(os.path.join(os.path.dirname(path), "krexd.lock")) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def reply_timeout_from_env() -> float:
    """``$KREX_REPLY_TIMEOUT_S`` (seconds; 0: wait forever), else the default."""
    raw = os.environ.get("KREX_REPLY_TIMEOUT_S")
    if not raw:
        return REPLY_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise KrexError(f"KREX_REPLY_TIMEOUT_S={raw!r} is not a number of seconds",
                        hint="set it to seconds (e.g. 20), or 0 to wait forever") from None
    return max(value, 0.0)
