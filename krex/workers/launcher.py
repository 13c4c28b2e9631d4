"""How a process is started as a member of a job: its environment and its cgroups.

The daemon passes its own ``WorkerLauncher`` so every worker gets the
interposer, its cgroup and a job record; the default just inherits the
environment.  :func:`merge_env` and :func:`join_cgroups` are the two pieces
every launch of a job's process uses (workers here, ``krex run`` and the eval's
fresh commands in :mod:`krex.client.job`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

PATH_LISTS = ("LD_PRELOAD", "LD_LIBRARY_PATH")
# What tenant code gets of the environment it is started from (docs/service.md): these
# names, and the prefixes that end in "*".  The rest (the service's or the daemon's
# user's secrets, tokens, credentials) stays out: a service's jobs start from it, and a
# root daemon's tenant users' workers.  An exec request's ``env`` adds to it, and a warm
# worker keeps its own ``KREX_*`` and ``LD_PRELOAD`` whatever the job says
# (krex.workers.spec).
JOB_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ",
           "TERM", "TMPDIR", "XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_DATA_HOME",
           "XDG_CACHE_HOME", "KREX_*", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
           "ROCR_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "PYTHONPATH")


def job_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that :data:`JOB_ENV` names."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items()
            if any(k.startswith(p[:-1]) if p.endswith("*") else k == p for p in JOB_ENV)}


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



class WorkerLauncher(Protocol):
    def prepare(self, index: int) -> tuple[dict[str, str], Callable[[], None] | None]:
        """The environment and preexec function for the ``index``-th worker of a pool."""

    def started(self, pid: int) -> None:
        """The worker process exists (it has not yet finished initialising)."""

    def exited(self, pid: int) -> None:
        """The worker process was reaped."""


class DefaultLauncher:
    """Workers inherit this process's environment; nothing is registered."""

    def prepare(self, index: int) -> tuple[dict[str, str], Callable[[], None] | None]:
        return dict(os.environ), None

    def started(self, pid: int) -> None:
        pass

    def exited(self, pid: int) -> None:
        pass


def same_file(a: int, b: int) -> bool:
    """Whether descriptors ``a`` and ``b`` are the same file (pipe, socket, tty...): a
    started process's streams (``krex run``'s relay, a worker's restored fds)."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
