"""Submitting programs: ``submit`` / ``map`` return Ray ObjectRefs of result dicts.

In: program paths, arguments, device and retries.  Out: ObjectRefs; each
resolves to one result dict (:mod:`krex.integrations.ray.outcome`) — never to
an exception for a lost node or daemon: that is ``status == "lost"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from krex.integrations.ray import nodes
from krex.integrations.ray.dispatch import Dispatcher
from krex.integrations.ray.program import Program
from krex.integrations.ray.resources import DISPATCHER_PREFIX, NAMESPACE

_dispatcher: dict[str, Any] = {}  # "handle" -> this driver's dispatcher


def dispatcher(address: str | None = None) -> Any:
    """This driver's dispatcher actor (started on first use, on the driver's node)."""
    if "handle" not in _dispatcher:
        ray = nodes.connect(address)
        nodes.require_nodes(address)
        _dispatcher["handle"] = _start_dispatcher(ray)
    return _dispatcher["handle"]


def _start_dispatcher(ray: Any) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctx = ray.get_runtime_context()
    here = NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=True)
    return ray.remote(Dispatcher).options(
        name=DISPATCHER_PREFIX + ctx.get_job_id(), namespace=NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=10000, scheduling_strategy=here,
    ).remote()


def submit(program: str, args: Sequence[Any] | None = None, *, device: str = "cpu",
           retries: int = 0, timeout_s: float | None = None, env: dict[str, str] | None = None,
           cwd: str | None = None, ship: bool = True, address: str | None = None) -> Any:
    """Run the Python program ``program`` on a krex node; an ObjectRef of its result dict.

    The node's daemon runs it in a warm worker of ``device`` (regions and
    enforcement as on one node).  ``retries`` > 0 runs a *lost* program again on
    another node; by default a lost program is reported, never silently rerun.
    ``ship`` sends the program's text (no shared file system needed).
    """
    prog = Program.load(program, list(args or []), ship=ship, device=device,
                        timeout_s=timeout_s, env=dict(env or {}), cwd=cwd)
    return dispatcher(address).run.remote(prog.to_dict(), retries)


def map(programs: Iterable[str | tuple[str, Sequence[Any]]], args: Sequence[Any] | None = None,
        **kw: Any) -> list[Any]:
    """``submit`` each program (a path, or ``(path, args)``); a list of ObjectRefs in order."""
    refs = []
    for item in programs:
        path, its_args = (item, args) if isinstance(item, str) else (item[0], item[1])
        refs.append(submit(path, its_args, **kw))
    return refs


def status(address: str | None = None, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Every krex node: its info and its daemon's status (devices, holders, queues, pools)."""
    ray = nodes.connect(address)
    actors = nodes.require_nodes(address)
    out = nodes.gather(ray, {n: h.status.remote() for n, h in actors.items()}, timeout_s,
                       lambda node_id, exc: {"node_id": node_id,
                                             "error": f"node actor unreachable: {exc}"})
    return sorted(out, key=lambda s: s["node_id"])


def regions(address: str | None = None, timeout_s: float = 30.0) -> dict[str, list[dict]]:
    """The finished-region records of every node's current daemon, by node id."""
    ray = nodes.connect(address)
    actors = nodes.require_nodes(address)
    refs = {n: h.regions.remote() for n, h in actors.items()}
    return {n: ray.get(ref, timeout=timeout_s) for n, ref in refs.items()}


def shutdown(*, all_nodes: bool = False, address: str | None = None) -> list[dict[str, Any]]:
    """Stop this driver's dispatcher and node actors (their daemons first)."""
    ray = nodes.connect(address)
    handle = _dispatcher.pop("handle", None)
    if handle is not None:
        ray.kill(handle, no_restart=True)
    return nodes.stop(address, all_nodes=all_nodes)
