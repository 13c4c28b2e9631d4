"""Paths of the native artefacts built at install time, and the ABI check.

In: nothing (looks next to the package, in ``krex/_native/``).  Out: paths
(interposer, fake driver directory, fakegpu server) and the environment a
job's processes need to run under the interposer.  The interposer's ABI
version must equal :data:`ABI_VERSION` (the gate file layout, gate.h).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from krex.errors import InterposerMissing

ABI_VERSION = 1  # KREX_GATE_ABI in native/interpose/gate.h; krex.enforce.gate mirrors it
NATIVE_DIR = Path(__file__).resolve().parent.parent / "_native"


def interposer_path() -> Path:
    """The LD_PRELOAD interposer (may not exist: see :func:`check_interposer`)."""
    return NATIVE_DIR / "libkrex_interpose.so"


def fakegpu_lib_dir() -> Path:
    """The directory holding the fake ``libcuda.so.1`` and ``libamdhip64.so``."""
    return NATIVE_DIR / "fakegpu"


def fakegpu_server_path() -> Path:
    """The fakegpu device server executable."""
    return NATIVE_DIR / "bin" / "krex-fakegpu-server"


def interposer_abi(path: Path | None = None) -> int:
    """Load the interposer (RTLD_LOCAL: it hooks nothing here) and read its ABI."""
    lib = ctypes.CDLL(str(path or interposer_path()), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    lib.krex_interposer_abi_version.restype = ctypes.c_int
    return int(lib.krex_interposer_abi_version())


def check_interposer(path: Path | None = None) -> Path:
    """Return the interposer's path, or raise InterposerMissing (absent, unloadable, wrong ABI)."""
    path = path or interposer_path()
    if not path.exists():
        raise InterposerMissing(f"the native interposer is not built: {path} does not exist")
    try:
        abi = interposer_abi(path)
    except (OSError, AttributeError) as exc:
        raise InterposerMissing(f"cannot load the native interposer {path}: {exc}") from exc
    if abi != ABI_VERSION:
        raise InterposerMissing(
            f"interposer ABI {abi} at {path} does not match this krex (ABI {ABI_VERSION})")
    return path


def preload_env(gate_file: str | os.PathLike[str], slot: int = 0,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a job process: the interposer preloaded on its gate file and slot."""
    env = dict(os.environ if base is None else base)
    lib = str(check_interposer())
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != lib]
    env["LD_PRELOAD"] = ":".join([lib, *preload])
    env["KREX_GATE_FILE"] = str(gate_file)
    env["KREX_GATE_SLOT"] = str(slot)
    return env
