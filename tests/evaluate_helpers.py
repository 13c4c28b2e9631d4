"""Shared by the krex.evaluate tests: a daemon per module, the gallery's paths."""

from __future__ import annotations

import os

import pytest
from helpers import Daemon

GALLERY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evaluate_gallery")
CPU = os.path.join(GALLERY, "cpu")
FAKEGPU = os.path.join(GALLERY, "fakegpu")


def spec(folder: str, text: str) -> str:
    """'file.py:fn' inside a gallery folder."""
    return os.path.join(folder, text)


def module_daemon(tmp_path_factory: pytest.TempPathFactory, *extra: str):
    """Start a private daemon for a whole test module; yields it, stops it after."""
    runtime = tmp_path_factory.mktemp("rt")
    os.chmod(runtime, 0o700)
    daemon = Daemon(str(runtime), *extra)
    daemon.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KREX_SOCKET", daemon.socket)
        try:
            yield daemon
        finally:
            daemon.stop()
