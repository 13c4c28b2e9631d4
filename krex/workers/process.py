"""The pool's side of one worker process: spawn, talk, listen, kill.

A ``WorkerProcess`` owns the subprocess, the control channel and one IO
thread that turns everything the worker sends into events on ``events``:
``("msg", dict)`` from the channel, ``("out", stream, text)`` from fds 1
and 2, ``("sync", stream)`` when the end-of-program sentinel arrives on a
stream, and ``("eof", name)`` when a source closes.
"""

from __future__ import annotations

import codecs
import collections
import os
import queue
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from krex.workers.canary import descendants
from krex.workers.channel import Channel, FrameDecoder
from krex.workers.launcher import WorkerLauncher
from krex.workers.spec import PoolSpec

_ROOT = str(Path(__file__).resolve().parent.parent.parent)  # where `-m krex...` resolves
_TAIL_CHARS = 8192


class WorkerStartError(RuntimeError):
    """A worker died or gave up before it was ready."""


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket, sentinel: bytes,
                 launcher: WorkerLauncher) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.channel = Channel(sock)
        self.sentinel = sentinel
        self.launcher = launcher
        self.events: queue.Queue[tuple] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=64)
        self.started_wall_s = time.time()
        self.ready: dict[str, Any] = {}
        self.programs = 0
        self.busy = False
        # the directory the running program's request named (None: idle); the daemon's
        # record, not the process's cwd now, which the program may change
        self.program_cwd: str | None = None
        self.idle_since_mono_s = time.monotonic()
        self._stopping = False
        self._reaped = False
        self._io = threading.Thread(target=self._pump, name=f"krex-worker-io-{self.pid}",
                                    daemon=True)
        self._io.start()

    @classmethod
    def spawn(cls, spec: PoolSpec, launcher: WorkerLauncher, index: int) -> WorkerProcess:
        env, preexec = launcher.prepare(index)
        if spec.device_memory_cap_mb:
            env = {**env, "KREX_DEVICE_MEMORY_CAP_MB": str(int(spec.device_memory_cap_mb))}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "krex.workers.worker", "--fd", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), env=env, cwd=_ROOT, preexec_fn=preexec,
                start_new_session=True)
        finally:
            theirs.close()
        launcher.started(proc.pid)
        sentinel = b"\x00\x1bKREX-END-" + secrets.token_hex(8).encode() + b"\x00"
        worker = cls(proc, ours, sentinel, launcher)
        worker.channel.send(_init_message(spec, sentinel))
        return worker

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerStartError(self._why(f"not ready after {timeout_s:.0f} s")) from None
            if event[0] == "msg" and event[1].get("t") == "ready":
                self.ready = event[1]
                return self.ready
            if event[0] == "msg" and event[1].get("t") == "failed":
                raise WorkerStartError(self._why(event[1]["error"]))
            if event[0] == "eof" and event[1] == "control":
                raise WorkerStartError(self._why("exited during start-up"))

    def _why(self, what: str) -> str:
        tail = "".join(self.stderr_tail).strip()
        return f"worker {self.pid} {what}" + (f"; its stderr ends with:\n{tail}" if tail else "")

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(message)

    def alive(self) -> bool:
        """Running (without reaping it: the PID stays ours until ``kill``)."""
        if self._reaped:
            return False
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def kill(self, wait_s: float = 5.0) -> int | None:
        """SIGKILL the worker, its process group and its descendants; reap it."""
        if self._reaped:
            return self.proc.returncode
        leftovers = descendants(self.pid)
        try:
            os.killpg(self.pid, signal.SIGKILL)  # not reaped yet: the group id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return self.reap(wait_s)

    def reap(self, wait_s: float = 5.0) -> int | None:
        try:
            code = self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            return None
        if not self._reaped:
            self._reaped = True
            self.launcher.exited(self.pid)
        self.close()
        return code

    def close(self) -> None:
        self._stopping = True
        if self._io is not threading.current_thread():
            self._io.join(1.0)
        self.channel.close()

    # -- the IO thread ---------------------------------------------------------------

    def _pump(self) -> None:
        sel = selectors.DefaultSelector()
        out, err = self.proc.stdout, self.proc.stderr
        assert out is not None and err is not None  # spawned with PIPE
        sources = {"control": self.channel.sock.fileno(), "stdout": out.fileno(),
                   "stderr": err.fileno()}
        readers = {name: _Reader(name, self.sentinel) for name in ("stdout", "stderr")}
        decoder = FrameDecoder()
        for name, fd in sources.items():
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, name)
        try:
            while sel.get_map() and not self._stopping:
                for key, _ in sel.select(timeout=0.2):
                    self._read(sel, key, readers, decoder)
        finally:
            sel.close()
            out.close()
            err.close()

    def _read(self, sel: selectors.BaseSelector, key: selectors.SelectorKey,
              readers: dict[str, _Reader], decoder: FrameDecoder) -> None:
        name = key.data
        try:
            data = os.read(key.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            sel.unregister(key.fd)
            if name in readers:
                self._emit(readers[name].finish())
            self.events.put(("eof", name))
            return
        if name == "control":
            try:
                messages = decoder.feed(data)
            except Exception:  # noqa: BLE001  (a garbled worker is dead to us)
                sel.unregister(key.fd)
                self.events.put(("eof", name))
                return
            for message in messages:
                self.events.put(("msg", message))
        else:
            self._emit(readers[name].feed(data))

    def _emit(self, events: list[tuple]) -> None:
        for event in events:
            if event[0] == "out" and event[1] == "stderr":
                self.stderr_tail.append(event[2][-_TAIL_CHARS:])
            self.events.put(event)


class _Reader:
    """Bytes of one output stream -> text events, with end-of-program sentinels found."""

    def __init__(self, name: str, sentinel: bytes) -> None:
        self.name = name
        self.sentinel = sentinel
        self.carry = b""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> list[tuple]:
        data, out = self.carry + data, []
        while (i := data.find(self.sentinel)) >= 0:
            out += self._text(data[:i], final=True)
            out.append(("sync", self.name))
            data = data[i + len(self.sentinel) :]
        keep = _partial_suffix(data, self.sentinel)
        self.carry = data[len(data) - keep :] if keep else b""
        return out + self._text(data[: len(data) - keep])

    def finish(self) -> list[tuple]:
        data, self.carry = self.carry, b""
        return self._text(data, final=True)

    def _text(self, data: bytes, final: bool = False) -> list[tuple]:
        text = self.decoder.decode(data, final)
        return [("out", self.name, text)] if text else []


def _partial_suffix(data: bytes, sentinel: bytes) -> int:
    """Length of the longest end of ``data`` that begins ``sentinel``."""
    for n in range(min(len(data), len(sentinel) - 1), 0, -1):
        if sentinel.startswith(data[-n:]):
            return n
    return 0


def _init_message(spec: PoolSpec, sentinel: bytes) -> dict[str, Any]:
    return {"t": "init", "device": spec.device, "preload": list(spec.preload),
            "memory_growth_limit_mb": spec.memory_growth_limit_mb,
            "check_libraries": spec.recycle_on_native_load,
            "pinned_env": list(spec.pinned_env), "sentinel": sentinel}
