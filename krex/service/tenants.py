"""Tenants, their quotas in the service, and API tokens stored hashed.

A tenant is who a request is for: the tenant of its API token.  Every request
needs one; a loopback address is not an identity (only ``--trust-loopback``
makes a request without a token from loopback tenant ``local``).  Tokens are
random (256 bits) and shown once, when made; the file keeps only their SHA-256
(a slow password hash adds nothing for random tokens) and compares in constant
time.  The file is ``tokens.json`` in the service's state directory, owner-only;
it is read again when it changes (a ``stat`` per request, at most every
:data:`RECHECK_S`), so a removed token is refused without a restart.

The service's own token (tenant ``local``: the service's user, the CLI, the
tests) is made at its first start and kept in plain text in ``token`` beside
``tokens.json``, owner-only (:func:`own_token`): whoever can read it can
already run code as the service's user.

Quotas here are the ones the service itself can enforce on its jobs: active
jobs (queued + running) and jobs submitted per minute.  Region time, fair
share between tenants and maximum hold are the daemon's (``krex.service.work``
runs each job as its tenant in the daemon).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from krex import resultfile
from krex.errors import BadRequest, Unauthorized

LOCAL = "local"
TOKEN_PREFIX = "krex_"
RECHECK_S = 0.25  # how often at most the tokens file is stat()ed for a change
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
        self._seen: tuple[int, ...] | None = None  # the file's stat when last read
        self._checked = 0.0
        self.reload()

    def reload(self) -> None:
        with self._lock:
            self._reload_locked()

    def _reload_locked(self) -> None:
        self._checked = time.monotonic()
        seen = _identity(self.path)
        if seen is None:
            self._tenants, self._seen = {}, None
            return
        doc = resultfile.read(self.path, kind="krex-service-tokens", format=1)
        self._tenants, self._seen = dict(doc.get("tenants", {})), seen

    def refresh(self) -> None:
        """Read the file again if it changed (another process added or removed a token)."""
        if time.monotonic() - self._checked < RECHECK_S:
            return
        with self._lock:
            self._checked = time.monotonic()
            if _identity(self.path) != self._seen:
                self._reload_locked()

    def add(self, name: str, quotas: Quotas | None = None) -> str:
        """Make (or replace) ``name``'s token; returns it — the only time it is seen."""
        check_name(name)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._lock, _flocked(self.path):
            self._reload_locked()  # what another process wrote since is kept
            self._tenants[name] = {"token_sha256": digest(token),
                                   "quotas": asdict(quotas or Quotas())}
            self._save()
        return token

    def remove(self, name: str) -> bool:
        with self._lock, _flocked(self.path):
            self._reload_locked()
            found = self._tenants.pop(name, None) is not None
            self._save()
        return found

    def tenants(self) -> list[Tenant]:
        return [self._tenant(n) for n in sorted(self._tenants)]

    def named(self, name: str) -> Tenant:
        """Tenant ``name`` with the quotas of its entry here (default quotas without one):
        ``krex mcp --tenant NAME`` serves one tenant, whose quotas are set with
        ``krex service token add NAME --max-jobs-per-minute ...`` in the same state dir."""
        self.refresh()
        with self._lock:
            return self._tenant(name) if name in self._tenants else Tenant(name)

    def __len__(self) -> int:
        return len(self._tenants)

    def authenticate(self, token: str) -> Tenant:
        self.refresh()
        wanted = digest(token)
        found = None
        tenants = self._tenants  # replaced whole by a reload, never changed in place
        for name, entry in tenants.items():  # every entry: no early exit to time
            if hmac.compare_digest(wanted, str(entry.get("token_sha256", ""))):
                found = name
        if found is None:
            raise Unauthorized("unknown API token")
        return Tenant(found, Quotas(**tenants[found].get("quotas", {})))

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
        self._seen = _identity(self.path)


def _identity(path: str) -> tuple[int, ...] | None:
    """What tells a changed file (an atomic replace makes a new inode), or None: none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)


def own_token(store: TokenStore, path: str) -> tuple[str, bool]:
    """The service's own token (tenant ``local``) from ``path``; made (and written there,
    mode 0600) when ``path`` has none or one ``store`` no longer knows.  Returns (the
    token, whether it was made now).  Two services starting on one state directory
    (``krex service`` and ``krex mcp``) make one token between them."""
    with _flocked(path):
        store.reload()
        try:
            with open(path) as f:
                token = f.read().strip()
            if store.authenticate(token).name == LOCAL:
                return token, False
        except (FileNotFoundError, Unauthorized):
            pass
        return _write_own(store.add(LOCAL), path), True


def _write_own(token: str, path: str) -> str:
    tmp = f"{path}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)  # left by a start that died here
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


@contextlib.contextmanager
def _flocked(path: str) -> Iterator[None]:
    """``path``'s lock file (``PATH.lock``, owner-only) held: one writer at a time across
    processes (``krex service token add`` beside a running service)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def resolve(store: TokenStore, authorization: str | None, *, loopback_peer: bool,
            trust_loopback: bool = False) -> Tenant:
    """The tenant of a request: its bearer token's (else, only with ``trust_loopback``,
    ``local`` for a request from loopback)."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("the Authorization header is not `Bearer TOKEN`")
        return store.authenticate(token.strip())
    if loopback_peer and trust_loopback:
        return Tenant(LOCAL)
    raise Unauthorized("this service needs an API token",
                       hint="send `Authorization: Bearer TOKEN`: the service's own token is "
                            "in the file `token` of its state directory; `krex service "
                            "token add TENANT` makes one for a tenant")
