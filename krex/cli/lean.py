"""The lean client path of ``krex exec`` and ``krex status``: a command in a blink.

Agents start ``krex`` once per command, so these two speak the wire protocol
(docs/protocol.md: a 4-byte length, a JSON object) with the standard library
alone: no argparse, no dataclass messages, no rich.  :func:`run` takes a
command line first; one it does not parse (``--help``, ``--cluster``, an
abbreviated flag, a typo) returns None and goes to the full parser, which
runs or reports it.  The full commands call :func:`exec_program` and
:func:`status` too, so both paths behave alike.  The slow cases import what
they need when they happen: starting a daemon, an error reply, a daemon of
another installation.  tests/test_cli_startup.py fails when a heavy module
is imported here.
"""

from __future__ import annotations

import _socket  # not socket.py: its enums, selectors and array cost ~3 ms of every start
import os
import sys

from krex.cli import leanjson  # not json: ~20 ms of every start (leanjson's docstring)

VERSION = 1  # krex.protocol.messages.VERSION (tests/test_cli_startup.py checks they agree)
MAX_FRAME = 1 << 20  # krex.protocol.framing.MAX_FRAME (checked likewise)


def run(argv: list[str]) -> int | None:
    """Run ``krex ARGV`` when it is a plain ``exec`` or ``status``; None: not ours."""
    if argv[:1] == ["exec"]:
        opts = _exec_options(argv[1:])
        return None if opts is None else exec_program(**opts)
    if argv[:1] == ["status"] and argv[1:] in ([], ["--json"]):
        return status(json_out=len(argv) == 2)
    return None


