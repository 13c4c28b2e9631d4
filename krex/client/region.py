"""``krex.region()``: the critical region as a context manager and decorator.

Entering blocks until the daemon grants the device; leaving releases it, and
``Region.report`` is the daemon's evidence (a
:class:`~krex.protocol.report.RegionReport`).  Re-entrant within one
thread (an inner region on the same device is part of the outer one); each
thread has its own connection, so regions from several threads of one job
queue at the daemon and are serialised there.  A process not started by
``krex run`` registers itself as an ad-hoc job on first use.  Entering that
is interrupted (Ctrl-C, a signal handler's exception) withdraws the request
(the protocol's ``cancel``): nothing is left queued or granted behind it.

Leaving does not wait for the daemon's reply (the report, made after the daemon has
handed the device on): the job's next request leaves before that handoff freezes the
job, instead of after its next thaw.  ``Region.report`` waits for the reply when first
read; replies already here are taken once the thread's next request has left, the
rest at the process's exit (a revocation warns then).

``krex.regions(n)`` takes ``n`` regions back to back: each release also asks
for the job's next region (the protocol's ``release`` with ``again``), so the
job is queued again before the daemon hands the device on and freezes it.  With several jobs doing
that, every handoff goes straight to a queued job; a chain of handoffs does not
end with the device idle until a frozen job is thawed and asks again.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from krex.client.connection import Connection
from krex.devices.discovery import parse_device
from krex.errors import DaemonNotRunning
from krex.protocol import messages as m
from krex.protocol.address import socket_path
from krex.protocol.report import REPORT_FORMAT, Outcome, RegionReport

F = TypeVar("F", bound=Callable[..., Any])


class RegionRevokedWarning(UserWarning):
    """A region outlived its maximum hold: the daemon revoked it."""


class RegionReportLostWarning(UserWarning):
    """A released region's report never came (the daemon went away, say), and nobody
    had read it yet: reading ``Region.report`` raises why."""


class _State(threading.local):
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conn: Connection | None = None
        self.depth: dict[str, int] = {}
        self.outer: dict[str, dict[str, Any]] = {}  # device -> the outermost region's grant
        self.unsettled: list[Region] = []  # released, their reports not read yet


_state = _State()
_jobs: dict[tuple[Any, ...], int] = {}
_jobs_lock = threading.Lock()
# Every thread's released regions whose reports have not been read, for the exit's
# settling (:func:`settle_released`); entries are removed as they are settled.
_unsettled: dict[int, tuple[int, Region]] = {}  # id -> (the process, the region)
_unsettled_lock = threading.Lock()
_settling_at_exit: set[int] = set()  # the processes whose exit settles them (pids)
# How long the process's exit waits for the reports of its last regions.
SETTLE_AT_EXIT_S = 10.0


_REVOKED = Outcome.REVOKED.value


def _connection(fresh: bool = False) -> Connection:
    """This thread's connection; a new one after fork, or when the daemon changed."""
    conn = _state.conn
    if fresh or conn is None or conn.broken or _state.pid != os.getpid() \
            or conn.path != socket_path():
        if conn is not None and _state.pid == os.getpid():
            settle_released(block=not conn.broken)  # their replies come on this connection
            conn.close()
        if _state.pid != os.getpid():  # a fork's child: nothing of the parent's is its own
            _state.depth, _state.outer, _state.unsettled = {}, {}, []
        _state.pid = os.getpid()
        _state.conn = conn = Connection()
    return conn


def close_if_held() -> bool:
    """A warm worker's program has ended: when it left a region open on this thread, close
    the connection, so the daemon releases the region now (``owner_gone``) instead of
    at its maximum hold -- the next program in the worker, the same job, would wait for
    that.  Returns whether it did."""
    conn = _state.conn
    if conn is None or _state.pid != os.getpid():
        return False
    settle_released(block=not conn.broken)  # this program's reports, not the next one's
    if not any(_state.depth.values()):
        return False
    _state.conn, _state.depth, _state.outer = None, {}, {}
    conn.close()
    return True


def _job_id(conn: Connection, device: str) -> int:
    """The job this process belongs to: the managed one, or an ad-hoc one of its own."""
    env_job = os.environ.get("KREX_JOB_ID")
    key = (os.getpid(), conn.path, conn.welcome.get("daemon_pid"), env_job or device)
    with _jobs_lock:
        if key not in _jobs:
            if env_job:
                reply = conn.call(m.Register(job_id=int(env_job)))
            else:
                # A service's bench (KREX_TENANT): the ad-hoc job counts against its tenant.
                reply = conn.call(m.Register(device=device, name=_program_name(),
                                             tenant=os.environ.get("KREX_TENANT") or None))
            _jobs[key] = int(reply["job_id"])
        return _jobs[key]


def _program_name() -> str:
    import sys

    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else f"pid-{os.getpid()}"


