"""The driver's view of the cluster: connect, start, find and stop node actors.

In: a Ray address (or the Ray instance this process already joined) and where
each node's daemon keeps its runtime directory.  Out: one named node actor per
Ray node (``krex-node-<node id>``, namespace ``krex``), pinned to its node,
holding that node's ``krex_node`` resource when the node advertises one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
import threading
from typing import Any

from krex.errors import ClusterUnreachable, NoKrexNodes, RayMissing
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


def connect(address: str | None = None, timeout_s: float | None = None) -> Any:
    """Join the Ray cluster at ``address`` (``auto`` / None: the local one) once.

    With ``timeout_s``, give up with :class:`ClusterUnreachable` instead of
    letting Ray retry (and log) for minutes: an address that refuses
    connections fails at once, a cluster that does not let us in (a wrong or
    missing auth token) after ``timeout_s``.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    init = functools.partial(ray.init, address=address, namespace=NAMESPACE,
                             logging_level="warning", log_to_driver=False)
    if timeout_s is None:
        init()
        return ray
    probe_address(address, min(timeout_s, PROBE_TIMEOUT_S))
    with captured_stderr() as log:
        finished = _run_with_deadline(init, timeout_s)
        said = _last_line(log)
    if not finished:
        raise ClusterUnreachable(
            f"Ray did not connect to {address or 'the local cluster'} within {timeout_s:g} s"
            f"{said}", seconds=timeout_s)
    return ray


PROBE_TIMEOUT_S = 5.0


def probe_address(address: str | None, timeout_s: float) -> None:
    """A TCP connect to ``host:port``: fail at once where nothing listens."""
    host, _, port = (address or "").rpartition(":")
    if address in (None, "", "auto") or not port.isdigit() or "://" in host:
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterUnreachable(f"no Ray cluster answers at {address} "
                                 f"({exc.strerror or exc})") from None


def _run_with_deadline(fn: Any, timeout_s: float) -> bool:
    """Run ``fn`` in a daemon thread; True when it finished (its error re-raised) in time."""
    box: dict[str, BaseException] = {}
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="krex-ray-connect", daemon=True).start()
    if not done.wait(timeout_s):
        return False
    if "error" in box:
        raise box["error"]
    return True


@contextlib.contextmanager
def captured_stderr() -> Any:
    """Send fd 2 (Ray's C++ logging) to a temporary file meanwhile; yield the file."""
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield log
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _last_line(log: Any) -> str:
    log.seek(0)
    lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
    return f"; Ray said: {lines[-1][-300:]}" if lines else ""


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
