"""Which krex a process runs: the identity both ends show at the handshake.

The daemon's ``welcome`` carries :func:`installation` (``krex_version``,
``krex_path`` — the real path of the ``krex`` package — and ``python``).  A
client from another installation (a second checkout, another venv) must not
use that daemon silently: its jobs would get the other installation's
interposer and workers.  :func:`mismatch` says why two identities differ.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from krex.version import __version__

FIELDS = ("krex_version", "krex_path", "python")


def installation() -> dict[str, str]:
    """This process's krex: its version, package directory and interpreter."""
    return {"krex_version": __version__,
            "krex_path": os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
            "python": sys.executable}


def mismatch(welcome: dict[str, Any], mine: dict[str, str] | None = None) -> str | None:
    """Why the daemon that sent ``welcome`` runs another krex than ours, or None."""
    mine = mine or installation()
    theirs = {k: welcome.get(k) for k in ("krex_version", "krex_path")}
    if not theirs["krex_path"]:
        return "the daemon does not say which krex it runs (it predates this krex)"
    if theirs == {k: mine[k] for k in theirs}:
        return None
    return (f"the daemon runs krex {theirs['krex_version']} from {theirs['krex_path']}; "
            f"this is krex {mine['krex_version']} from {mine['krex_path']}")
