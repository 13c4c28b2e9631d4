"""The dispatcher: routes programs to node actors and turns lost nodes into results.

In: program dicts from :func:`krex.ray.submit` (one async actor per driver, on
the driver's node).  Out: one result dict per program, the value of the
ObjectRef that ``submit`` returned.  A program goes to the least loaded node
offering its device (in-flight programs per warm-worker slot).  When a node
actor dies mid-program the result says ``lost`` (unknown outcome) and names the
node; it is run again elsewhere only if the caller asked for ``retries``.
"""

from __future__ import annotations

import time
from typing import Any

from krex.integrations.ray import outcome
from krex.integrations.ray.program import Program
from krex.integrations.ray.resources import NAMESPACE, NODE_ACTOR_PREFIX

REFRESH_S = 5.0  # look for new node actors at most this often (and when none fits)


class Dispatcher:
    def __init__(self) -> None:
        self.nodes: dict[str, Any] = {}  # node id -> actor handle
        self.infos: dict[str, dict[str, Any]] = {}
        self.inflight: dict[str, int] = {}
        self.assigned: dict[str, int] = {}
        self.refreshed_mono_s = 0.0

    async def run(self, data: dict[str, Any], retries: int = 0) -> dict[str, Any]:
        program = Program.from_dict(data)
        attempts: list[dict[str, Any]] = []
        avoid: set[str] = set()
        for _ in range(max(0, retries) + 1):
            node_id = await self._pick(program.device, avoid)
            if node_id is None:
                return _with(outcome.unschedulable(
                    program, f"no live krex node offers device {program.device!r}"), attempts)
            result = await self._call(node_id, program)
            if result["status"] != outcome.LOST:
                return _with(result, attempts)
            attempts.append(_summary(result))
            avoid.add(node_id)
        return _with(result, attempts[:-1])

    async def _call(self, node_id: str, program: Program) -> dict[str, Any]:
        import ray

        self.inflight[node_id] = self.inflight.get(node_id, 0) + 1
        self.assigned[node_id] = self.assigned.get(node_id, 0) + 1
        try:
            return await self.nodes[node_id].exec.remote(program.to_dict())
        except ray.exceptions.RayActorError as exc:
            self._forget(node_id)
            return outcome.lost(program, node_id, "node",
                                f"node actor died mid-program ({type(exc).__name__})")
        finally:
            self.inflight[node_id] = self.inflight.get(node_id, 1) - 1

    async def _pick(self, device: str, avoid: set[str]) -> str | None:
        if time.monotonic() - self.refreshed_mono_s > REFRESH_S or not self._fits(device, avoid):
            await self.refresh()
        fits = self._fits(device, avoid) or self._fits(device, set())
        if not fits:
            return None
        return min(fits, key=lambda n: (self.inflight.get(n, 0) / _slots(self.infos[n]),
                                        self.assigned.get(n, 0)))

    def _fits(self, device: str, avoid: set[str]) -> list[str]:
        return [n for n, info in self.infos.items()
                if n not in avoid and device in info.get("devices", ())]

    async def refresh(self) -> list[dict[str, Any]]:
        """Find the live node actors (named ``krex-node-<node id>`` in namespace ``krex``)."""
        import ray

        self.refreshed_mono_s = time.monotonic()
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] == NAMESPACE and name.startswith(NODE_ACTOR_PREFIX):
                await self._add(name[len(NODE_ACTOR_PREFIX):], name)
        return list(self.infos.values())

    async def _add(self, node_id: str, name: str) -> None:
        import ray

        try:
            handle = self.nodes.get(node_id) or ray.get_actor(name, namespace=NAMESPACE)
            self.infos[node_id] = await handle.info.remote()
            self.nodes[node_id] = handle
        except (ValueError, ray.exceptions.RayError):
            self._forget(node_id)

    def _forget(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        self.infos.pop(node_id, None)

    async def load(self) -> dict[str, dict[str, int]]:
        return {n: {"inflight": self.inflight.get(n, 0), "assigned": self.assigned.get(n, 0)}
                for n in self.infos}


def _slots(info: dict[str, Any]) -> float:
    return float(max(1, int(info.get("worker_slots") or 1)))


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    return {"node_id": result.get("node_id"), "status": result["status"],
            "lost": result.get("lost"), "daemon_pid": result.get("daemon_pid")}


def _with(result: dict[str, Any], attempts: list[dict[str, Any]]) -> dict[str, Any]:
    result["attempts"] = attempts
    return result
