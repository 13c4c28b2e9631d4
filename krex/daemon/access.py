"""Who may do what: every request is authorised by the peer's ``SO_PEERCRED`` uid.

Per-user mode (the default): only the daemon's own user (and root) may
connect.  Node mode (``krex serve --node``): any user who can open the
socket (its group) may connect, and each acts only on its own jobs and
regions; *operators* — root and the daemon's own uid — may act on
everything, stop the daemon, run programs in the shared warm workers, and
name a tenant on behalf of someone else (the HTTP/MCP service does, for its
API tokens).  A tenant's programs run as the tenant's own uid
(:mod:`krex.daemon.users`): the daemon admits that uid in either mode, charges
its regions to its tenant, and lets it name no other tenant and run no program
in the warm workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from krex.daemon.tenants import checked_tenant, uid_tenant
from krex.errors import AccessDenied
from krex.protocol.peer import Peer

if TYPE_CHECKING:
    from krex.daemon.users import TenantUsers


class Access:
    def __init__(self, node: bool, daemon_uid: int, users: TenantUsers | None = None) -> None:
        self.node = node
        self.daemon_uid = daemon_uid
        self.users = users

    def admit(self, peer: Peer) -> None:
        """May this peer talk to the daemon at all?"""
        if not self.node and not self.operator(peer) and self._users_tenant(peer) is None:
            raise AccessDenied(f"wrong user: uid {peer.uid} is not the daemon's user",
                               hint="connect as the user who started the daemon, or ask the "
                                    "node's operator for a node daemon (krex serve --node)")

    def operator(self, peer: Peer) -> bool:
        return peer.uid in (0, self.daemon_uid)

    def require_operator(self, peer: Peer, what: str) -> None:
        if not self.operator(peer):
            raise AccessDenied(f"uid {peer.uid} may not {what}: only root or the daemon's "
                               f"user (uid {self.daemon_uid}) may",
                               hint="ask the node's operator")

    def check_owner(self, peer: Peer, owner_uid: int, what: str) -> None:
        """``what`` (a region, a job) belongs to ``owner_uid``: only it or an operator."""
        if peer.uid != owner_uid and not self.operator(peer):
            raise AccessDenied(f"uid {peer.uid} may not act on {what} of uid {owner_uid}",
                               hint="a user may release, revoke and inspect only its own "
                                    "regions and jobs")

    def visible(self, peer: Peer, owner_uid: int) -> bool:
        return peer.uid == owner_uid or self.operator(peer)

    def tenant(self, peer: Peer, asked: str | None) -> str:
        """The tenant a request is charged to: the peer's uid, or the tenant a trusted
        peer names."""
        own = self._users_tenant(peer)
        if own is not None and asked in (None, own):
            return own
        if asked is None:
            return uid_tenant(peer.uid)
        if not self.operator(peer):
            raise AccessDenied(f"uid {peer.uid} may not act for tenant {asked[:40]!r}",
                               hint="only root or the daemon's user (a service acting for "
                                    "its API tokens) may name a tenant")
        return checked_tenant(asked)

    def _users_tenant(self, peer: Peer) -> str | None:
        """The tenant whose code runs as the peer's uid, if it is a tenant user."""
        if self.users is None or self.operator(peer):
            return None
        return self.users.tenant_of(peer.uid)

    def may_exec(self, peer: Peer) -> None:
        """Only operators run programs in the warm workers (as the daemon's user, or as a
        tenant's): not another user of a node daemon, and not a tenant's program."""
        if not self.operator(peer):
            raise AccessDenied(
                f"uid {peer.uid} may not run programs in this daemon's warm workers (they "
                "run as the daemon's user, or as the user of the tenant an operator names)",
                hint="use `krex run` (your own process, regions from the node daemon), or a "
                     "per-user daemon for warm workers (KREX_RUNTIME_DIR=...)")