class Region:
    """One critical region; use ``with krex.region(...)`` or ``@krex.region(...)``."""

    def __init__(self, device: str | None = None, *, max_hold_s: float | None = None,
                 label: str | None = None, timeout_s: float | None = None) -> None:
        self.device = parse_device(device)
        self.max_hold_s = max_hold_s
        self.label = label
        self.timeout_s = timeout_s
        self._report: RegionReport | None = None
        self._report_data: dict[str, Any] | None = None  # as received, until first read
        self._released: tuple[Connection, int] | None = None  # the release, not answered yet
        self._lost: BaseException | None = None  # why its report never came
        self.grant: dict[str, Any] | None = None
        self._nested = False
        self._t0 = 0.0
        # a nested region's own counters (krex.enforce.contention), then what they said
        self._watch: Any = None

    @property
    def report(self) -> RegionReport | None:
        """The daemon's evidence of this region, once it is released.  The release does
        not wait for it (module docstring): the first read waits for the daemon's reply,
        and decodes it; a loop that releases and acquires again pays for neither on its
        way to the next region.  Raises the release's error (the daemon gone, say)."""
        if self._released is not None:
            self._settle(block=True, reading=True)
        if self._lost is not None:
            raise self._lost
        if self._report_data is not None:
            self._report, self._report_data = RegionReport.from_dict(self._report_data), None
        return self._report

    @report.setter
    def report(self, value: RegionReport | None) -> None:
        self._report, self._report_data = value, None

    @property
    def region_id(self) -> int | None:
        return self.grant["region"] if self.grant else None

    def __enter__(self) -> Region:
        return self._enter(None)

    def _enter(self, pending: tuple[Connection, int] | None) -> Region:
        """Enter; ``pending``: this job's acquire already sent on that connection (by the
        previous region's release, :func:`regions`): its grant is waited for instead."""
        conn = _connection()
        depth = _state.depth.get(self.device, 0)
        _state.depth[self.device] = depth + 1
        self._nested = depth > 0
        self._t0 = time.monotonic()
        if self._nested:
            self._watch = _self_watch()
            return self
        try:
            try:
                if pending is not None and pending[0] is conn and not self._nested:
                    _settle_here()  # (the request left with the previous release)
                    self.grant = conn.await_grant(pending[1])
                else:
                    self.grant = self._acquire(conn)
            except DaemonNotRunning:  # the daemon restarted since this thread last used it
                self.grant = self._acquire(_connection(fresh=True))
        except BaseException:
            _state.depth[self.device] = depth
            raise
        _state.outer[self.device] = self.grant
        if self.grant.get("nested"):  # inside a whole-job hold: nothing enforced of its own
            self._watch = _self_watch()
        return self

    def _acquire(self, conn: Connection) -> dict[str, Any]:
        # earlier releases' replies that are here are taken once this request has left
        return conn.acquire(self._request(conn), while_waiting=_settle_here)

    def _request(self, conn: Connection) -> m.Acquire:
        job = _job_id(conn, self.device)
        # A program a service runs for a tenant (an ``exec`` with ``tenant``) gets
        # KREX_TENANT: its regions use that tenant's share (only operators may name one).
        return m.Acquire(job_id=job, device=self.device, label=self.label,
                         max_hold_s=self.max_hold_s, timeout_s=self.timeout_s,
                         tenant=os.environ.get("KREX_TENANT") or None)

    def __exit__(self, *exc: object) -> None:
        self._leave(again=False)

    def _leave(self, again: bool) -> tuple[Connection, int] | None:
        """Release; ``again``: ask for the job's next region with the release (returned:
        the connection and that acquire's request id, for the next region's ``_enter``)."""
        _state.depth[self.device] -= 1
        if self._nested:
            self.report = self._judged(self._nested_report())
            return None
        _state.outer.pop(self.device, None)
        conn = _connection()
        assert self.grant is not None
        rid = self.grant["region"]
        pending = None
        if not again:
            released = conn.send(m.Release(region=rid))
        else:  # the daemon asks for the next region before it hands the device on
            released, nxt = conn.release_again(rid)
            pending = (conn, nxt)
        conn.pipelined(released)
        self._released = (conn, released)
        if self._watch is not None:  # its counters end here, not when the reply is taken
            self._watch = self._watch.finish()
        # Not waited for: the daemon hands the device on and makes the report meanwhile,
        # while this job goes on to its next request (sent before the handoff freezes it,
        # so that its next grant needs no more of its own code than the reply's read).
        # Replies already here are taken once that request has left (a revocation warns
        # then), or when the report is read.
        _remember(self)
        return pending

    def _settle(self, block: bool, reading: bool = False) -> bool:
        """Take the release's reply (waiting for it if ``block``): the report kept for
        :attr:`report`, a revocation warned of, a reply that cannot come warned of unless
        the report is being read (``reading``: that read raises).  False: not here yet."""
        if self._released is None:
            return True
        conn, released = self._released
        if not block and not conn.replied(released):
            return False
        self._released = None
        _forget(self)
        rid = self.grant["region"] if self.grant else None
        try:
            data = conn.wait_reply(released)["report"]
            if self._watch is not None or data.get("format") != REPORT_FORMAT:
                self.report = self._judged(RegionReport.from_dict(data))  # a bad one raises
            else:
                self.report, self._report_data = None, data
        except Exception as exc:  # noqa: BLE001 - raised by .report; warned of when not read
            self._lost = exc
            if not reading:
                warnings.warn(f"krex region {rid}: no report ({exc})", RegionReportLostWarning,
                              stacklevel=2)
            return True
        pushed = conn.revoked.pop(rid, None) if rid is not None else None
        if data.get("outcome") == _REVOKED:
            reason = pushed or self.report.why_not_clean()  # type: ignore[union-attr]
            warnings.warn(f"krex region {rid} was revoked: {reason}", RegionRevokedWarning,
                          stacklevel=3)
        return True

    def _judged(self, report: RegionReport) -> RegionReport:
        """A nested region judged by its own holder's evidence, like a daemon region."""
        watch, self._watch = self._watch, None
        if watch is None:
            return report
        host, reasons = watch if isinstance(watch, tuple) else watch.finish()
        return dataclasses.replace(report, host=report.host or host,
                                   reasons=[*report.reasons, *reasons])

    def _nested_report(self) -> RegionReport:
        """What is known of a region inside an outer one of this thread: the outer
        region's id, this one's hold; its cleanliness is the outer region's."""
        outer = _state.outer.get(self.device) or {}
        now = time.monotonic()
        return RegionReport(device=self.device, region=outer.get("region"), label=self.label,
                            outcome=Outcome.NESTED, nested=True,
                            exclusive=bool(outer.get("exclusive", True)),
                            held_s=now - self._t0, granted_mono_s=self._t0,
                            released_mono_s=now)

    def __call__(self, fn: F) -> F:
        device, max_hold_s, label, timeout_s = (self.device, self.max_hold_s, self.label,
                                                 self.timeout_s)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Region(device, max_hold_s=max_hold_s, label=label, timeout_s=timeout_s):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _remember(r: Region) -> None:
    _state.unsettled.append(r)
    with _unsettled_lock:  # (no module name is rebound: krex.evaluate checks them)
        _unsettled[id(r)] = (os.getpid(), r)
        if os.getpid() not in _settling_at_exit:  # once per process (a fork's child too)
            _settling_at_exit.add(os.getpid())
            atexit.register(_settle_at_exit, os.getpid())


