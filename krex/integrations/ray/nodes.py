"""The driver's view of the cluster: connect, start, find and stop node actors.

In: a Ray address (or the Ray instance this process already joined) and where
each node's daemon keeps its runtime directory.  Out: one named node actor per
Ray node (``krex-node-<node id>``, namespace ``krex``), pinned to its node,
holding that node's ``krex_node`` resource when the node advertises one.
"""

from __future__ import annotations

from typing import Any

from krex.errors import NoKrexNodes, RayMissing
from krex.integrations.ray.node import KrexNode
from krex.integrations.ray.resources import (
    NAMESPACE,
    NODE_ACTOR_PREFIX,
    NODE_RESOURCE,
    node_actor_name,
)

NODE_CONCURRENCY = 256  # programs one node actor may have waiting on its daemon

_started: dict[str, Any] = {}  # node id -> handle of node actors this driver started


def import_ray() -> Any:
    """``import ray``, or :class:`~krex.errors.RayMissing` with the install hint."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(f"Ray is not importable: {exc}") from None
    return ray


def connect(address: str | None = None) -> Any:
    """Join the Ray cluster at ``address`` (``auto`` / None: the local one) once."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, logging_level="warning",
                 log_to_driver=False)
    return ray


def krex_nodes(ray: Any) -> list[dict[str, Any]]:
    """Live Ray nodes that offer krex (``krex_node`` resource); all live nodes if none does."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    marked = [n for n in alive if n.get("Resources", {}).get(NODE_RESOURCE)]
    return marked or alive


def start(address: str | None = None, *, runtime_dir: str | None = None,
          serve_args: list[str] | None = None, idle_exit_s: float | None = None,
          detached: bool = False, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Start (or find) a node actor on every krex node; return their ``info()``.

    ``runtime_dir`` may contain ``{node_id}`` (several "nodes" on one host need
    distinct daemons); default: each node's usual krex runtime directory.
    ``detached`` actors outlive this driver (``krex cluster up``).
    """
    ray = connect(address)
    handles = []
    for node in krex_nodes(ray):
        handles.append(_node_actor(ray, node, runtime_dir, serve_args, idle_exit_s, detached))
    return ray.get([h.info.remote() for h in handles], timeout=timeout_s)


def _node_actor(ray: Any, node: dict[str, Any], runtime_dir: str | None,
                serve_args: list[str] | None, idle_exit_s: float | None, detached: bool) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node["NodeID"]
    marked = bool(node.get("Resources", {}).get(NODE_RESOURCE))
    options = {
        "name": node_actor_name(node_id), "namespace": NAMESPACE, "get_if_exists": True,
        "num_cpus": 0, "max_concurrency": NODE_CONCURRENCY, "max_restarts": 0,
        "resources": {NODE_RESOURCE: 1} if marked else {},
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
        "lifetime": "detached" if detached else None,
    }
    handle = ray.remote(KrexNode).options(**options).remote(runtime_dir, serve_args, idle_exit_s)
    _started.setdefault(node_id, handle)
    return handle


def node_actors(address: str | None = None) -> dict[str, Any]:
    """Every live node actor in the cluster, by node id."""
    ray = connect(address)
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == NAMESPACE and name.startswith(NODE_ACTOR_PREFIX):
            try:
                out[name[len(NODE_ACTOR_PREFIX):]] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
    return out


def require_nodes(address: str | None = None) -> dict[str, Any]:
    actors = node_actors(address)
    if not actors:
        raise NoKrexNodes("no krex node actors in this Ray cluster")
    return actors


def gather(ray: Any, refs: dict[str, Any], timeout_s: float,
           on_error: Any) -> list[dict[str, Any]]:
    """One answer per node actor call; ``on_error(node_id, exc)`` for an unreachable one."""
    out = []
    for node_id, ref in refs.items():
        try:
            out.append(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.RayError as exc:
            out.append(on_error(node_id, exc))
    return out


def stop(address: str | None = None, *, all_nodes: bool = False,
         timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Stop the daemons the node actors started, then the actors.

    By default only the node actors this driver started; ``all_nodes`` stops every
    krex node actor in the cluster (``krex cluster down``).
    """
    ray = connect(address)
    actors = node_actors(address) if all_nodes else dict(_started)
    out = gather(ray, {n: h.stop.remote() for n, h in actors.items()}, timeout_s,
                 lambda node_id, exc: {"node_id": node_id, "stopped": False,
                                       "error": type(exc).__name__})
    for node_id, handle in actors.items():
        ray.kill(handle, no_restart=True)
        _started.pop(node_id, None)
    return out
