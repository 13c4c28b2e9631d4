"""Turns a grant into enforcement on real processes, and back.

The daemon core speaks in jobs; this module turns them into enforcement
targets, runs the mechanisms in order (gate → drain → freeze → isolate) via
:mod:`krex.enforce`, and hands back a :class:`Held` whose ``exit()`` undoes
them and returns the host part of the region report.
"""

from __future__ import annotations

from typing import Any, Protocol

from krex.daemon.config import DaemonConfig


class Held(Protocol):
    def exit(self) -> dict[str, Any]: ...


class _Unenforced:
    """A region granted with no mechanism applied: the report says why."""

    def __init__(self, reasons: list[dict[str, str]]) -> None:
        self.reasons = reasons

    def exit(self) -> dict[str, Any]:
        return {"steps": [], "siblings_frozen": 0, "freeze_backend": None,
                "not_enforced": self.reasons, "clean": False}


class Exclusivity:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config

    def create_cgroups(self, job_id: int) -> Any:
        return None

    def remove_cgroups(self, cgroups: Any) -> None:
        return None

    def cgroup_paths(self, cgroups: Any) -> dict[str, str | None]:
        return {}

    def job_env(self, job: Any) -> dict[str, str]:
        return {}

    def enter(self, holder: Any, siblings: list[Any], request: Any) -> Held:
        return _Unenforced([{"what": "freeze", "why": "host enforcement is not built yet"}])

    def describe(self) -> dict[str, Any]:
        return {"freeze": "none"}

    def close(self) -> None:
        return None
