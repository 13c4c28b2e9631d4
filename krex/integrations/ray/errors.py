"""Errors of the Ray integration (typed, picklable, with a unique ``code``)."""

from __future__ import annotations

from krex.errors import KrexError


class RayMissing(KrexError):
    code = "ray_missing"
    default_hint = "install the extra: pip install 'krex[ray]'"


class NoKrexNodes(KrexError):
    code = "ray_no_krex_nodes"
    default_hint = ("start the node actors with `krex cluster up --address ADDRESS` "
                    "(or krex.ray.start()) and check `krex cluster status`")


def import_ray():  # noqa: ANN201  (the ray module; typed as Any to keep ray optional)
    """``import ray``, or :class:`RayMissing` with the install hint."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(f"Ray is not importable: {exc}") from None
    return ray


class ClusterUnreachable(KrexError):
    code = "ray_cluster_unreachable"
    default_hint = ("check the address (the head's `ray start --head` prints it; "
                    "`ray status --address ADDRESS`), and that RAY_AUTH_MODE / RAY_AUTH_TOKEN "
                    "match the cluster's (a LocalCluster uses token authentication: "
                    "docs/cluster.md, 'Reaching a local cluster from another shell')")
