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
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from krex.client.connection import Client
from krex.errors import KrexError


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
    except FileNotFoundError as exc:
        raise KrexError(f"cannot run {argv[0]!r}: {exc.strerror}",
                        hint="check the command name and PATH") from None
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
