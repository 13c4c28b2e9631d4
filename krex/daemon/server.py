"""The socket server: accepts connections, one reader thread per session.

In: connections on the Unix socket (owner-only; with ``--group`` or
``--node``, a group's).  Out: frames.  Each session starts with the
``hello``/``welcome`` handshake; after that every frame is parsed and handed
to :class:`~krex.daemon.core.Daemon`.  A bad frame gets a specific error
reply; a frame that breaks framing (oversized, truncated) closes only that
connection.  Nothing a peer sends can stop the daemon serving others: an
``accept()`` that fails (out of file descriptors, memory) is retried after a
pause, a reply too large for a frame becomes an error reply, and each uid
may keep only so many connections open.  The ticker wakes at the next
deadline, never dies of an exception and never spins.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import logging
import math
import os
import signal
import socket
import sys
import termios
import threading
import time
from typing import Any

from krex.daemon import priority
from krex.daemon.config import DaemonConfig
from krex.daemon.core import Daemon
from krex.enforce.process import ProcessRef
from krex.errors import (
    AlreadyRunning,
    BadRequest,
    InternalError,
    KrexError,
    LimitExceeded,
    ProcessGone,
    ProtocolError,
    VersionMismatch,
)
from krex.protocol import messages as m
from krex.protocol.address import ensure_private_dir, ensure_shared_dir
from krex.protocol.framing import ConnectionClosed, FrameReader, encode_frame
from krex.protocol.installation import installation
from krex.protocol.peer import Peer, peer_of

log = logging.getLogger("krex.daemon")
SEND_TIMEOUT_S = 5.0
ACCEPT_PAUSE_S = 0.05  # after an accept() error: let file descriptors or memory come back
MIN_TICK_S = 0.001  # the ticker never sleeps less, even for a deadline already past
STUCK_TICK_S = 0.05  # ... and this long when the same past deadline comes back
HOUSEKEEPING_S = 0.5  # jobs reaped, the guardian checked, neighbours looked at
_TRANSIENT_ACCEPT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                     errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}


class Session:
    """One client connection."""

    def __init__(self, sock: socket.socket, peer: Peer, process: ProcessRef) -> None:
        self.sock = sock
        self.peer = peer
        self.process = process
        self._send_lock = threading.Lock()
        self.closed = False
        self.verified: set[tuple[int, int]] = set()
        self.reader: FrameReader | None = None  # set by the session's loop
        self.handling = False  # a frame read and not yet answered

    def input_pending(self) -> bool:
        """Whether something this client sent is not handled yet: bytes in the socket's
        queue or the reader's buffer, or a frame being handled (an offered region's
        claim may be among them: Holds.revoke)."""
        if self.handling or (self.reader is not None and self.reader.buffered()):
            return True
        try:
            buf = fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return False
        return int.from_bytes(buf, sys.byteorder) > 0

    def push(self, message: m.Message) -> None:
        try:
            data = encode_frame(message.to_dict())
        except KrexError as exc:  # too large for a frame: say so instead
            err = InternalError(f"the daemon's reply did not fit in a frame: {exc.message}")
            data = encode_frame(m.ErrorReply.of(err, getattr(message, "re", None)).to_dict())
        with self._send_lock:
            if self.closed:
                return
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Server:
    def __init__(self, config: DaemonConfig, daemon: Daemon | None = None) -> None:
        self.config = config
        self.daemon = daemon
        self.sock: socket.socket | None = None
        self.sessions: set[Session] = set()
        self._by_uid: dict[int, int] = {}
        self._sessions_lock = threading.Lock()
        self._lockfile: int | None = None
        self._signals = 0
        self.accept_errors = 0
        self.shed_connections = 0
        self._owner = _owner(config.exit_with)

    @property
    def core(self) -> Daemon:
        """The daemon this server serves (set before ``serve_forever``)."""
        assert self.daemon is not None, "the server has no daemon yet"
        return self.daemon

    # -- life cycle --------------------------------------------------------------

    def bind(self) -> None:
        gid = self.config.socket_gid()
        if gid is None:
            ensure_private_dir(self.config.runtime_dir)
        else:  # tenant users (krex.daemon.users) may reach the socket, not list the dir
            ensure_shared_dir(self.config.runtime_dir, gid,
                              0o750 if self.config.group else 0o710)
        self._take_lock()
        path = self.config.socket_path
        if os.path.exists(path):
            os.unlink(path)  # stale: we hold the lock, so no live daemon owns it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        shared = self.config.group_access or gid is not None
        old = os.umask(0o117 if shared else 0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, 0o660 if shared else 0o600)
        sock.listen(512)
        sock.settimeout(0.2)
        self.sock = sock

    def _take_lock(self) -> None:
        fd = os.open(self.config.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(
                f"a krex daemon already serves {self.config.runtime_dir}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lockfile = fd

    def serve_forever(self) -> None:
        assert self.sock is not None
        if self._signals:  # a signal came while the daemon was starting: stop cleanly
            self.core.accepting = False
        threading.Thread(target=self._ticker, name="krex-tick", daemon=True).start()
        while self.core.accepting:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                self._maybe_idle_exit()
                continue
            except OSError as exc:
                if not self.core.accepting:
                    break
                self._accept_failed(exc)
                continue
            try:
                threading.Thread(target=self._serve_session, args=(conn,), daemon=True).start()
            except RuntimeError as exc:  # no thread for it: refuse this one, serve the rest
                log.warning("refused a connection: %s", exc)
                conn.close()
        self._finish()

    def _accept_failed(self, exc: OSError) -> None:
        """Out of file descriptors (or memory): the connection stays in the backlog;
        pause so whatever holds them can let go, log once per burst, and go on."""
        self.accept_errors += 1
        if self.accept_errors == 1 or self.accept_errors % 100 == 0:
            level = logging.WARNING if exc.errno in _TRANSIENT_ACCEPT else logging.ERROR
            log.log(level, "accept() failed (%d so far): %s", self.accept_errors, exc)
        time.sleep(ACCEPT_PAUSE_S)

    def _shed(self, conn: socket.socket, exc: OSError) -> None:
        """A connection accepted with the last descriptor, which then had none to look
        at its peer: tell the client why and close it (the accept loop goes on)."""
        self.shed_connections += 1
        if self.shed_connections == 1 or self.shed_connections % 100 == 0:
            log.warning("shed a connection (%d so far), out of file descriptors or memory: "
                        "%s", self.shed_connections, exc)
        err = LimitExceeded(
            f"the krex daemon could not serve this connection: {exc.strerror or exc}",
            hint="close idle connections to the daemon, or start it with a higher "
                 "'ulimit -n'; then retry")
        try:
            conn.settimeout(0.5)
            conn.sendall(encode_frame(m.ErrorReply.of(err).to_dict()))
        except OSError:
            pass
        conn.close()

    def _maybe_idle_exit(self) -> None:
        limit = self.config.idle_exit_s
        d = self.core
        quiet_s = time.monotonic() - d.last_activity_mono_s
        if limit and not self.sessions and d.idle() and quiet_s > limit:
            log.info("idle for %.0f s: exiting", limit)
            d.accepting = False

    def _ticker(self) -> None:
        """Wake at the scheduler's next deadline (revocations, wait timeouts, fair
        windows); reap jobs and check the guardian every half second.  An exception is
        logged and the loop goes on; a deadline already past never makes it spin."""
        priority.elevate()
        d = self.core
        next_chores = 0.0
        last = math.nan
        while d.accepting:
            try:
                deadline = d.tick()
                now = time.monotonic()
                if now >= next_chores:
                    d.reap_jobs()
                    d.housekeeping()
                    self._exit_without_owner()
                    next_chores = time.monotonic() + HOUSEKEEPING_S
                floor = STUCK_TICK_S if deadline == last and deadline <= now else MIN_TICK_S
                last = deadline
                self._sleep(d, min(max(deadline - time.monotonic(), floor),
                                   max(next_chores - time.monotonic(), floor), 0.5))
            except Exception:  # the ticker must outlive any bug: log, pause, go on
                log.exception("ticker: unexpected error (continuing)")
                time.sleep(0.1)

    def _exit_without_owner(self) -> None:
        try:
            gone = self._owner is not None and not self._owner.alive()
        except OSError:  # out of descriptors, say: not known to be gone
            return
        if gone:
            assert self._owner is not None
            log.info("process %d (--exit-with) is gone: exiting", self._owner.pid)
            self.core.accepting = False

    @staticmethod
    def _sleep(d: Daemon, wait: float) -> None:
        with d.lock:
            d.planned_wake_mono_s = time.monotonic() + wait
            if d.accepting:
                d.wakeup.wait(wait)
            d.planned_wake_mono_s = 0.0

    def _finish(self) -> None:
        t0 = time.monotonic()
        self._let_holders_finish()
        t1 = time.monotonic()
        self.core.shutdown()
        log.info("stopping: holders finished in %.2f s, shut down in %.2f s",
                 t1 - t0, time.monotonic() - t1)
        for s in list(self.sessions):
            s.close()
        if self.sock:
            self.sock.close()
        try:
            os.unlink(self.config.socket_path)
        except FileNotFoundError:
            pass
        if self._lockfile is not None:
            os.close(self._lockfile)

    def _let_holders_finish(self) -> None:
        """Admissions are closed; give regions already granted time to end by themselves
        (none when the harness it served is gone: nobody is measuring)."""
        gone = False
        with contextlib.suppress(OSError):
            gone = self._owner is not None and not self._owner.alive()
        deadline = time.monotonic() + (0.0 if gone else self.config.shutdown_grace_s)
        while self.core.held_regions() and time.monotonic() < deadline and self._signals < 2:
            time.sleep(0.01)

    def install_signal_handlers(self) -> None:
        """First SIGTERM/SIGINT: stop admitting and finish; second: exit now (still thawing)."""

        def on_signal(signum: int, frame: Any) -> None:
            self._signals += 1
            if self._signals == 1:  # stacks in the log if stopping is slow (#12)
                faulthandler.dump_traceback_later(self.config.shutdown_grace_s + 2.0,
                                                  file=sys.stderr)
            if self.daemon is not None:
                self.daemon.accepting = False
            # (still starting: serve_forever sees _signals and stops at once)
            if self._signals >= 2:
                if self.daemon is not None:
                    self.daemon.emergency_stop()
                os._exit(1)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    # -- sessions -----------------------------------------------------------------

    def _serve_session(self, conn: socket.socket) -> None:
        priority.elevate()  # its thread may run a release's handoff or a grant's set-up
        conn.settimeout(None)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SEND_TIMEOUT_S))
        try:
            peer = peer_of(conn)
            session = Session(conn, peer, ProcessRef.of(peer.pid))
        except ProcessGone:  # the peer is gone already
            conn.close()
            return
        except OSError as exc:  # no descriptor left to read the peer's /proc/PID/stat
            self._shed(conn, exc)
            return
        try:
            self.core.access.admit(peer)
            self._count(peer.uid, +1)
        except KrexError as exc:
            session.push(m.ErrorReply.of(exc))
            session.close()
            return
        try:
            self._session_loop(session, FrameReader(conn))
        finally:
            self._count(peer.uid, -1, session)
            self.core.session_closed(session)
            session.close()

    def _count(self, uid: int, delta: int, session: Session | None = None) -> None:
        """Connections per uid: refuse one past the limit."""
        with self._sessions_lock:
            n = self._by_uid.get(uid, 0)
            if delta > 0 and n >= self.config.max_connections_per_uid:
                raise LimitExceeded(f"uid {uid} already has {n} connections open (the "
                                    "daemon's --max-connections-per-uid)")
            self._by_uid[uid] = n + delta
            if not self._by_uid[uid]:
                del self._by_uid[uid]
            if session is not None:
                self.sessions.discard(session)

    def _track(self, session: Session) -> None:
        with self._sessions_lock:
            self.sessions.add(session)

    def _session_loop(self, session: Session, reader: FrameReader) -> None:
        self._track(session)
        session.reader = reader
        greeted = False
        while True:
            session.handling = False
            try:
                data = reader.read()
                session.handling = True
            except ConnectionClosed:
                return
            except ProtocolError as exc:  # oversized or undecodable: framing may be lost
                session.push(m.ErrorReply.of(exc, None))
                if exc.code == "frame_too_large":
                    return
                continue
            except OSError:
                return
            re = data.get("id") if isinstance(data.get("id"), int) else None
            try:
                msg = m.parse_message(data)
                if not greeted:
                    self._greet(session, msg)
                    greeted = True
                    continue
                reply = self.core.handle(session, msg)
            except VersionMismatch as exc:
                session.push(m.ErrorReply.of(exc, re))
                return
            except KrexError as exc:
                session.push(m.ErrorReply.of(exc, re))
                continue
            except Exception as exc:  # a bug must not take the daemon down
                log.exception("internal error handling %s", data.get("type"))
                session.push(m.ErrorReply.of(InternalError(repr(exc)), re))
                continue
            if reply is not None:
                session.push(m.Reply(re=msg.id, data=reply))

    def _greet(self, session: Session, msg: m.Message) -> None:
        if not isinstance(msg, m.Hello):
            raise ProtocolError(f"expected hello first, got {msg.type!r}")
        if msg.version != m.VERSION:
            raise VersionMismatch(
                f"client speaks protocol version {msg.version}, daemon speaks {m.VERSION}"
            )
        data = {"version": m.VERSION, "daemon_pid": os.getpid(), "max_frame": reader_limit(),
                **installation()}
        session.push(m.Reply(re=msg.id, data=data))


def reader_limit() -> int:
    from krex.protocol.framing import MAX_FRAME

    return MAX_FRAME


def _timeval(seconds: float) -> bytes:
    import struct

    return struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))


def serve(config: DaemonConfig) -> int:
    """Run a daemon in the foreground until stopped; returns an exit code."""
    logging.basicConfig(level=logging.INFO, format="krexd: %(message)s", stream=sys.stderr)
    server = Server(config)
    # Handlers before the socket appears: a SIGTERM as soon as a client can connect
    # takes the clean path (socket, lock and cgroups removed), not the default action.
    server.install_signal_handlers()
    try:
        server.bind()
    except AlreadyRunning as exc:
        print(f"krex: {exc.message} (hint: {exc.hint})", file=sys.stderr)
        return 0 if config.embedded else 1
    except KrexError as exc:
        print(f"krex: error: {exc.message} (hint: {exc.hint})", file=sys.stderr)
        return 1
    priority.configure(config.nice, config.rt_priority, config.reserved_cores())
    if os.environ.get("KREX_DAEMON_TRACEMALLOC"):  # what the daemon keeps (docs/service.md)
        from krex import memtrace

        memtrace.install(memtrace.DAEMON_ENV)
    server.daemon = Daemon(config)
    # the accepting thread, after what it started at start-up (the guardian, the event
    # writer) began at nice 0 on every core (SCHED_RESET_ON_FORK; widened)
    if (config.nice or config.rt_priority) and not priority.elevate():
        log.info("daemon threads keep their priority: %s", priority.describe()["why"])
    log.info("pid %d serving on %s", os.getpid(), config.socket_path)
    server.serve_forever()
    log.info("stopped")
    return 0


def _owner(pid: int | None) -> ProcessRef | None:
    """The process ``--exit-with`` names, by pid and start time (a reused pid is not it);
    one already gone is refused at start."""
    if pid is None:
        return None
    try:
        return ProcessRef.of(pid)
    except ProcessGone:
        raise BadRequest(f"--exit-with {pid}: no such process",
                         hint="pass the pid of the process the daemon should not outlive") \
            from None
