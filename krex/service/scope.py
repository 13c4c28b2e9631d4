"""What a tenant of the service sees: its own, and of the others only that they are there.

The service asks the node daemon as its operator (it runs as the daemon's user) and
keeps every tenant's records in one database, so every view it serves is cut here
for the tenant that asks (issue 44).  The service's own tenant (``local``, its token
in the state directory) is the operator and sees everything.  Another tenant sees:

- its records only (``/v1/records*``, MCP ``get_record``; another tenant's id is
  "not found", as one that does not exist);
- the daemon's status with only its own jobs listed (the rest counted in
  ``other_jobs``) and, for holders and queued regions of others, that a region is
  held or waiting and for how long -- not its region, job, label, tenant or uid (the
  daemon cuts its status for a non-operator peer the same way);
- the node page's timeline with other tenants' regions as ``other`` (no job or
  label), shares of region time as its own and ``other``, and only its own
  evaluations;
- ``/metrics`` without the samples labelled with another tenant.
"""

from __future__ import annotations

import re
from typing import Any

from krex.service.tenants import LOCAL

OTHER = "other"
_TENANT_LABEL = re.compile(r'[{,]tenant="((?:[^"\\]|\\.)*)"')


def sees_all(tenant: str) -> bool:
    return tenant == LOCAL


def records_of(tenant: str) -> str | None:
    """Whose records ``tenant`` may read: its own, or (None) all of them."""
    return None if sees_all(tenant) else tenant


def status(st: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The daemon's status as ``tenant`` may see it."""
    if sees_all(tenant):
        return st
    jobs = [j for j in st.get("jobs", []) if j.get("tenant") == tenant]
    scheduler = {
        name: {"holder": _request(dev.get("holder"), tenant),
               "queue": [_request(r, tenant) for r in dev.get("queue", [])]}
        for name, dev in (st.get("scheduler") or {}).items()}
    return {**st, "jobs": jobs, "scheduler": scheduler,
            "other_jobs": int(st.get("other_jobs") or 0) + len(st.get("jobs", [])) - len(jobs)}


def _request(r: dict[str, Any] | None, tenant: str) -> dict[str, Any] | None:
    if r is None or r.get("tenant") == tenant:
        return r
    return {**r, "region": None, "job_id": None, "label": None, "tenant": None, "uid": None}


def summary(sm: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The node page's summary (:meth:`krex.service.node.NodeWatcher.summary`) as
    ``tenant`` may see it."""
    if sees_all(tenant):
        return sm
    devices = [{**d, "holder": _request(d.get("holder"), tenant),
                "queue": [_request(r, tenant) for r in d.get("queue", [])]}
               for d in sm.get("devices", [])]
    timeline = [bar if bar.get("tenant") == tenant else
                {**bar, "region": None, "job": None, "tenant": OTHER, "label": None}
                for bar in sm.get("timeline", [])]
    shares = sm.get("shares") or {}
    own = float(shares.get(tenant, 0.0))
    rest = sum(float(v) for k, v in shares.items() if k != tenant)
    return {**sm, "devices": devices, "timeline": timeline,
            "shares": {tenant: own, **({OTHER: rest} if rest else {})},
            "evaluations": [e for e in sm.get("evaluations", []) if e.get("tenant") == tenant]}


def metrics(text: bytes, tenant: str) -> bytes:
    """Prometheus text without the samples labelled with another tenant."""
    if sees_all(tenant):
        return text
    out = []
    for line in text.decode().splitlines(keepends=True):
        m = _TENANT_LABEL.search(line) if not line.startswith("#") else None
        if m is None or m.group(1) == tenant:
            out.append(line)
    return "".join(out).encode()
