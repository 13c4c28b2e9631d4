"""Find the node's devices and validate device strings."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import asdict, dataclass

from krex.errors import UnknownDevice

KINDS = ("cpu", "cuda", "rocm", "fakegpu")


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # "cpu", "cuda:0", ...
    kind: str
    index: int
    description: str

    def to_dict(self) -> dict:
        return asdict(self)


def discover() -> list[DeviceInfo]:
    devices = [DeviceInfo("cpu", "cpu", 0, f"host CPU ({os.cpu_count()} cores)")]
    devices += _cuda_devices() + _rocm_devices() + _fakegpu_devices()
    return devices


def _cuda_devices() -> list[DeviceInfo]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound and friends: no driver here
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            out.append(DeviceInfo(f"cuda:{i}", "cuda", i, str(name)))
        return out
    finally:
        pynvml.nvmlShutdown()


def _rocm_devices() -> list[DeviceInfo]:
    # amdsmi prints to stdout and raises KeyError on import without ROCm.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi

            amdsmi.amdsmi_init()
            handles = amdsmi.amdsmi_get_processor_handles()
    except Exception:  # noqa: BLE001 - KeyError, AmdSmiLibraryException, ...: no ROCm here
        return []
    return [DeviceInfo(f"rocm:{i}", "rocm", i, "AMD GPU") for i in range(len(handles))]


def _fakegpu_devices() -> list[DeviceInfo]:
    try:
        from krex.devices import fakegpu
    except ImportError:
        return []
    available = getattr(fakegpu, "available", None)
    if available is None or not available():
        return []
    return [DeviceInfo("fakegpu:0", "fakegpu", 0, "fake GPU (device server, busy-wait kernels)")]


def parse_device(text: str | None, known: list[DeviceInfo] | None = None) -> str:
    """Normalise ``cuda`` → ``cuda:0``; raise :class:`UnknownDevice` with the list."""
    raw = (text or os.environ.get("KREX_DEVICE") or "cpu").strip().lower()
    kind, _, index = raw.partition(":")
    if kind not in KINDS or (index and not index.isdigit()):
        raise UnknownDevice(
            f"invalid device {text!r}: expected cpu, cuda[:N], rocm[:N] or fakegpu[:N]",
            device=text,
        )
    name = "cpu" if kind == "cpu" else f"{kind}:{int(index or 0)}"
    if known is not None and name not in {d.name for d in known}:
        have = ", ".join(d.name for d in known)
        raise UnknownDevice(
            f"device {name} is not present on this node (present: {have})", device=name
        )
    return name
