"""Tenants, their quotas in the service, and API tokens stored hashed.

A tenant is who a request is for: the tenant of its API token, or ``local``
for a request without a token on a loopback address.  Tokens are random
(256 bits) and shown once, when made; the file keeps only their SHA-256 (a
slow password hash adds nothing for random tokens) and compares in constant
time.  The file is ``tokens.json`` in the service's state directory, owner-only.

Quotas here are the ones the service itself can enforce on its jobs: active
jobs (queued + running) and jobs submitted per minute.  Region time, fair
share between tenants and maximum hold are the daemon's (``krex.service.work``
runs each job as its tenant in the daemon).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from krex import resultfile
from krex.errors import BadRequest, Unauthorized

LOCAL = "local"
TOKEN_PREFIX = "krex_"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class Quotas:
    max_active_jobs: int = 32  # queued + running
    max_jobs_per_minute: int = 600

    def __post_init__(self) -> None:
        if self.max_active_jobs < 1 or self.max_jobs_per_minute < 1:
            raise BadRequest("quotas must be >= 1")


@dataclass(frozen=True)
class Tenant:
    name: str
    quotas: Quotas = field(default_factory=Quotas)


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise BadRequest(f"not a tenant name: {name!r}",
                         hint="lower-case letters, digits, '_', '.', '-'; at most 63")
    return name


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenStore:
    """``tokens.json``: tenant -> SHA-256 of its token and its quotas."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._tenants: dict[str, dict[str, Any]] = {}
        self.reload()

    def reload(self) -> None:
        if not os.path.exists(self.path):
            self._tenants = {}
            return
        doc = resultfile.read(self.path, kind="krex-service-tokens", format=1)
        self._tenants = dict(doc.get("tenants", {}))

    def add(self, name: str, quotas: Quotas | None = None) -> str:
        """Make (or replace) ``name``'s token; returns it — the only time it is seen."""
        check_name(name)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._lock:
            self._tenants[name] = {"token_sha256": digest(token),
                                   "quotas": asdict(quotas or Quotas())}
            self._save()
        return token

    def remove(self, name: str) -> bool:
        with self._lock:
            found = self._tenants.pop(name, None) is not None
            self._save()
        return found

    def tenants(self) -> list[Tenant]:
        return [self._tenant(n) for n in sorted(self._tenants)]

    def named(self, name: str) -> Tenant:
        """Tenant ``name`` with the quotas of its entry here (default quotas without one):
        ``krex mcp --tenant NAME`` serves one tenant, whose quotas are set with
        ``krex service token add NAME --max-jobs-per-minute ...`` in the same state dir."""
        with self._lock:
            return self._tenant(name) if name in self._tenants else Tenant(name)

    def __len__(self) -> int:
        return len(self._tenants)

    def authenticate(self, token: str) -> Tenant:
        wanted = digest(token)
        found = None
        for name, entry in self._tenants.items():  # every entry: no early exit to time
            if hmac.compare_digest(wanted, str(entry.get("token_sha256", ""))):
                found = name
        if found is None:
            raise Unauthorized("unknown API token")
        return self._tenant(found)

    def _tenant(self, name: str) -> Tenant:
        return Tenant(name, Quotas(**self._tenants[name].get("quotas", {})))

    def _save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), mode=0o700, exist_ok=True)
        old = os.umask(0o077)
        try:
            resultfile.write(self.path, {"tenants": self._tenants}, format=1,
                             kind="krex-service-tokens")
        finally:
            os.umask(old)


def resolve(store: TokenStore, authorization: str | None, *, loopback_peer: bool,
            require_token: bool) -> Tenant:
    """The tenant of a request: its bearer token's, else ``local`` from loopback."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("the Authorization header is not `Bearer TOKEN`")
        return store.authenticate(token.strip())
    if loopback_peer and not require_token:
        return Tenant(LOCAL)
    raise Unauthorized("this service needs an API token (requests from other hosts always do)")