def _forget(r: Region) -> None:
    if r in _state.unsettled:
        _state.unsettled.remove(r)
    with _unsettled_lock:
        _unsettled.pop(id(r), None)


def settle_released(block: bool = True) -> None:
    """This thread's released regions whose reports are here (``block``: all of them,
    waiting for each) are settled: reports kept, revocations warned of."""
    if _state.pid != os.getpid():  # a fork's child: those are its parent's to take
        _state.unsettled = []
        return
    for r in list(_state.unsettled):
        if not r._settle(block) and not block:
            return  # the replies come in order: the later ones are not here either


def _settle_here() -> None:
    settle_released(block=False)


def _settle_at_exit(pid: int) -> None:
    """The process ends: its last regions' reports are waited for (briefly), so that a
    revocation is still warned of; the daemon has recorded them either way."""
    if pid != os.getpid():
        return
    with _unsettled_lock:  # a fork's child leaves its parent's connections alone
        left = [r for owner, r in _unsettled.values() if owner == pid]
    for r in left:
        if r._released is None:
            continue
        conn = r._released[0]
        if conn.broken:
            continue
        try:
            conn.reply_timeout_s = min(conn.reply_timeout_s or SETTLE_AT_EXIT_S, SETTLE_AT_EXIT_S)
            r._settle(block=True)
        except Exception:  # noqa: BLE001 - exiting: the daemon has the report
            continue


def _self_watch() -> Any:
    from krex.enforce.contention import SelfWatch  # only nested regions pay the import

    return SelfWatch()


def region(device: str | None = None, *, max_hold_s: float | None = None,
           label: str | None = None, timeout_s: float | None = None) -> Region:
    """A critical region on ``device`` (default: ``$KREX_DEVICE`` or ``cpu``)."""
    return Region(device, max_hold_s=max_hold_s, label=label, timeout_s=timeout_s)


def regions(count: int, device: str | None = None, *, max_hold_s: float | None = None,
            label: str | None = None, timeout_s: float | None = None) -> Iterator[Region]:
    """``count`` regions on ``device``, back to back: ``for r in krex.regions(100): ...``
    (the body runs inside each; ``r.report`` once its region is left).

    Each release also asks for the job's next region (module docstring): the job stays
    in the device's queue between its regions.  Leaving the loop early (``break``, an
    exception) releases the region and sends no further request; keep the loop's
    iterator in no variable of its own, or close it (``contextlib.closing``), so that
    it is let go at once.  Inside an outer region of the same device the regions are
    nested ones, as with :func:`region`."""
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    def make() -> Region:
        return Region(device, max_hold_s=max_hold_s, label=label, timeout_s=timeout_s)

    pending: tuple[Connection, int] | None = None
    r = make()
    for i in range(count):
        r._enter(pending)
        try:
            yield r
        except BaseException:
            r._leave(again=False)
            raise
        pending = r._leave(again=i + 1 < count)
        r = make()
