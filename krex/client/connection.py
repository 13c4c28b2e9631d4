"""A connection to the node daemon and the blocking request/reply calls.

One :class:`Connection` is used by one thread at a time (``krex.region``
keeps one per thread).  Replies are matched to requests by id; a
``revoked`` notice that arrives in between is remembered, not lost.  An
``acquire`` interrupted while it waits (Ctrl-C, any exception) is withdrawn
with ``cancel``, so the daemon never grants it to nobody; where even that
fails the connection is closed (the daemon then ends everything it held) and
marked ``broken``.  ``regions`` and ``jobs`` come in pages.

Requests may be pipelined (``send(..., pipelined=True)``; ``release_again``:
a release that also asks for the job's next region, as ``krex.regions`` does);
a reply to a pipelined request that arrives while another is waited for is
kept for its own :meth:`~Connection.wait_reply`, never dropped.

No call waits forever on a daemon that stopped answering (SIGSTOP, a wedge):
a request the daemon answers at once (``status``, ``release``, the
handshake, ...) must be answered within ``reply_timeout_s``; a wait that may
legitimately be long (``acquire`` queued behind other holders, ``exec``
running a program) is not timed itself, but after ``probe_after_s`` of
silence the client sends ``ping`` on the same connection and that must be
answered within ``reply_timeout_s``.  A long queue is therefore never taken
for a dead daemon, and a stopped daemon is noticed within about
``probe_after_s + reply_timeout_s``.  Then :class:`~krex.errors.DaemonUnresponsive`
is raised and the connection is closed, so a daemon that resumes ends
whatever the connection held or waited for.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from krex.client.autostart import ensure_daemon
from krex.errors import (
    AccessDenied,
    DaemonMismatch,
    DaemonNotRunning,
    DaemonUnresponsive,
    KrexError,
    OfferLapsed,
    from_wire,
)
from krex.protocol import messages as m

if TYPE_CHECKING:
    from krex.protocol.runas import RunAs
from krex.protocol.address import forget_node_socket, is_node_choice, socket_path
from krex.protocol.framing import ConnectionClosed, FrameReader, encode_frame
from krex.protocol.installation import mismatch
from krex.protocol.liveness import PATIENT, Watch, lock_pid, reply_timeout_from_env
from krex.protocol.runas import RunAs
from krex.workers.spec import ExecRequest, ExecResult

CANCEL_TIMEOUT_S = 5.0
# An offer is taken only while more than this is left of its claim window (the daemon's
# --requeue-ms, 5 ms by default): the claim must reach the daemon before it closes.
OFFER_MARGIN_S = 0.001
# The tenant this thread's programs run for, where a trusted peer (the HTTP/MCP service)
# acts for one: ``exec``/``submit``/``execute`` send it unless given a ``tenant``.
ACTING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("krex_acting_for",
                                                                       default=None)
OutputSink = Callable[[str, str], object]  # (stream, text) of a running program; result unused


class Connection:
    """``check_installation``: refuse a daemon of another krex installation
    (:class:`~krex.errors.DaemonMismatch`); ``krex status`` and ``krex stop`` talk to any."""

    def __init__(self, path: str | None = None, *, autostart: bool = True,
                 client: str = "python", check_installation: bool = True,
                 reply_timeout_s: float | None = None) -> None:
        self.path = path or socket_path()
        self.reply_timeout_s = (reply_timeout_from_env() if reply_timeout_s is None
                                else reply_timeout_s) or None
        node = self._node_socket() if path is None else None
        if node is None:
            if autostart and "KREX_SOCKET" not in os.environ and path is None:
                ensure_daemon(self.path)
            node = _connect(self.path, self.reply_timeout_s)
        self.sock: socket.socket = node
        self._patient: set[int] = set()
        self._pipelined: set[int] = set()  # sent ahead: their replies are kept, not skipped
        self._early: dict[int, dict[str, Any]] = {}  # such replies, read while waiting
        # Offers (messages.Offer) of re-queued regions, by region; the acquires sent to
        # take one, by region (their replies are read as the region's release is sent); the
        # newest region granted here (a later offer of it is stale: it was asked for).
        self.offers: dict[int, dict[str, Any]] = {}
        self._claims: dict[int, int] = {}
        self._newest_region = 0
        self.reader = FrameReader(self.sock)
        self._ids = itertools.count(1)
        self.revoked: dict[int, str] = {}
        self.broken = False
        self.welcome = self.call(m.Hello(version=m.VERSION, client=client))
        self.mismatch = mismatch(self.welcome)
        if self.mismatch and check_installation:
            self.close()
            raise DaemonMismatch(f"{self.mismatch} (socket {self.path}, daemon pid "
                                 f"{self.welcome.get('daemon_pid')})",
                                 pid=self.welcome.get("daemon_pid"))

    def _node_socket(self) -> socket.socket | None:
        """Connected to the node daemon when it was chosen and answers; a stale node
        socket (its daemon died) is passed over and ``path`` becomes our own daemon's."""
        if not is_node_choice(self.path):
            return None
        try:
            return _connect(self.path, self.reply_timeout_s)
        except DaemonNotRunning:  # connection refused: never autostart in the node's dir
            forget_node_socket(self.path)
            self.path = socket_path()
            return None

    def call(self, message: m.Message,
             on_output: OutputSink | None = None) -> dict[str, Any]:
        """Send a request and block until its reply; raise the daemon's error if any.

        ``output`` frames for this request (a running ``exec``) go to ``on_output``.
        """
        return self.wait_reply(self.send(message), on_output)

    def send(self, message: m.Message, *, pipelined: bool = False) -> int:
        """Send a request; return its id (for :meth:`wait_reply`).  ``pipelined``: sent
        before the reply to an earlier request is read; its own reply is kept until
        :meth:`wait_reply` asks for it (the caller must ask, or :meth:`cancel` it)."""
        rid = next(self._ids)
        payload = message.to_dict()
        payload["id"] = rid
        data = encode_frame(payload)
        try:
            self.sock.settimeout(self.reply_timeout_s)
            self.sock.sendall(data)
        except TimeoutError:
            raise self._unresponsive("took no request") from None
        except OSError as exc:
            said = self._last_word()
            if said is not None:  # it refused us first (the per-uid connection cap)
                raise said from None
            raise DaemonNotRunning(f"connection to the daemon lost: {exc}") from None
        if isinstance(message, m.Release) and message.region in self._claims:
            self._settle_claim(message.region)
        if message.type in PATIENT:
            self._patient.add(rid)
        if pipelined:
            self._pipelined.add(rid)
        return rid

    def pipelined(self, rid: int) -> None:
        """The reply to ``rid`` (sent already) is kept until :meth:`wait_reply` asks."""
        self._pipelined.add(rid)

    def release_again(self, region: int) -> tuple[int, int]:
        """Send ``release`` for ``region`` with ``again``: the job's next region is asked
        for (with the released one's parameters) before the device is handed on.  Returns
        the release's request id and the new acquire's, whose grant is waited for with
        :meth:`await_grant` (or withdrawn with :meth:`cancel`)."""
        again = next(self._ids)
        self._patient.add(again)  # an acquire: it may wait long for its grant
        self._pipelined.add(again)  # its grant may come before the release's reply
        try:
            return self.send(m.Release(region=region, again=again)), again
        except BaseException:
            self._patient.discard(again)
            self._pipelined.discard(again)
            raise

    def acquire(self, message: m.Acquire,
                while_waiting: Callable[[], object] | None = None) -> dict[str, Any]:
        """Acquire a region; if waiting for the grant is interrupted, withdraw it.  A
        fresh offer this acquire may take is taken at once (see :meth:`_offer_for`).
        ``while_waiting``: run once the request is sent, before its grant is awaited
        (work that should not delay the request: earlier releases' reports)."""
        offer = self._offer_for(message)
        if offer is None:
            # (its reply is kept if ``while_waiting`` reads it: krex.region's settling)
            rid = self.send(message, pipelined=while_waiting is not None)
            if while_waiting is not None:
                try:
                    while_waiting()
                except BaseException:
                    self.cancel(rid)
                    raise
            return self.await_grant(rid)
        region = int(offer["region"])
        rid = self.send(dataclasses.replace(message, claim=region), pipelined=True)
        self._newest_region = max(self._newest_region, region)
        if time.monotonic() < float(offer["claim_by_mono_s"]):
            # Sent within the window: the daemon reads it before the region can lapse.
            self._claims[region] = rid
            return {"region": region, "device": offer["device"], "exclusive": True,
                    "offered": True}
        try:  # this process stalled past the window: the claim's answer decides
            return self.await_grant(rid)
        except OfferLapsed:  # the device moved on; nothing ran: ask as usual
            return self.await_grant(self.send(message))

    def _offer_for(self, message: m.Acquire) -> dict[str, Any] | None:
        """An offer (of a re-queued region, granted: its job thawed) that ``message``, a
        plain acquire of that job, device and tenant, takes; only while more than
        :data:`OFFER_MARGIN_S` of its claim window is left, so that the claim arrives
        before the window closes.  If it does not (this process stalled in between), the
        daemon answers ``offer_lapsed`` and the region's release raises it.  Every offer
        is for one acquire: the others are dropped."""
        if message.whole_job or message.claim is not None:
            return None
        self._read_ready()
        offers, self.offers = self.offers, {}
        now = time.monotonic()
        for o in offers.values():
            device = message.device == o.get("device") or (
                message.device is None and bool(o.get("job_device")))
            tenant = message.tenant == o.get("tenant") or (
                message.tenant is None and bool(o.get("job_tenant")))
            if int(o.get("region", 0)) > self._newest_region and \
                    o.get("job_id") == message.job_id and device and tenant and \
                    now < float(o.get("claim_by_mono_s", 0.0)) - OFFER_MARGIN_S:
                return o
        return None

    def _read_ready(self) -> None:
        """Read the frames already here, without waiting (offers pushed meanwhile).  A
        frame's first part stays in the reader for the next (blocking) read."""
        self.sock.settimeout(0.0)  # every blocking use sets its own timeout first
        while True:
            try:
                data = self.reader.read()
            except (BlockingIOError, TimeoutError):
                return
            except (ConnectionClosed, OSError) as exc:
                raise DaemonNotRunning(f"connection to the daemon lost: {exc}") from None
            self._aside(data)

    def _aside(self, data: dict[str, Any]) -> bool:
        """Keep a frame that is not the reply being waited for: an offer, a revocation,
        a pipelined request's reply.  False: none of these."""
        kind = data.get("type")
        if kind == "offer":
            if int(data.get("region", 0)) > self._newest_region:  # else: asked for already
                self.offers[int(data["region"])] = data
            return True
        if kind == "revoked":
            self.revoked[int(data.get("region", 0))] = str(data.get("reason", ""))
            return True
        if data.get("re") in self._pipelined and kind != "output":
            self._early[int(data["re"])] = data  # its own wait_reply takes it
            return True
        return False

    def replied(self, rid: int) -> bool:
        """Whether the reply to ``rid``, a request sent ``pipelined``, is here (frames
        already received are read, without waiting: every request whose reply is still
        to come must be ``pipelined``, else a reply read here is skipped)."""
        if rid not in self._early and not self.broken:
            try:
                self._read_ready()
            except DaemonNotRunning:
                self.broken = True
                return True  # its wait_reply says why
        return rid in self._early or self.broken

    def _settle_claim(self, region: int) -> None:
        """The reply to the acquire that took ``region``'s offer, read as the region's
        release is sent (it comes first): the daemon's error is raised (``offer_lapsed``
        cannot be, for a claim sent within the window, unless the daemon broke its word:
        the region's body then ran without the device, and its release says so)."""
        self.wait_reply(self._claims.pop(region))

    def await_grant(self, rid: int) -> dict[str, Any]:
        """The grant of the acquire sent as request ``rid``; withdrawn if the wait is
        interrupted."""
        try:
            grant = self.wait_reply(rid)
            # an offer of this region read before its grant (it was pushed first) is stale
            self._newest_region = max(self._newest_region, int(grant.get("region") or 0))
            return grant
        except KrexError as exc:
            if isinstance(exc, DaemonNotRunning):
                self.broken = True
            raise  # the daemon answered (or is gone): nothing is left to withdraw
        except BaseException:
            self.cancel(rid)
            raise

    def cancel(self, acquire: int, timeout_s: float = CANCEL_TIMEOUT_S) -> None:
        """Withdraw the acquire ``acquire`` (a region granted meanwhile is released).
        If that cannot be done, close the connection: the daemon ends its regions."""
        self._pipelined.discard(acquire)
        self._early.pop(acquire, None)  # granted meanwhile: the cancel releases it
        try:
            self.wait_reply(self.send(m.Cancel(acquire=acquire)), timeout_s=timeout_s)
        except (KrexError, OSError):  # the caller's own exception is the one to see
            self.broken = True
            self.close()
        except BaseException:  # interrupted again: give up on the connection
            self.broken = True
            self.close()
            raise

    def _last_word(self) -> KrexError | None:
        """The error the daemon sent before it closed the connection, still in our
        receive buffer (a refused connection closes before our first request lands:
        without this, the user saw "connection lost" instead of why)."""
        try:
            self.sock.settimeout(0.5)
            data = self.reader.read()
        except (ConnectionClosed, OSError, KrexError):
            return None
        return from_wire(data) if data.get("type") == "error" else None

    def wait_reply(self, rid: int, on_output: OutputSink | None = None, *,
                   timeout_s: float | None = None) -> dict[str, Any]:
        """The reply to request ``rid``; any frame in between proves the daemon alive.

        ``timeout_s`` (default ``reply_timeout_s``) bounds the silence: see the module."""
        patient = rid in self._patient
        self._patient.discard(rid)
        self._pipelined.discard(rid)
        early = self._early.pop(rid, None)
        if early is not None:
            if early.get("type") == "error":
                raise from_wire(early)
            return early.get("data") or {}
        watch = Watch(timeout_s or self.reply_timeout_s, patient)
        while True:
            data = self._read(watch)
            if data is None:  # silent for the probe interval: is the daemon there?
                watch.pinged(self.send(m.Ping()))
                continue
            kind = data.get("type")
            if kind in ("revoked", "offer"):
                self._aside(data)
                continue
            if data.get("re") not in (rid, None):
                self._aside(data)
                continue
            if kind == "output":
                if on_output is not None:
                    on_output(str(data.get("stream")), str(data.get("data", "")))
                continue
            if kind == "error":
                raise from_wire(data)
            return data.get("data") or {}

    def _read(self, watch: Watch) -> dict[str, Any] | None:
        """The next frame; None when it is time to ping; raise when the daemon is silent."""
        wait = watch.wait_s()
        if wait is not None and wait <= 0:
            if watch.may_ping():
                return None
            raise self._unresponsive(f"did not answer within {watch.limit_s:g} s")
        try:
            self.sock.settimeout(wait)
            data = self.reader.read()
        except TimeoutError:
            return self._read(watch)
        except (ConnectionClosed, OSError) as exc:
            raise DaemonNotRunning(f"connection to the daemon lost: {exc}") from None
        watch.heard()
        return data

    def _unresponsive(self, what: str) -> DaemonUnresponsive:
        """Give up on the connection (a daemon that resumes ends what it held)."""
        self.broken = True
        self.close()
        pid = self.welcome.get("daemon_pid") if hasattr(self, "welcome") else lock_pid(self.path)
        who = f"the krex daemon (pid {pid})" if pid else "the krex daemon"
        return DaemonUnresponsive(f"{who} at {self.path} {what}", pid=pid,
                                  seconds=self.reply_timeout_s)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _connect(path: str, timeout_s: float | None = None) -> socket.socket:
    """Connect; a full listen backlog (a stopped daemon, or one out of file descriptors)
    is retried until ``timeout_s``, then :class:`~krex.errors.DaemonUnresponsive`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            return _connect_once(path, timeout_s)
        except (BlockingIOError, TimeoutError):  # backlog full (with a timeout: EAGAIN)
            if deadline is not None and time.monotonic() >= deadline:
                raise DaemonUnresponsive(
                    f"the krex daemon at {path} accepted no connection within {timeout_s:g} s "
                    "(its backlog is full)", seconds=timeout_s) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.2)


def _connect_once(path: str, timeout_s: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except (BlockingIOError, TimeoutError):
        sock.close()
        raise
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise DaemonNotRunning(f"no krex daemon at {path} ({exc.strerror})") from None
    except PermissionError as exc:
        sock.close()
        raise AccessDenied(f"may not connect to the krex daemon at {path} ({exc.strerror})",
                           hint="a node daemon's socket is its group's (krex serve --node "
                                "--group): ask the operator to add you, or run your own "
                                "daemon with KREX_RUNTIME_DIR=DIR") from None
    return sock


class Client:
    """The Python API to a node daemon: jobs, regions, status."""

    def __init__(self, path: str | None = None, *, autostart: bool = True,
                 check_installation: bool = True, reply_timeout_s: float | None = None) -> None:
        self.conn = Connection(path, autostart=autostart, check_installation=check_installation,
                               reply_timeout_s=reply_timeout_s)
        self._lock = threading.Lock()

    def _call(self, message: m.Message,
              on_output: OutputSink | None = None) -> dict[str, Any]:
        _settle_released()
        with self._lock:
            return self.conn.call(message, on_output)

    def status(self) -> dict[str, Any]:
        return self._call(m.Status())

    def regions(self, job_ids: list[int] | None = None,
                limit: int | None = 1000) -> list[dict]:
        """The newest ``limit`` region records (``None``: every one the daemon keeps),
        oldest first; fetched page by page."""
        return self._pages(m.Regions, "regions", job_ids, limit)

    def jobs(self, job_ids: list[int] | None = None, limit: int | None = None) -> list[dict]:
        """Jobs, ended ones (oldest first) then live ones, with where their time went."""
        return self._pages(m.Jobs, "jobs", job_ids, limit)

    def _pages(self, kind: type[m.Regions] | type[m.Jobs], key: str,
               job_ids: list[int] | None, limit: int | None) -> list[dict]:
        pages: list[list[dict]] = []
        got, before = 0, None
        while limit is None or got < limit:
            want = m.PAGE_MAX if limit is None else min(m.PAGE_MAX, limit - got)
            reply = self._call(kind(job_ids=job_ids, limit=want, before=before))
            pages.append(reply[key])
            got += len(reply[key])
            before = reply.get("next_before")
            if before is None:
                break
        return [r for page in reversed(pages) for r in page]

    def register(self, job_id: int | None = None, *, name: str | None = None,
                 device: str | None = None) -> dict[str, Any]:
        return self._call(m.Register(job_id=job_id, name=name, device=device))

    def create_job(self, *, device: str | None, name: str | None, mode: str) -> dict[str, Any]:
        return self._call(m.CreateJob(device=device, name=name, mode=mode))

    def attach_job(self, job_id: int, pid: int) -> dict[str, Any]:
        return self._call(m.AttachJob(job_id=job_id, pid=pid))

    def end_job(self, job_id: int, exit_code: int | None) -> dict[str, Any]:
        return self._call(m.EndJob(job_id=job_id, exit_code=exit_code))

    def acquire(self, job_id: int, device: str | None = None, **kw: Any) -> dict[str, Any]:
        with self._lock:
            return self.conn.acquire(m.Acquire(job_id=job_id, device=device, **kw))

    def cancel(self, acquire: int) -> dict[str, Any]:
        """Withdraw an acquire by its request id (see :meth:`Connection.cancel`)."""
        return self._call(m.Cancel(acquire=acquire))

    def release(self, region: int) -> dict[str, Any]:
        return self._call(m.Release(region=region))

    def exec(self, path: str, args: list[str] | None = None, *, device: str | None = None,
             timeout_s: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None,
             on_output: OutputSink | None = None, tenant: str | None = None) -> ExecResult:
        """Run the Python program ``path`` in a warm worker of ``device``.

        The program sees ``args`` as ``sys.argv[1:]``, ``cwd`` and ``env`` (default:
        ours); its output goes to ``on_output(stream, text)`` live (default: our
        stdout/stderr).  ``tenant``: the regions it takes are that tenant's (trusted
        peers only; default :data:`ACTING_FOR`, else the peer's uid).  Returns the
        worker's :class:`ExecResult`.
        """
        kw = {"cwd": cwd or os.getcwd(), "env": dict(env if env is not None else os.environ),
              "timeout_s": timeout_s}
        return self._exec(ExecRequest.for_path(path, args, **kw), device, on_output, tenant)

    def submit(self, fn: Callable[..., Any], *args: Any, device: str | None = None,
               timeout_s: float | None = None, **kwargs: Any) -> ExecResult:
        """Call the picklable ``fn(*args, **kwargs)`` in a warm worker.

        The return value comes back pickled: ``result.returned()``.
        """
        req = ExecRequest.for_callable(fn, *args, **kwargs)
        req.timeout_s = timeout_s
        return self._exec(req, device, None)

    def execute(self, req: ExecRequest, *, device: str | None = None,
                on_output: Callable[[str, str], None] | None = None,
                tenant: str | None = None) -> ExecResult:
        """Run a prepared :class:`ExecRequest`; its output goes to ``on_output`` (default: ours)."""
        return self._exec(req, device, on_output, tenant)

    def _exec(self, req: ExecRequest, device: str | None,
              on_output: OutputSink | None, tenant: str | None = None) -> ExecResult:
        sink = on_output or _echo
        message = m.Exec(request=req.to_dict(), device=device,
                         tenant=tenant or ACTING_FOR.get())
        reply = self._call(message, on_output=sink)
        return ExecResult.from_dict(reply["result"])

    def stop(self) -> dict[str, Any]:
        return self._call(m.Stop())

    def stop_program(self, cwd: str) -> dict[str, Any]:
        """Kill the warm worker running the program started in ``cwd``, with its cgroup
        (operators): ``stopped``, ``worker_pid``, ``by`` (``cgroup`` or ``tree``)."""
        return self._call(m.StopProgram(cwd=cwd))

    def program_user(self, tenant: str | None = None) -> tuple[RunAs | None, int]:
        """Whom ``tenant``'s programs (default :data:`ACTING_FOR`) run as in the daemon's
        warm workers: a tenant's own user on a root daemon (None: the daemon's user), and
        the daemon's uid (operators; a service gives that user the folder a program
        writes, and runs a bench's commands as it)."""
        from krex.protocol.runas import RunAs

        reply = self._call(m.ProgramUser(tenant=tenant or ACTING_FOR.get()))
        return RunAs.from_dict(reply.get("run_as")), int(reply["daemon_uid"])

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settle_released() -> None:
    """This thread's ``krex.region()`` releases not answered yet are waited for first,
    so that what a thread asks the daemon after a release sees it carried out (its
    record in ``regions``, the device free in ``status``)."""
    region = sys.modules.get("krex.client.region")
    if region is not None:
        region.settle_released(block=True)


def _echo(stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()
