"""The guardian: a tiny process that undoes enforcement if the daemon cannot.

The daemon starts it with :class:`GuardianClient` (its own session, so a
signal to the daemon's process group never reaches it) and talks to it over
a pipe of JSON lines: ``lease`` (id, seconds, undo records), ``end`` (id).
The guardian replays a lease's undo records (:mod:`krex.enforce.undo`) when
the lease expires, and every active lease when the daemon dies (EOF on the
pipe, or the daemon's pidfd becoming readable: even after SIGKILL).  It
journals active leases to a file so a new daemon can :func:`sweep` what a
crash of both left behind (rewritten only when what a sweep would replay changes: a
handoff's new lease with the old one's undo records, the old lease ended, writes
nothing — on a small machine that rewrite, a file created and renamed, cost the
daemon's core ≈ 0.3 ms per region).  It prints ``expired ID`` lines the daemon can
read with :meth:`GuardianClient.expired`.

The client remembers every active lease: when the guardian has died (OOM,
a kill), :meth:`GuardianClient.ensure_alive` (and any send) starts a new one
and hands it every active lease with the time left, so enforcement is never
without an undo.  The client is safe to use from several threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from krex import resultfile
from krex.enforce import process as _process
from krex.enforce.shield import RELEASE as _SHIELD_RELEASE
from krex.enforce.shield import replay_record as _shield_replay
from krex.enforce.undo import replay as _undo_replay


def replay(records: list[dict]) -> list[str]:
    """Replay undo records in order: the shield's own kind (:mod:`krex.enforce.shield`)
    here, every other kind by :func:`krex.enforce.undo.replay`."""
    errors: list[str] = []
    batch: list[dict] = []
    for rec in records:
        if isinstance(rec, dict) and rec.get("kind") == _SHIELD_RELEASE:
            errors += _undo_replay(batch) + _shield_replay(rec)
            batch = []
        else:
            batch.append(rec)
    return errors + _undo_replay(batch)


class GuardianClient:
    """The daemon's end of the guardian pipe."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._expired: set[int] = set()
        self._buf = b""
        self._lock = threading.RLock()
        self.leases: dict[int, tuple[float, list[dict]]] = {}  # id -> (expiry, undo records)
        self.restarts = 0
        self._args: tuple[str, str] | None = None
        self._held: list[dict] | None = None  # messages of a batch(), sent at its end

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, instance: str, journal_path: str, timeout_s: float = 10.0) -> None:
        journal_path = os.path.abspath(journal_path)
        self._args = (instance, journal_path)
        # -I and cwd "/": nothing is imported from the daemon's working directory (it
        # may be writable by others) or from PYTHON* variables and the user's site.
        cmd = [sys.executable, "-I", "-m", "krex.enforce.guardian", instance, journal_path]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            cwd="/",
        )
        _process.PROTECTED.add(self.proc.pid)
        out = self.proc.stdout
        assert out is not None  # a pipe
        ready, _, _ = select.select([out], [], [], timeout_s)
        if not ready or out.readline().strip() != b"ready":
            self._stop(5.0)
            raise RuntimeError("the krex guardian did not start")
        os.set_blocking(out.fileno(), False)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _send(self, msg: dict) -> None:
        with self._lock:
            if self._args is None:
                raise RuntimeError("guardian not started")
            if self._held is not None:
                self._held.append(msg)
                return
            self._send_now([msg])

    def _send_now(self, msgs: list[dict]) -> None:
        self.ensure_alive()
        try:
            self._write(msgs)
        except OSError:  # died just now: the new one gets every lease, these too
            self._restart()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Messages sent meanwhile go in one write, in order, at the end: the guardian
        wakes and rewrites its journal once (a handoff's new lease and the old one's
        end), never seeing the end without the lease before it."""
        with self._lock:
            if self._held is not None:  # nested: the outer batch sends
                yield
                return
            self._held = []
            try:
                yield
            finally:
                msgs, self._held = self._held, None
                if msgs:
                    self._send_now(msgs)

    def _write(self, msgs: list[dict]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
        self.proc.stdin.flush()

    def lease(self, lease_id: int, expires_in_s: float, undo_records: list[dict]) -> None:
        """Register (or replace) a lease; ``undo_records`` in the order to replay."""
        with self._lock:
            self.leases[lease_id] = (time.monotonic() + expires_in_s, undo_records)
            self._send({"cmd": "lease", "id": lease_id, "s": expires_in_s,
                        "undo": undo_records})

    def end(self, lease_id: int) -> None:
        with self._lock:
            self.leases.pop(lease_id, None)
            self._send({"cmd": "end", "id": lease_id})

    def ensure_alive(self) -> bool:
        """Start a new guardian if this one died; True when it did."""
        with self._lock:
            if self._args is None or self.alive():
                return False
            self._restart()
            return True

    def _restart(self) -> None:
        """A new guardian, handed every active lease with the time it has left (a lease
        that ran out meanwhile is replayed by the new guardian at once)."""
        assert self._args is not None
        old = self.proc
        if old is not None:
            for stream in (old.stdin, old.stdout):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                old.wait(1)
            _process.PROTECTED.discard(old.pid)
        self.restarts += 1
        self._buf = b""
        self.start(*self._args)
        now = time.monotonic()
        self._write([{"cmd": "lease", "id": lease_id, "s": max(0.0, expiry - now),
                      "undo": records} for lease_id, (expiry, records) in self.leases.items()])

    def surely_active(self, lease_id: int) -> bool:
        """Whether lease ``lease_id`` cannot have expired yet, known without reading the
        pipe: the guardian counts a lease's time from when it reads it, never earlier
        than this client's clock started it (a restart hands over the time left), so
        before this client's expiry it is active.  False: ask :meth:`expired`."""
        lease = self.leases.get(lease_id)
        return lease is not None and time.monotonic() < lease[0]

    def expired(self) -> set[int]:
        """Lease ids the guardian has expired (and undone) so far.

        Under the lock: a restart (the ticker's) replaces ``proc`` and reads the new
        guardian's ``ready`` line; read here unlocked, a lane's release could take that
        line first and leave the restart waiting its whole start timeout."""
        with self._lock:
            if self.proc is not None and self.proc.stdout is not None:
                with contextlib.suppress(BlockingIOError, OSError, TypeError):
                    self._buf += os.read(self.proc.stdout.fileno(), 65536) or b""
                *lines, self._buf = self._buf.split(b"\n")
                for line in lines:
                    if line.startswith(b"expired "):
                        self._expired.add(int(line.split()[1]))
            return set(self._expired)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the pipe (the guardian undoes any lease still active) and reap it."""
        with self._lock:
            self._args = None  # stopped on purpose: not restarted
            self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _process.PROTECTED.discard(self.proc.pid)
        self.proc = None


def sweep(journal_path: str) -> list[str]:
    """Replay every lease a dead guardian journaled; return replay errors."""
    try:
        with open(journal_path) as f:
            leases = json.load(f).get("leases", {})
    except (OSError, ValueError):
        return []
    errors = []
    for lease in leases.values():
        errors += replay(lease["undo"])
    with contextlib.suppress(OSError):
        os.unlink(journal_path)
    return errors


class Guardian:
    """The guardian's loop: read commands, expire leases, undo on daemon death."""

    def __init__(self, journal_path: str, daemon_pid: int) -> None:
        self.journal_path = journal_path
        self.leases: dict[int, dict] = {}
        self.daemon_fd = _pidfd(daemon_pid)
        self.buf = b""
        self.journaled: str | None = None  # what the journal's sweep replays, as written

    def run(self) -> None:
        stdin = sys.stdin.fileno()
        while True:
            fds = [stdin] + ([self.daemon_fd] if self.daemon_fd is not None else [])
            ready, _, _ = select.select(fds, [], [], self._next_timeout())
            self._expire()
            if self.daemon_fd in ready and self.daemon_fd is not None:
                return self._drain_then_undo(stdin)
            if stdin in ready:
                data = os.read(stdin, 1 << 20)
                if not data:
                    return self.undo_all()
                self._feed(data)

    def _drain_then_undo(self, stdin: int) -> None:
        """The daemon died: take the leases it wrote before dying, then undo all."""
        os.set_blocking(stdin, False)
        with contextlib.suppress(BlockingIOError, OSError):
            while data := os.read(stdin, 1 << 20):
                self._feed(data)
        self.undo_all()

    def _next_timeout(self) -> float | None:
        if not self.leases:
            return None
        return max(0.0, min(lease["at"] for lease in self.leases.values()) - time.monotonic())

    def _feed(self, data: bytes) -> None:
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self._command(json.loads(line))
        self._journal()

    def _command(self, msg: dict) -> None:
        if msg["cmd"] == "lease":
            undo = msg["undo"]
            self.leases[int(msg["id"])] = {"at": time.monotonic() + float(msg["s"]), "undo": undo}
        elif msg["cmd"] == "end":
            self.leases.pop(int(msg["id"]), None)

    def _expire(self) -> None:
        now = time.monotonic()
        for lease_id in [k for k, v in self.leases.items() if v["at"] <= now]:
            replay(self.leases.pop(lease_id)["undo"])
            _say(f"expired {lease_id}")
            self._journal()

    def undo_all(self) -> None:
        for lease_id in sorted(self.leases, reverse=True):
            replay(self.leases.pop(lease_id)["undo"])
        self._journal()

    def _journal(self) -> None:
        """Write the active leases for :func:`sweep`, unless the undo records it would
        replay, in order, are those already written: lease ids and expiries are not
        replayed, so a journal that names the lease a handoff ended still undoes
        exactly what the new one holds."""
        if not self.leases:
            with contextlib.suppress(OSError):
                os.unlink(self.journal_path)
            self.journaled = None
            return
        replayed = json.dumps([v["undo"] for v in self.leases.values()])
        if replayed == self.journaled and os.path.exists(self.journal_path):
            return
        data = {"guardian_pid": os.getpid(), "leases": {str(k): v for k, v in self.leases.items()}}
        with contextlib.suppress(OSError):
            resultfile.write(self.journal_path, data, indent=None)
            self.journaled = replayed


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid) if pid > 1 else None
    except (AttributeError, OSError):
        return None


def _say(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(1, line.encode() + b"\n")


def main(argv: list[str]) -> int:
    # Never die of the terminal's or the process group's signals.
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGTSTP):
        signal.signal(sig, signal.SIG_IGN)
    guardian = Guardian(argv[1], os.getppid())
    def on_term(signum: int, frame: object) -> None:
        guardian.undo_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    # SCHED_BATCH: no wake-up preemption.  Woken by every lease the daemon writes, the
    # guardian would otherwise take the daemon's core in the middle of a handoff; its
    # share of the CPU (and so its expiry timer under load) is a normal task's.
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) | os.O_NONBLOCK)
    _say("ready")
    guardian.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
