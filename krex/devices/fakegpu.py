"""fakegpu: a device server plus a fake libcuda.so.1 / libamdhip64.so (docs/native.md).

In: settings (execution core, context-creation delay, time slice, devices).
Out: a running server process and the environment a job needs to use it
(``KREX_FAKEGPU_SOCKET`` and ``LD_LIBRARY_PATH`` in front of the fake driver).

    with FakeGpu(core=1) as gpu:
        subprocess.run(cmd, env=gpu.env())
        print(gpu.stats())
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

from krex.devices.native import fakegpu_lib_dir, fakegpu_server_path
from krex.errors import KrexError

_REQ = struct.Struct("<IIQQII96s")  # struct fg_req (proto.h)
_REP = struct.Struct("<iIQQQ")  # struct fg_rep
_OP_STATS, _OP_DUMP_LOG, _OP_PROC_QUEUED, _OP_BUSY = 10, 11, 15, 16  # enum fg_op (proto.h)
BUSY_PIDS = 23  # FG_BUSY_PIDS: processes one busy request can name


class Busy(NamedTuple):
    """The device's busy counters at one moment (``FakeGpu.busy``)."""

    of_pids: int  # ns run for the named processes' contexts, ever
    total: int  # ns run for every context, ever
    exec_tid: int  # the execution thread (0: not started yet)


def available() -> bool:
    """True when the fake driver and its server were built."""
    return fakegpu_server_path().exists() and (fakegpu_lib_dir() / "libcuda.so.1").exists()


class FakeGpu:
    """One fakegpu device server: start it, hand out its environment, stop it."""

    def __init__(self, socket_path: str | None = None, *, core: int | None = None,
                 ctx_delay_ms: int = 0, slice_us: int = 1000, devices: int = 1) -> None:
        self._tmpdir: str | None = None
        if socket_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="krex-fakegpu-")
            socket_path = os.path.join(self._tmpdir, "fakegpu.sock")
        self.socket_path = socket_path
        self.core, self.ctx_delay_ms = core, ctx_delay_ms
        self.slice_us, self.devices = slice_us, devices
        self.proc: subprocess.Popen[bytes] | None = None
        self._conn: socket.socket | None = None  # busy(): one connection, kept
        self._conn_lock = threading.Lock()

    def start(self, timeout_s: float = 10.0) -> FakeGpu:
        """Spawn the server and wait until it listens."""
        env = dict(os.environ, KREX_FAKEGPU_CTX_DELAY_MS=str(self.ctx_delay_ms),
                   KREX_FAKEGPU_SLICE_US=str(self.slice_us), KREX_FAKEGPU_DEVICES=str(self.devices))
        if self.core is not None:
            env["KREX_FAKEGPU_CORE"] = str(self.core)
        self.proc = subprocess.Popen([str(fakegpu_server_path()), self.socket_path], env=env,
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        if not ready or out.readline().strip() != b"ready":
            self.stop()
            raise KrexError("the fakegpu server did not start", hint="see its stderr")
        return self

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a job using this device (fake driver first on the library path)."""
        env = dict(os.environ if base is None else base)
        libs = [str(fakegpu_lib_dir()), *filter(None, env.get("LD_LIBRARY_PATH", "").split(":"))]
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        env["KREX_FAKEGPU_SOCKET"] = self.socket_path
        return env

    def _request(self, op: int, text: bytes = b"", a: int = 0) -> tuple[int, int, int, int]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.socket_path)
            s.sendall(_REQ.pack(op, 0, a, 0, os.getpid(), 0, text))
            return _reply(s)

    def busy(self, pids: list[int]) -> Busy:
        """Busy device time for ``pids``' contexts and in all, and the execution thread's
        tid: the device's own counters (one request on a kept connection; a region's
        device watch reads them at grant and release)."""
        named = sorted(set(pids))[:BUSY_PIDS]
        text = struct.pack(f"<{len(named)}I", *named)
        with self._conn_lock:
            try:
                _, v0, v1, v2 = self._exchange(_OP_BUSY, text)
            except OSError:
                self._drop_conn()  # the server restarted, or the connection broke: once more
                _, v0, v1, v2 = self._exchange(_OP_BUSY, text)
        return Busy(v0, v1, v2)

    def _exchange(self, op: int, text: bytes) -> tuple[int, int, int, int]:
        if self._conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.socket_path)
            self._conn = conn
        self._conn.sendall(_REQ.pack(op, 0, 0, 0, os.getpid(), 0, text))
        return _reply(self._conn)

    def _drop_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None

    def stats(self) -> dict[str, int]:
        """Launches accepted, kernels finished and busy device nanoseconds so far."""
        _, launches, finished, busy_ns = self._request(_OP_STATS)
        return {"launches": launches, "finished": finished, "busy_ns": busy_ns}

    def queued(self, pid: int) -> int:
        """Work items queued on the device for ``pid``'s contexts (the device's own view)."""
        return self._request(_OP_PROC_QUEUED, a=pid)[1]

    def launch_log(self, since_ns: int = 0) -> list[tuple[int, ...]]:
        """Every launch the server accepted (``since_ns``: only those not ended before it):
        (monotonic ns, pid, context, flags, duration ns, execution start ns, end ns) — the
        last two are the fake device's own clock (CLOCK_MONOTONIC of the server's execution
        thread; 0 while not run)."""
        with tempfile.NamedTemporaryFile(prefix="fakegpu-log-", delete=False) as f:
            path = f.name
        try:
            self._request(_OP_DUMP_LOG, path.encode(), a=since_ns)
            rows = Path(path).read_text().split("\n")
            return [tuple(int(x) for x in row.split()) for row in rows if row]
        finally:
            os.unlink(path)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate and reap the server; remove its socket."""
        self._drop_conn()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout_s)
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        if self._tmpdir:
            with contextlib.suppress(OSError):
                os.rmdir(self._tmpdir)

    def __enter__(self) -> FakeGpu:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _reply(conn: socket.socket) -> tuple[int, int, int, int]:
    """One ``struct fg_rep``: (status, v0, v1, v2)."""
    data = b""
    while len(data) < _REP.size:
        chunk = conn.recv(_REP.size - len(data))
        if not chunk:
            raise ConnectionError("the fakegpu server closed the connection")
        data += chunk
    status, _, v0, v1, v2 = _REP.unpack(data)
    return status, v0, v1, v2
