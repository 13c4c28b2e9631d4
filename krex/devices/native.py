"""Paths of the native artefacts built at install time, and the ABI check.

In: nothing (looks next to the package, in ``krex/_native/``).  Out: paths
(interposer, fake driver directory, fakegpu server), the environment a job's
processes need to run under the interposer, and its named counters.  The
interposer's ABI version must equal :data:`ABI_VERSION` (the gate file
layout, defined once per language: ``gate.h`` here) and its counter names
:data:`COUNTERS` (``counters.def``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from krex.errors import InterposerMissing

# The one Python definition of the native contract (C: native/interpose/gate.h and
# counters.def); krex.enforce.gate lays the gate file out by them.
ABI_VERSION = 2  # KREX_GATE_ABI
# The interposer's named counters, in the order of native/interpose/counters.def.
COUNTERS = ("launch_direct", "launch_dlsym", "launch_getproc", "parked", "drains",
            "drain_failures", "sync_errors", "capturing_skipped", "unwrapped", "unmatched",
            "ungated")

__all__ = ["ABI_VERSION", "COUNTERS", "check_interposer", "counter_names", "interposer_counters",
           "interposer_path", "preload_env"]
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


def _load(path: Path | None = None) -> ctypes.CDLL:
    """The interposer loaded RTLD_LOCAL (it hooks nothing here), with its exports typed."""
    return _typed(ctypes.CDLL(str(path or interposer_path()), mode=os.RTLD_LOCAL | os.RTLD_NOW))


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.krex_interposer_abi_version.restype = ctypes.c_int
    lib.krex_interposer_counter_name.restype = ctypes.c_char_p
    lib.krex_interposer_counter_name.argtypes = [ctypes.c_int]
    lib.krex_interposer_counter.restype = ctypes.c_uint64
    lib.krex_interposer_counter.argtypes = [ctypes.c_int]
    return lib


def interposer_abi(path: Path | None = None) -> int:
    """The ABI version the interposer at ``path`` was built for."""
    return int(_load(path).krex_interposer_abi_version())


def counter_names(lib: ctypes.CDLL) -> list[str]:
    """The counter names a loaded interposer exports (counters.def order)."""
    names: list[str] = []
    _typed(lib)
    while (name := lib.krex_interposer_counter_name(len(names))) is not None:
        names.append(name.decode())
    return names


def interposer_counters(lib: ctypes.CDLL) -> dict[str, int]:
    """This process's named counters from a loaded interposer (the preloaded one
    when ``lib`` is ``ctypes.CDLL(path)`` in a process that preloads it)."""
    return {name: int(lib.krex_interposer_counter(i)) for i, name in enumerate(counter_names(lib))}


def check_interposer(path: Path | None = None) -> Path:
    """Return the interposer's path, or raise InterposerMissing (absent, unloadable, wrong ABI)."""
    path = path or interposer_path()
    if not path.exists():
        raise InterposerMissing(f"the native interposer is not built: {path} does not exist")
    try:
        lib = _load(path)
        abi, names = int(lib.krex_interposer_abi_version()), counter_names(lib)
    except (OSError, AttributeError) as exc:
        raise InterposerMissing(f"cannot load the native interposer {path}: {exc}") from exc
    if abi != ABI_VERSION:
        raise InterposerMissing(
            f"interposer ABI {abi} at {path} does not match this krex (ABI {ABI_VERSION})")
    if tuple(names) != COUNTERS:
        raise InterposerMissing(f"interposer counters at {path} ({', '.join(names)}) do not "
                                f"match this krex's ({', '.join(COUNTERS)}): rebuild it")
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
