"""Where a user's daemon lives on this node.

One daemon per user per node: ``$KREX_RUNTIME_DIR`` when set (tests, several
isolated daemons), else ``$XDG_RUNTIME_DIR/krex``, else ``/tmp/krex-<uid>``.
``$KREX_SOCKET`` names a socket directly (it is what managed jobs get).
"""

from __future__ import annotations

import os
import stat

from krex.errors import AccessDenied

SOCKET_NAME = "krexd.sock"


def runtime_dir() -> str:
    explicit = os.environ.get("KREX_RUNTIME_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "krex")
    return f"/tmp/krex-{os.getuid()}"


def socket_path() -> str:
    return os.environ.get("KREX_SOCKET") or os.path.join(runtime_dir(), SOCKET_NAME)


def ensure_private_dir(path: str) -> str:
    """Create ``path`` owner-only (0700) or check an existing one is ours and private."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise AccessDenied(
            f"runtime directory {path} is not a directory owned by uid {os.getuid()}",
            hint="remove it or set KREX_RUNTIME_DIR to a private directory",
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path
