"""Names shared by the driver, the dispatcher and the node actors.

Custom resources a krex node advertises (``ray start --resources``), the
namespace and names of the actors, and the environment that keeps a local
test cluster on loopback.
"""

from __future__ import annotations

import json
import re

NAMESPACE = "krex"
NODE_ACTOR_PREFIX = "krex-node-"
DISPATCHER_PREFIX = "krex-dispatch-"

NODE_RESOURCE = "krex_node"  # 1 per node that offers krex: at most one node actor each
SLOTS_RESOURCE = "krex_worker_slots"  # warm workers per device the node's pools may run
DEVICE_RESOURCE_PREFIX = "krex_device_"  # krex_device_cpu, krex_device_cuda, ...


def node_actor_name(node_id: str) -> str:
    return NODE_ACTOR_PREFIX + node_id


def device_kind(device: str) -> str:
    """``cuda:1`` -> ``cuda``; ``cpu`` -> ``cpu``."""
    return device.split(":", 1)[0]


def device_resource(device: str) -> str:
    return DEVICE_RESOURCE_PREFIX + re.sub(r"[^a-z0-9_]", "_", device_kind(device).lower())


def node_resources(devices: list[str], worker_slots: int = 2) -> dict[str, float]:
    """The custom resources of a krex node with ``devices``, for ``ray start --resources``."""
    out: dict[str, float] = {NODE_RESOURCE: 1.0, SLOTS_RESOURCE: float(worker_slots)}
    for dev in devices:
        key = device_resource(dev)
        out[key] = out.get(key, 0.0) + 1.0
    return out


def resources_json(devices: list[str], worker_slots: int = 2) -> str:
    return json.dumps(node_resources(devices, worker_slots), sort_keys=True)


# Every process of a local cluster must see the same settings: Ray binds to the
# host's routable address unless told otherwise, reports usage unless told not to,
# and uses token authentication by default.
LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}
