"""How a worker process is started: the hook that makes it a managed job.

The daemon passes its own ``WorkerLauncher`` so every worker gets the
interposer, its cgroup and a job record; the default just inherits the
environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol


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
