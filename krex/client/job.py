"""A managed job's life cycle, and ``krex run``: a command as a managed job.

:class:`ManagedJob` is the one life cycle every fresh command goes through
(``krex run`` here, the eval's fresh commands): the daemon creates the job;
in ``command`` mode the job holds its device from start to exit; the command
runs in its own process group and, where the machine allows, its own cgroup
(joined before ``exec``, so every descendant is born inside), with
``KREX_SOCKET``, ``KREX_JOB_ID`` and ``KREX_DEVICE`` in its environment; and
whatever happens, what it left in its group is signalled, the hold released
and the job ended.  :func:`run_job` inherits our stdout/stderr (output
streams live; pipes through :mod:`krex.client.relay`), forwards our signals, and
the command's exit code becomes ours.
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
from krex.workers.launcher import join_cgroups, merge_env

TIMEOUT_EXIT = 124  # a command killed for running past its timeout exits like timeout(1)


def exit_code_of(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class ManagedJob:
    """``with ManagedJob(client, ...) as job: job.spawn(argv); code = job.wait()``."""

    def __init__(self, client: Client, *, device: str | None, name: str, mode: str = "region",
                 hold_label: str = "whole job", stop_signal: int = signal.SIGTERM) -> None:
        self.client = client
        self.device, self.name, self.mode = device, name, mode
        self.hold_label = hold_label
        self.stop_signal = stop_signal  # for what the command leaves in its group
        self.info: dict[str, Any] = {}
        self.job_id = 0
        self.hold: dict[str, Any] | None = None
        self.proc: subprocess.Popen | None = None
        self.exit_code = 1

    def __enter__(self) -> ManagedJob:
        self.info = self.client.create_job(device=self.device, name=self.name, mode=self.mode)
        self.job_id = int(self.info["job_id"])
        if self.mode == "command":
            try:
                self.hold = self.client.acquire(self.job_id, self.info["device"], whole_job=True,
                                                label=self.hold_label)
            except BaseException:
                self._end()
                raise
        return self

    def spawn(self, argv: list[str], env: dict[str, str] | None = None,
              **popen: Any) -> subprocess.Popen:
        """Start ``argv`` as the job's root process (``env``: ours unless given)."""
        child_env = merge_env(dict(os.environ) if env is None else env, self.info["env"])
        # Holding its device already (command mode): its processes are in the holder's
        # slot, out of the device's frozen subtree; the child joins them there.
        cgroups = {**self.info["cgroups"], **((self.hold or {}).get("cgroups") or {})}
        try:
            self.proc = subprocess.Popen(argv, env=child_env,
                                         preexec_fn=join_cgroups(cgroups), **popen)
        except OSError as exc:
            raise command_error(argv[0], exc) from None
        self.client.attach_job(self.job_id, self.proc.pid)
        return self.proc

    def wait(self, timeout_s: float | None = None, *, forward_signals: bool = False) -> int:
        """The command's exit code (124 when it outlives ``timeout_s``: it is killed on exit)."""
        assert self.proc is not None
        try:
            if forward_signals:
                self.exit_code = _wait_forwarding_signals(self.proc)
            else:
                self.exit_code = exit_code_of(self.proc.wait(timeout_s))
        except subprocess.TimeoutExpired:
            self.exit_code = TIMEOUT_EXIT
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            end_group(self.proc, self.stop_signal)
        self._end()

    def _end(self) -> None:
        if self.hold is not None:
            _quiet(self.client.release, int(self.hold["region"]))
            self.hold = None
        _quiet(self.client.end_job, self.job_id, self.exit_code)


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
    if found and _imports_krex(found, argv[1:], env):
        return argv, None
    why = (f"`{name}` on PATH ({found}) cannot import krex" if found
           else f"there is no `{name}` on PATH")
    note = (f"krex: running {sys.executable} (the interpreter krex runs under) for `{name}`: "
            f"{why} (hint: activate krex's environment — "
            f"`. {os.path.dirname(sys.executable)}/activate` — or give an interpreter's full "
            "path to choose it)")
    return [sys.executable, *argv[1:]], note


def _imports_krex(python: str, args: list[str], env: dict[str, str]) -> bool:
    """Whether ``python args…`` could import krex: probed with the interpreter options it
    is given and the first entry of ``sys.path`` it will have (a script's directory, not
    our working directory, which may hold a checkout's ``krex/``)."""
    options, first = _options_and_path0(args)
    probe = ("import importlib.util, sys\nif sys.path[:1] == ['']: sys.path[0] = sys.argv[1]\n"
             "sys.exit(importlib.util.find_spec('krex') is None)")
    try:
        done = subprocess.run([python, *options, "-c", probe, first], env=env,
                              stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _options_and_path0(args: list[str]) -> tuple[list[str], str]:
    """The interpreter options of ``python args…`` and its ``sys.path[0]`` where not safe
    (``-P``, ``-I``): the script's directory, else (``-c``, ``-m``, a prompt) the working
    directory."""
    takes_value = False
    for i, arg in enumerate(args):
        if takes_value:  # the value of -W or -X, not the script
            takes_value = False
        elif arg == "-" or arg.startswith(("-c", "-m")):
            return args[:i], os.getcwd()
        elif not arg.startswith("-"):
            return args[:i], os.path.dirname(os.path.realpath(arg))
        else:
            takes_value = arg in ("-W", "-X", "--check-hash-based-pycs")
    return args, os.getcwd()


def run_job(argv: list[str], *, device: str | None = None, name: str | None = None,
            mode: str = "region", client: Client | None = None,
            env: dict[str, str] | None = None) -> int:
    """Run ``argv`` as a managed job; return its exit code.  Where our stdout or stderr
    is a pipe, the command writes through :mod:`krex.client.relay` (a frozen command's
    long write to a pipe would come back short)."""
    from krex.client.relay import Relay

    relay = Relay()
    started = False
    try:
        with ManagedJob(client or Client(), device=device,
                        name=name or os.path.basename(argv[0]), mode=mode) as job:
            job.spawn(argv, {**os.environ, **(env or {})}, **relay.popen())
            relay.start()
            started = True
            return job.wait(forward_signals=True)
    finally:  # after what the command left in its group was signalled (ManagedJob)
        if started:
            relay.finish()
        else:
            relay.close_unstarted()


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
