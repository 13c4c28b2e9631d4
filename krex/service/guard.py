"""``Guard``: what every HTTP request to the service or to ``krex mcp`` passes first.

In: an ASGI request.  Out: the request, handed on, or a refusal with the
service's error body — 421 ``misdirected_request`` when its ``Host`` is not one
this listener answers to (DNS rebinding: a page of ``evil.example`` that
resolves to 127.0.0.1 reaches the port with ``Host: evil.example``), 403
``forbidden_origin`` when a browser sent it from a foreign ``Origin``, 401
when it has no token the listener accepts (``authenticate``).

Hosts allowed (:class:`Allowed`): the listener's own address with its port,
the loopback names (``localhost``, ``127.0.0.1``, ``[::1]``) on any port (an
ssh tunnel's local port; a rebinding page cannot send them as its ``Host``),
the machine's names when it listens on every address, and each
``--allow-host NAME`` (any port) or ``NAME:PORT``.  Origins allowed: ``http`` or
``https`` of an allowed host; a request without ``Origin`` (curl, agents, the
SDKs) is not a browser's cross-site one and passes.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from krex.errors import KrexError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARDS = ("0.0.0.0", "::", "")

# (headers, peer host) -> None, or raises a KrexError (Unauthorized): who may pass
Authenticate = Callable[[dict[bytes, bytes], str], None]


@dataclass(frozen=True)
class Allowed:
    exact: frozenset[str]  # "name:port", lower case
    any_port: frozenset[str]  # "name"

    def host(self, value: str) -> bool:
        value = value.strip().lower()
        name, port = split_host(value)
        return name in self.any_port or value in self.exact or (
            port is None and f"{name}:80" in self.exact)

    def origin(self, value: str) -> bool:
        parts = urlsplit(value.strip())
        return parts.scheme in ("http", "https") and bool(parts.netloc) and \
            "@" not in parts.netloc and self.host(parts.netloc)


def split_host(value: str) -> tuple[str, str | None]:
    """``name:port`` / ``[v6]:port`` / ``name`` -> (name, port or None)."""
    if value.startswith("["):
        name, _, rest = value.partition("]")
        return name + "]", rest[1:] if rest.startswith(":") else None
    name, sep, port = value.rpartition(":")
    return (name, port) if sep and port.isdigit() else (value, None)


def allowed(listen_host: str, port: int, extra: Iterable[str] = ()) -> Allowed:
    """The hosts a listener on ``listen_host:port`` answers to (see the module's doc)."""
    own = f"[{listen_host}]" if ":" in listen_host else listen_host
    names = [own]
    if listen_host in WILDCARDS:
        names = [socket.gethostname(), socket.getfqdn()]
    exact = {f"{n.lower()}:{port}" for n in names if n}
    any_port = set(LOOPBACK_NAMES)
    for item in extra:
        name, p = split_host(item.strip().lower())
        if p is None:
            any_port.add(name)
        else:
            exact.add(f"{name}:{p}")
    return Allowed(frozenset(exact), frozenset(any_port))


class Guard:
    """ASGI middleware: Host, Origin, then the token, on every HTTP request but
    ``open_paths`` (which still need an allowed Host and Origin)."""

    def __init__(self, app: Any, hosts: Allowed, authenticate: Authenticate | None,
                 open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = hosts
        self.authenticate = authenticate
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            await _answer(send, *refusal)

    def refusal(self, scope: dict[str, Any]) -> tuple[int, dict[str, Any], bool] | None:
        """(status, error, ask for a token) of a request refused, or None."""
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.hosts.host(host):
            return 421, _error("misdirected_request", f"this service does not answer to "
                               f"Host {host!r}", "use its address, or start it with "
                               "--allow-host NAME"), False
        origin = headers.get(b"origin")
        if origin is not None and not self.hosts.origin(origin.decode("latin-1")):
            return 403, _error("forbidden_origin", "requests from another site's pages are "
                               "refused", "open the node page from the service's own "
                               "address, or start it with --allow-host NAME"), False
        if self.authenticate is None or scope.get("path") in self.open_paths:
            return None
        client = scope.get("client")
        try:
            self.authenticate(headers, client[0] if client else "")
        except KrexError as exc:
            return 401, _error(exc.code, exc.message, exc.hint), True
        return None


def _error(code: str, what: str, hint: str | None) -> dict[str, Any]:
    return {"error": {"code": code, "what": what, "hint": hint}}


async def _answer(send: Callable[[dict[str, Any]], Awaitable[None]], status: int,
                  body: dict[str, Any], challenge: bool) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if challenge:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
