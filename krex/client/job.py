"""``krex run``: start a command as a managed job and stream its output.

The command runs in its own process group and, where the machine allows,
its own cgroup (joined before ``exec``, so every descendant is born inside).
It gets ``KREX_SOCKET``, ``KREX_JOB_ID`` and ``KREX_DEVICE`` in its
environment, inherits our stdout/stderr (output streams live), and its exit
code becomes ours.  In ``command`` mode the job holds its device from start
to exit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from krex.client.connection import Client
from krex.errors import KrexError, command_error


def exit_code_of(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


PATH_LISTS = ("LD_PRELOAD", "LD_LIBRARY_PATH")


def merge_env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """``base`` updated with ``extra``; path lists (LD_PRELOAD, ...) are prepended, not lost."""
    env = {**base, **extra}
    for key in PATH_LISTS:
        if key in extra and base.get(key):
            parts = [p for p in extra[key].split(":") if p]
            parts += [p for p in base[key].split(":") if p and p not in parts]
            env[key] = ":".join(parts)
    return env


PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?")


def python_for(argv: list[str], env: dict[str, str]) -> tuple[list[str], str | None]:
    """``krex run -- python …`` with the interpreter krex runs under, when the ``python``
    on PATH is not it and cannot import krex (say, the system's, with krex in a venv
    that is not activated).  Returns the command to run and a note saying why, if changed.

    Only a bare name (``python``, ``python3``, ``python3.11``) is replaced: a path
    (``/usr/bin/python3``) is run as given.
    """
    name = argv[0] if argv else ""
    if not PYTHON_NAME.fullmatch(name):
        return argv, None
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found and os.path.dirname(os.path.abspath(found)) == os.path.dirname(sys.executable):
        return argv, None  # the venv's own interpreter
    if found and _imports_krex(found, env):
        return argv, None
    why = (f"`{name}` on PATH ({found}) cannot import krex" if found
           else f"there is no `{name}` on PATH")
    note = (f"krex: running {sys.executable} (the interpreter krex runs under) for `{name}`: "
            f"{why} (hint: activate krex's environment — "
            f"`. {os.path.dirname(sys.executable)}/activate` — or give an interpreter's full "
            "path to choose it)")
    return [sys.executable, *argv[1:]], note


def _imports_krex(python: str, env: dict[str, str]) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('krex') is None)"
    try:
        done = subprocess.run([python, "-c", probe], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def join_cgroups(cgroups: dict[str, str | None], *, new_group: bool = True
                 ) -> Callable[[], None]:
    """A ``preexec_fn``: the child enters its own process group and the job's cgroups
    before ``exec``, so everything it starts is born inside them."""
    paths = [p for p in cgroups.values() if p]

    def setup() -> None:
        if new_group:
            # A session of its own: the job's group is orphaned from the start, so the
            # kernel never sends SIGHUP to it when a stopped (frozen) member is orphaned.
            os.setsid()
        pid = str(os.getpid()).encode()
        for path in paths:
            try:
                fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
            except OSError:
                pass  # the report of every region says what could not be enforced

    return setup


def run_job(argv: list[str], *, device: str | None = None, name: str | None = None,
            mode: str = "region", client: Client | None = None,
            env: dict[str, str] | None = None) -> int:
    """Run ``argv`` as a managed job; return its exit code."""
    client = client or Client()
    job = client.create_job(device=device, name=name or os.path.basename(argv[0]), mode=mode)
    job_id = int(job["job_id"])
    hold: dict[str, Any] | None = None
    proc: subprocess.Popen | None = None
    code = 1
    try:
        if mode == "command":
            hold = client.acquire(job_id, job["device"], whole_job=True, label="whole job")
        child_env = merge_env({**os.environ, **(env or {})}, job["env"])
        proc = subprocess.Popen(argv, env=child_env, preexec_fn=join_cgroups(job["cgroups"]))
        client.attach_job(job_id, proc.pid)
        code = _wait_forwarding_signals(proc)
        return code
    except OSError as exc:
        if proc is not None:
            raise
        raise command_error(argv[0], exc) from None
    finally:
        if proc is not None:
            end_group(proc)
        if hold is not None:
            _quiet(client.release, int(hold["region"]))
        _quiet(client.end_job, job_id, code)


def _wait_forwarding_signals(proc: subprocess.Popen) -> int:
    def forward(signum: int, frame: Any) -> None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return exit_code_of(proc.wait())
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def end_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """The job's command has exited (or is killed now): signal what it left behind in
    its process group."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _quiet(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except (KrexError, OSError):
        pass
