"""A local Ray cluster of N krex nodes on loopback, for tests, benchmarks and trying out.

In: the number of nodes and CPUs per node.  Out: a running
``ray.cluster_utils.Cluster`` (head + workers, every process bound to
127.0.0.1, token authentication with a fresh random token, no usage
reporting), this process connected to it, and one krex node actor per node,
each with its own daemon in ``<root>/<node id>``.  :meth:`LocalCluster.close`
stops the daemons, the actors and every Ray process it started.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import tempfile
from typing import Any

from krex.integrations.ray import nodes, submission
from krex.integrations.ray.nodes import import_ray
from krex.integrations.ray.resources import LOOPBACK, LOOPBACK_ENV, node_resources


def loopback_environment() -> dict[str, str]:
    """Set (in ``os.environ``, so every Ray process inherits it) what keeps Ray on loopback."""
    env = dict(LOOPBACK_ENV)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)
    os.environ.update(env)
    import_ray()
    _refresh_ray_settings()
    return env


def _refresh_ray_settings() -> None:
    """Ray reads these settings when it is imported: make an earlier import see ours."""
    from ray._private import ray_constants
    from ray._raylet import (  # type: ignore[attr-defined]  # compiled; not in its stub
        AuthenticationTokenLoader,
        Config,
    )

    ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


class LocalCluster:
    def __init__(self, n_nodes: int = 2, *, cpus_per_node: int = 1,
                 devices: tuple[str, ...] = ("cpu",), worker_slots: int = 2,
                 serve_args: list[str] | None = None, root: str | None = None) -> None:
        self.n_nodes = n_nodes
        self.cpus = cpus_per_node
        self.resources = node_resources(list(devices), worker_slots)
        self.serve_args = serve_args
        self.root = root or tempfile.mkdtemp(prefix="krex-ray-")
        self._own_root = root is None
        self.cluster: Any = None
        self.infos: list[dict[str, Any]] = []
        self.env: dict[str, str] = {}

    def start(self) -> LocalCluster:
        self.env = loopback_environment()
        from ray.cluster_utils import Cluster

        head = {"num_cpus": self.cpus, "resources": self.resources,
                "node_ip_address": LOOPBACK, "include_dashboard": False}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(self.n_nodes - 1):
            self.cluster.add_node(num_cpus=self.cpus, resources=self.resources,
                                  node_ip_address=LOOPBACK)
        self.cluster.wait_for_nodes()
        ray = import_ray()
        ray.init(address=self.cluster.address, namespace="krex", logging_level="warning",
                 _node_ip_address=LOOPBACK, log_to_driver=False)
        self.infos = nodes.start(runtime_dir=os.path.join(self.root, "{node_id}"),
                                 serve_args=self.serve_args)
        return self

    @property
    def address(self) -> str:
        return self.cluster.address

    def shell_env(self) -> dict[str, str]:
        """What another shell needs to reach this cluster: its address, the loopback
        settings and the token (``krex cluster status`` there then just works)."""
        return {**self.env, "RAY_ADDRESS": self.address}

    def shell_exports(self) -> str:
        """``export …`` lines of :meth:`shell_env`, to paste into another shell."""
        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self.shell_env().items())

    def close(self) -> None:
        ray = import_ray()
        try:
            if ray.is_initialized():
                submission.shutdown()
        finally:
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
                self.cluster = None
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
