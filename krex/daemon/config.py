"""Daemon settings, filled from ``krex serve`` flags or the embedded defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from krex.protocol.address import SOCKET_NAME, runtime_dir
from krex.workers import PoolSpec


@dataclass
class DaemonConfig:
    runtime_dir: str = field(default_factory=runtime_dir)
    socket_path: str = ""
    max_hold_s: float = 60.0
    idle_exit_s: float | None = None
    group_access: bool = False
    freeze: str = "auto"  # auto | cgroup2 | cgroup1 | signal | off
    freeze_scope: str = "device"  # device | node
    isolate: bool = True
    measure_cores: list[int] | None = None
    gate: bool = True
    drain_timeout_s: float = 5.0
    drain_policy: str = "abort"  # abort | wait | kill
    gpu_lock: str = "interposer"  # interposer (gate + drain) | checkpoint (cuCheckpointProcessLock)
    cgroups: bool = True
    embedded: bool = False
    shutdown_grace_s: float = 10.0  # first SIGTERM/stop: how long held regions may finish
    fakegpu_core: int | None = None
    fakegpu_ctx_delay_ms: int = 0
    workers_min: int = 1
    workers_max: int = 2
    max_programs: int = 100
    preload: list[str] = field(default_factory=lambda: ["numpy"])
    worker_memory_cap_mb: float | None = None

    def __post_init__(self) -> None:
        if not self.socket_path:
            self.socket_path = os.path.join(self.runtime_dir, SOCKET_NAME)

    def pool_spec(self) -> PoolSpec:
        return PoolSpec(device="cpu", min_workers=self.workers_min, max_workers=self.workers_max,
                        max_programs=self.max_programs, preload=list(self.preload),
                        device_memory_cap_mb=self.worker_memory_cap_mb)

    @property
    def event_log(self) -> str:
        return os.path.join(self.runtime_dir, "events.jsonl")

    @property
    def lock_path(self) -> str:
        return os.path.join(self.runtime_dir, "krexd.lock")
