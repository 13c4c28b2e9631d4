"""The two callee processes of a sealed evaluation, seen from the trusted driver.

:func:`spawn` starts ``python -m krex.evaluate.callee`` for one side with its shared
block (:class:`~krex.evaluate.dispatch.Block`) and a status pipe, moves it into a
cgroup of its own (:mod:`krex.evaluate.accounting`; both sides alike, so that neither
pays for accounting the other does not) before it reads its job, and waits until it
is bound (its threads then are krex's: taken before the callee is let go on to import
its function) and has imported it.
:meth:`Callee.stop` asks the loop to return, kills whatever is left of the process
and everything it started, and reaps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from krex.evaluate.accounting import Accounting
from krex.evaluate.dispatch import Block
from krex.evaluate.sandbox import Sandbox, SandboxReport, SandboxUnavailable

BLOCK_BYTES = 1 << 30  # sparse: only what the outputs touch is ever allocated
START_TIMEOUT_S = 60.0


class CalleeFailed(Exception):
    """A callee could not build its inputs (``stage`` "inputs") or import its function
    ("import"), or died before it was serving."""

    def __init__(self, role: str, stage: str, text: str, exit_code: int | None = None) -> None:
        super().__init__(f"{role}: {stage}: {text}")
        self.role, self.stage, self.text, self.exit_code = role, stage, text, exit_code


@dataclass
class Callee:
    role: str  # "reference" | "candidate"
    proc: subprocess.Popen[bytes]
    block: Block
    slots: dict[str, int]  # case id -> argument set
    accounting: Accounting | None = None
    status_fd: int = -1
    go_fd: int = -1  # one byte on it lets the callee import its function
    lines: list[str] = field(default_factory=list)
    schedstat_fd: int = -1  # the callee's main thread: its run delay around each call
    sandbox: Sandbox | None = None  # the candidate's: released once it is dead
    confined: SandboxReport | None = None  # what it runs under

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run_delay_ns(self) -> int | None:
        """Nanoseconds the callee's dispatching thread has waited for a CPU (the kernel's)."""
        if self.schedstat_fd < 0:
            return None
        try:
            return int(os.pread(self.schedstat_fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None

    def wait_line(self, timeout_s: float) -> str | None:
        """The next status line, or None at end of file (the callee closed it: serving)."""
        deadline, buf = time.monotonic() + timeout_s, b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CalleeFailed(self.role, "start", f"not ready within {timeout_s:g} s")
            ready, _, _ = select.select([self.status_fd], [], [], min(left, 0.25))
            if not ready:
                if self.proc.poll() is not None and not buf:
                    raise CalleeFailed(self.role, "start", f"exit code {self.proc.returncode}",
                                       self.proc.returncode)
                continue
            chunk = os.read(self.status_fd, 4096)
            if not chunk:
                return None
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode("utf-8", "replace")

    def stop(self) -> int | None:
        """Ask the loop to end, then kill what is left (everything it started too) and
        reap; returns the callee's exit code."""
        if self.proc.poll() is None:
            self.block.exit()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.5)
        if self.accounting is not None:
            self.accounting.kill_all()
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        if self.accounting is not None:
            self.accounting.close()
        for fd in (self.status_fd, self.schedstat_fd, self.go_fd):
            if fd >= 0:
                os.close(fd)
        self.status_fd = self.schedstat_fd = self.go_fd = -1
        self.block.close()
        if self.sandbox is not None:
            self.sandbox.close()
        return code


#: Modules whose array type the dispatcher takes (besides numpy's): the callee imports
#: those this process has loaded (a worker's ``--preload``, the inputs compared here)
#: before it captures the types, so before any code of the task's runs.  A callee that
#: captured them after -- never, it must not import the task's code first -- would
#: refuse every tensor as a bad output (it did: torch's type was captured as absent).
TENSOR_MODULES = ("torch",)


def spawn(role: str, fn: dict[str, Any], inputs: dict[str, Any],
          cases: list[dict[str, Any]], sandbox: Sandbox | None = None,
          hidden: bool = True) -> Callee:
    """Start one side's callee (the candidate's in ``sandbox``; the reference's not
    dumpable where ``hidden``); it reads its job once it is where it will stay (a cgroup
    of its own, the reference's too: a cgroup the other side lacks made the candidate's
    calls 1-3 % slower at equal speed, measured with both loops on one CPU)."""
    block = Block(BLOCK_BYTES)
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "krex.evaluate.callee"], stdin=subprocess.PIPE,
            pass_fds=(block.fd, status_w, go_r),
            preexec_fn=sandbox.preexec() if sandbox is not None else None,
            env=sandbox.env(dict(os.environ)) if sandbox is not None else None)
    except BaseException:
        for fd in (status_r, status_w, go_r, go_w):
            os.close(fd)
        block.close()
        if sandbox is not None:
            sandbox.close()
        raise
    os.close(status_w)
    os.close(go_r)
    callee = Callee(role, proc, block, {c["id"]: i for i, c in enumerate(cases)},
                    status_fd=status_r, go_fd=go_w, sandbox=sandbox)
    block.alive, block.role = proc.poll, role
    if sandbox is not None:
        try:
            callee.confined = sandbox.started()
        except SandboxUnavailable:
            callee.stop()
            raise
    callee.accounting = Accounting(proc.pid)
    job = {"role": role, "fn": fn, "inputs": inputs, "cases": cases, "fd": block.fd,
           "size": block.size, "status_fd": status_w, "go_fd": go_r, "hidden": hidden,
           "preload": [name for name in TENSOR_MODULES if name in sys.modules]}
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    block.close()  # the callee has its own descriptor; this side keeps only its mapping
    with contextlib.suppress(OSError):
        callee.schedstat_fd = os.open(f"/proc/{proc.pid}/task/{proc.pid}/schedstat",
                                      os.O_RDONLY)
    return callee


def ready(callee: Callee, timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until ``callee`` is bound (its threads are then taken as krex's) and has
    imported its function; :class:`CalleeFailed` with the stage that failed."""
    line = callee.wait_line(timeout_s)
    if line is not None and line != "bound":
        stage, _, text = line.partition(": ")
        raise CalleeFailed(callee.role, stage, text, callee.proc.poll())
    if callee.accounting is not None:
        callee.accounting.baseline()
    with contextlib.suppress(OSError):
        os.write(callee.go_fd, b"g")
    os.close(callee.go_fd)
    callee.go_fd = -1
    line = callee.wait_line(timeout_s) if line is not None else None
    if line is not None:
        stage, _, text = line.partition(": ")
        raise CalleeFailed(callee.role, stage, text, callee.proc.poll())
