"""Device backends and discovery.

In: nothing (probes the machine).  Out: the node's devices as
:class:`~krex.devices.discovery.DeviceInfo` and validated device strings:
``cpu`` (always), ``cuda:N`` (NVML, extra ``cuda``), ``rocm:N`` (amdsmi,
extra ``rocm``) and ``fakegpu:N`` (the fake driver built with the package).
"""

from krex.devices.discovery import DeviceInfo, discover, parse_device

__all__ = ["DeviceInfo", "discover", "parse_device"]
