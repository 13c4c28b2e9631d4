"""Tenant -> the unprivileged user its code runs as (:class:`TenantUsers`).

A root daemon runs the programs of a tenant that a trusted peer names (the
HTTP/MCP service's API tokens) as a uid of that tenant's own, taken from
``--tenant-uids FIRST-LAST``: the first number is the group of the daemon's
socket (every tenant user has it beside its own group, so its programs can
take regions); each tenant gets the next number that no account has
(``/etc/passwd``) and no process runs as, with a group of the same number and
a home ``homes/UID`` (0700) in the runtime directory.  The map is kept in
``tenant-uids.json`` there (owner-only), so a restarted daemon gives a tenant
the same uid and home; both go with the runtime directory (a reboot).

The daemon admits a tenant user's connections (its programs' regions) and
charges them to its tenant; a tenant user may name no other tenant.
"""

from __future__ import annotations

import json
import os
import stat
import threading

from krex.errors import AccessDenied
from krex.protocol.runas import RunAs, has_account, running_uids, uid_range

MAP_NAME = "tenant-uids.json"
HOMES = "homes"


OFF, DAEMON = "off", "daemon"  # refuse tenants' programs; run them as the daemon's user


def parse_range(text: str) -> range | None:
    """``"60500-60999"`` -> the uids (the first is the socket's group); ``"off"`` or
    ``"daemon"`` -> None."""
    if text in (OFF, DAEMON):
        return None
    try:
        return uid_range(text, "--tenant-uids")
    except ValueError as exc:
        raise ValueError(f"{exc}, 'off' or 'daemon'") from None


class TenantUsers:
    def __init__(self, uids: range, runtime_dir: str, socket_gid: int) -> None:
        self.uids = uids
        self.socket_gid = socket_gid
        self.homes = os.path.join(runtime_dir, HOMES)
        self.map_path = os.path.join(runtime_dir, MAP_NAME)
        self._lock = threading.Lock()
        self._by_tenant: dict[str, int] = self._load()
        self._by_uid = {uid: tenant for tenant, uid in self._by_tenant.items()}

    def run_as(self, tenant: str) -> RunAs:
        """The user ``tenant``'s code runs as: allocated on first use, with its home."""
        with self._lock:
            uid = self._by_tenant.get(tenant)
            if uid is None:
                uid = self._allocate(tenant)
            _directory(self.homes, os.getuid(), self.socket_gid, 0o710)
            home = os.path.join(self.homes, str(uid))
            _directory(home, uid, uid, 0o700)
        return RunAs(uid=uid, gid=uid, groups=(self.socket_gid,), home=home)

    def tenant_of(self, uid: int) -> str | None:
        with self._lock:
            return self._by_uid.get(uid)

    def _allocate(self, tenant: str) -> int:
        taken = set(self._by_uid) | running_uids()
        for uid in self.uids[1:]:
            if uid not in taken and not has_account(uid):
                self._by_tenant[tenant] = uid
                self._by_uid[uid] = tenant
                self._save()
                return uid
        raise AccessDenied(f"no free uid is left in --tenant-uids {self.uids.start}-"
                           f"{self.uids.stop - 1} for tenant {tenant!r}",
                           hint="give the daemon a larger range (krex serve --tenant-uids)")

    def _load(self) -> dict[str, int]:
        try:
            with open(self.map_path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}  # unreadable: allocated afresh (the homes' owners are checked)
        return {str(t): int(u) for t, u in data.get("tenants", {}).items()
                if isinstance(u, int) and u in self.uids[1:]}

    def _save(self) -> None:
        tmp = f"{self.map_path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"tenants": self._by_tenant}, f)
        os.replace(tmp, self.map_path)


def _directory(path: str, uid: int, gid: int, mode: int) -> None:
    """``path`` a real directory of ``uid``:``gid`` with ``mode`` (made or put right)."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise AccessDenied(f"{path} is not a directory", hint="remove it")
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(path, uid, gid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