def _exec_options(argv: list[str]) -> dict | None:
    """``[--json] [--device D] [--timeout-s S] PROG [ARGS...]`` as the full parser reads it
    (everything after PROG is the program's); None for anything else."""
    opts: dict = {"json_out": False, "device": None, "timeout_s": None}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        flag, eq, value = argv[i].partition("=")
        if flag == "--json" and not eq:
            opts["json_out"] = True
        elif flag in ("--device", "--timeout-s"):
            if not eq:
                i += 1
                if i == len(argv):
                    return None
                value = argv[i]
            key = "device" if flag == "--device" else "timeout_s"
            opts[key] = value if key == "device" else _number(value)
            if opts[key] is None:
                return None
        else:
            return None
        i += 1
    if i == len(argv):
        return None
    return {**opts, "program": argv[i], "args": argv[i + 1:]}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class Link:
    """One connection to the daemon: the handshake, then blocking request/reply calls."""

    def __init__(self, *, autostart: bool) -> None:
        from krex.protocol.address import socket_path  # stdlib and krex.errors only
        from krex.protocol.liveness import reply_timeout_from_env

        self.path = socket_path()
        self.limit_s = reply_timeout_from_env() or None
        self.sock = self._connect(autostart and "KREX_SOCKET" not in os.environ)
        self._buf = b""
        self._ids = 0
        self.welcome: dict = {}
        self.welcome = self.call({"type": "hello", "version": VERSION, "client": "cli"})
        self.mismatch = _mismatch(self.welcome)

    def _connect(self, autostart: bool) -> _socket.socket:
        from krex.protocol.address import forget_node_socket, is_node_choice, socket_path

        while True:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            sock.settimeout(self.limit_s)
            try:
                sock.connect(self.path)
                return sock
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if not is_node_choice(self.path):
                    break
                forget_node_socket(self.path)  # a dead node daemon's socket: use our own
                self.path = socket_path()
            except OSError:
                sock.close()
                break
        # No daemon, no access or a full backlog: the full client starts one, or says why not.
        from krex.client.connection import _connect

        if autostart:
            from krex.client.autostart import ensure_daemon

            ensure_daemon(self.path)
        return _connect(self.path, self.limit_s)

    def call(self, message: dict, on_output: object = None) -> dict:
        """Send ``message``; its reply's data.  ``output`` frames go to ``on_output``."""
        from krex.protocol.liveness import PATIENT, Watch

        rid = self._send(message)
        watch = Watch(self.limit_s, message["type"] in PATIENT)
        while True:
            data = self._read(watch)
            if data.get("re") not in (rid, None) or data.get("type") in ("revoked", "offer"):
                continue
            if data.get("type") == "output":
                _echo(str(data.get("stream")), str(data.get("data", "")))
                continue
            if data.get("type") == "error":
                from krex.errors import from_wire

                raise from_wire(data)
            return data.get("data") or {}

    def _send(self, message: dict) -> int:
        self._ids += 1
        body = leanjson.dumps({**message, "id": self._ids}).encode()
        try:
            self.sock.settimeout(self.limit_s)
            self.sock.sendall(len(body).to_bytes(4, "big") + body)
        except OSError as exc:
            said = self._last_word()
            if said is not None:  # it refused us first (the per-uid connection cap)
                raise said from None
            raise _daemon_gone(exc) from None
        return self._ids

    def _last_word(self) -> Exception | None:
        """The error the daemon sent before it closed the connection, still in our
        receive buffer (as krex.client.connection's): why, instead of "lost"."""
        try:
            self.sock.settimeout(0.5)
            while chunk := self.sock.recv(1 << 16):
                self._buf += chunk
        except OSError:
            pass
        length = int.from_bytes(self._buf[:4], "big")
        if len(self._buf) < 4 or len(self._buf) < 4 + length:
            return None
        try:
            data = leanjson.loads(self._buf[4:4 + length])
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("type") != "error":
            return None
        from krex.errors import from_wire

        return from_wire(data)

    def _read(self, watch: object) -> dict:
        length = int.from_bytes(self._take(4, watch), "big")
        if length > MAX_FRAME:
            from krex.errors import FrameTooLarge

            raise FrameTooLarge(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
        try:
            data = leanjson.loads(self._take(length, watch))
        except ValueError as exc:
            from krex.errors import ProtocolError

            raise ProtocolError(f"malformed frame from the daemon: {exc}") from None
        if not isinstance(data, dict):
            from krex.errors import ProtocolError

            raise ProtocolError("malformed frame from the daemon: not a JSON object")
        return data

    def _take(self, n: int, watch) -> bytes:  # watch: krex.protocol.liveness.Watch
        """``n`` bytes; any byte heard proves the daemon alive (see krex.protocol.liveness)."""
        while len(self._buf) < n:
            wait = watch.wait_s()
            if wait is not None and wait <= 0:
                if watch.may_ping():
                    watch.pinged(self._send({"type": "ping"}))
                    continue
                raise self._unresponsive(watch.limit_s)
            try:
                self.sock.settimeout(wait)
                chunk = self.sock.recv(max(1 << 16, n - len(self._buf)))
            except TimeoutError:
                continue
            except OSError as exc:
                raise _daemon_gone(exc) from None
            if not chunk:
                raise _daemon_gone("peer closed the connection")
            watch.heard()
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _unresponsive(self, limit_s: float) -> Exception:
        from krex.errors import DaemonUnresponsive
        from krex.protocol.liveness import lock_pid

        self.sock.close()
        pid = self.welcome.get("daemon_pid") or lock_pid(self.path)
        who = f"the krex daemon (pid {pid})" if pid else "the krex daemon"
        return DaemonUnresponsive(f"{who} at {self.path} did not answer within {limit_s:g} s",
                                  pid=pid, seconds=limit_s)

    def close(self) -> None:
        self.sock.close()


def _daemon_gone(why: object) -> Exception:
    from krex.errors import DaemonNotRunning

    return DaemonNotRunning(f"connection to the daemon lost: {why}")


def _mismatch(welcome: dict) -> str | None:
    if {k: welcome.get(k) for k in ("krex_version", "krex_path")} == _mine():
        return None  # the common case, decided without importing anything
    from krex.protocol.installation import mismatch

    return mismatch(welcome)


def _mine() -> dict[str, str]:
    """krex.protocol.installation.installation()'s version and path, without importing it."""
    from krex.version import __version__

    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return {"krex_version": __version__, "krex_path": here}


def _echo(stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()


def exec_program(program: str, args: list[str], *, device: str | None,
                 timeout_s: float | None, json_out: bool) -> int:
    """``krex exec``: run PROG in a warm worker; its output live, its exit code ours."""
    if not os.path.isfile(program):
        from krex.errors import BadRequest

        raise BadRequest(f"no such program: {program}", hint="give the path of a .py file")
    request = {"kind": "path", "path": os.path.abspath(program), "args": list(args),
               "cwd": os.getcwd(), "env": dict(os.environ), "payload": None,
               "timeout_s": timeout_s}
    link = Link(autostart=True)
    try:
        if link.mismatch:
            from krex.errors import DaemonMismatch

            raise DaemonMismatch(f"{link.mismatch} (socket {link.path}, daemon pid "
                                 f"{link.welcome.get('daemon_pid')})",
                                 pid=link.welcome.get("daemon_pid"))
        message = {"type": "exec", "request": request}
        if device is not None:
            message["device"] = device
        result = link.call(message)["result"]
    finally:
        link.close()
    return _report(result, timeout_s, json_out)


def _report(result: dict, timeout_s: float | None, json_out: bool) -> int:
    if json_out:
        from krex.protocol.outcome import outcome

        result["outcome"] = outcome(result["status"], result["exit_code"],
                                    result.get("recycle_reason"))
        sys.stdout.write(leanjson.dumps(result, indent=2) + "\n")
    status_, reason = result.get("status"), result.get("recycle_reason") or ""
    if status_ == "timeout":
        _error(f"program timed out after {timeout_s} s", "raise --timeout-s")
    elif status_ != "ok" and not (result.get("exception") or "").startswith("SystemExit") \
            and not reason.startswith("crashed: exited with status"):  # os._exit(N): an exit
        _error(f"program ended {status_}: {result.get('exception') or result.get('exit_code')}")
    if result.get("recycled"):
        print(f"krex: worker {result.get('worker_pid')} recycled: {reason}", file=sys.stderr)
    return int(result.get("exit_code") or 0)


def _error(what: str, hint: str | None = None) -> None:
    print(f"krex: error: {what}" + (f" (hint: {hint})" if hint else ""), file=sys.stderr)


def status(*, json_out: bool) -> int:
    """``krex status``: the daemon, devices, holders, queues, jobs and warm workers."""
    link = Link(autostart=False)
    try:
        st = link.call({"type": "status"})
    finally:
        link.close()
    st["daemon"]["mismatch"] = link.mismatch
    if json_out:
        sys.stdout.write(leanjson.dumps(st, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(status_lines(st)) + "\n")
    return 0


def status_lines(st: dict) -> list[str]:
    """``krex status`` for people: plain aligned columns (no rich: it costs 50+ ms)."""
    d = st["daemon"]
    out = [f"daemon pid {d['pid']}  krex {d.get('krex_version', '?')} "
           f"({d.get('krex_path', 'unknown path')})  socket {d['socket']}  "
           f"up {d['uptime_s']:.0f} s"]
    if d.get("mismatch"):
        out.append(f"note: {d['mismatch']}: this krex will not use it "
                   "(hint: `krex stop`, then rerun)")
    devices = []
    for dev in st["devices"]:
        sched = st["scheduler"].get(dev["name"], {})
        h = sched.get("holder")
        devices.append([dev["name"], dev["description"],
                        f"job {h['job_id']} region {h['region']}" if h else "-",
                        len(sched.get("queue", []))])
    out += _table("devices", ["device", "description", "holder", "queued"], devices)
    for name, seen in ((st.get("enforcement") or {}).get("device_sightings") or {}).items():
        procs = ", ".join(f"{p['pid']} (uid {p['uid']}, {p['used_memory_mib']} MiB)"
                          for p in seen["foreign_processes"])
        out.append(f"{name}: its last region saw "
                   + "; ".join(filter(None, [
                       f"processes krex does not manage with a context on it: {procs}"
                       if procs else "", f"sharing: {', '.join(seen['sharing'])}"
                       if seen["sharing"] else ""]))
                   + " -- its regions are not clean while they stay")
    for name, c in ((st.get("enforcement") or {}).get("cooling") or {}).items():
        wants = [f"at or below {c['below_c']:g} C" if c.get("below_c") is not None else "",
                 f"at {c['min_clock_mhz']} MHz or more" if c.get("min_clock_mhz") else "",
                 "with no throttling"]
        behind = len(st["scheduler"].get(name, {}).get("queue", []))
        left = max(0.0, float(c["timeout_s"]) - float(c["waited_s"]))
        out.append(f"{name}: job {c['job_id']}'s grant waits for the device to cool: "
                   f"{c['temperature_c']} C, {c.get('sm_clock_mhz')} MHz; granted "
                   f"{' '.join(filter(None, wants))}, within {left:.1f} s at the latest "
                   f"(waited {c['waited_s']:.1f} s of at most {c['timeout_s']:g} s); "
                   f"{behind} region{'' if behind == 1 else 's'} queued behind it")
    out += _table("jobs (times in ms: docs/protocol.md, where a job's time went)",
                  ["job", "name", "device", "mode", "kind", "pid", "regions", "waited",
                   "frozen", "set-up", "held"], [_job_row(j) for j in st["jobs"]])
    if d.get("warm_moves"):
        out.append(_warm_line(d["warm_moves"]))
    c = st["counters"]
    out.append(f"regions: {c['granted']} granted, {c['released']} released, "
               f"{c['revoked']} revoked, {c['cancelled']} cancelled; re-queued "
               f"{c.get('requeued', 0)} ({c.get('requeue_claimed', 0)} claimed, "
               f"{c.get('requeue_lapsed', 0)} lapsed)")
    ends = c.get("chain_ends") or {}
    if c.get("handed_over") or ends:
        out.append(f"handoffs: {c.get('handed_over', 0)} handed over; not handed over after "
                   + (", ".join(f"{n} ({why.replace('_', ' ')})"
                                for why, n in sorted(ends.items())) or "none"))
    pools = st.get("pools") or {}
    if pools:
        out += _table("warm workers", ["device", "workers", "busy", "served", "queued",
                                       "recycles"],
                      [[name, len(p["workers"]), sum(w["busy"] for w in p["workers"]),
                        p["served"], p["queue_length"],
                        ", ".join(f"{k} {v}" for k, v in p["recycles"].items())]
                       for name, p in pools.items()])
    return out


def _warm_line(w: dict) -> str:
    """The daemon's warm pings of the cgroup rwsem (krex.enforce.warm), in one line."""
    if w["state"] == "off":
        return f"cgroup moves: not kept warm ({w['why']})"
    mean = f", mean {w['ping_mean_us']} µs" if w.get("ping_mean_us") is not None else ""
    return (f"cgroup moves: kept warm while regions are taken, {w['state']} now "
            f"({w['pings']} pings every {w['period_ms']:g} ms so far{mean}, "
            f"{w['slow_pings']} waited for a grace period)")


def _job_row(j: dict) -> list:
    return [j["job_id"], j["name"], j["device"], j["mode"], j["kind"],
            j["root_pid"] or j["owner_pid"], j.get("regions", "-"), _ms(j.get("waited_s")),
            _ms(j.get("frozen_s")), _ms(j.get("enforce_s")), _ms(j.get("held_s"))]


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def _table(title: str, columns: list[str], rows: list[list]) -> list[str]:
    cells = [columns] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["", title]
    for n, row in enumerate(cells):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines
