"""The workload profile: how long each phase of one benchmarking command takes.

A command of an agent that optimises kernels has four phases (DESIGN.md,
"Measuring krex itself"): start-up (interpreter, framework imports, device
context), compile (a real ``cc`` run), correctness check (device work,
untimed) and timing (``krex.measure`` of kernels in the >= 0.1 ms, >= 1 ms and
>= 10 ms buckets, each timed loop inside a region).

The default profile keeps the proportions of a typical PyTorch/Triton
kernel-optimisation step (start-up 1-3 s with torch, context 0.4-1 s, compile
2-10 s, check 0.5-2 s, timing 0.5-2 s: timing about a fifth of a command or
less) scaled down about 4x so that a 2-core machine runs dozens of commands a
minute.  Every size is a parameter (``krex eval --profile-json``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

BUCKETS_MS = (0.1, 1.0, 10.0)


@dataclass(frozen=True)
class Profile:
    """Phase sizes of one command (milliseconds of work measured alone)."""

    name: str = "default"
    import_ms: float = 500.0  # CPU burnt importing the "framework" (warm workers: once)
    ctx_delay_ms: float = 400.0  # fakegpu context creation, serialised node-wide
    compile_ms: float = 1200.0  # target wall time of one cc run, alone
    check_ms: float = 300.0  # untimed device work of the correctness check
    warmup_ms: float = 25.0  # krex.measure warm-up per kernel, outside the region
    rep_ms: float = 60.0  # timed loop per kernel, inside its region
    buckets_ms: tuple[float, ...] = BUCKETS_MS
    cpu_kinds: tuple[str, ...] = ("compute", "memory")  # one kernel per kind and bucket
    # Candidate pairs: in these buckets every kind also gets a twin kernel whose true time
    # is ``twin_ratio`` x its own (metrics.rank_flips: do the modes keep their order?).
    twin_buckets_ms: tuple[float, ...] = (1.0,)
    twin_ratio: float = 1.03
    cache: dict[str, str] = field(default_factory=lambda: {"cpu": "hot", "fakegpu": "cold"})

    def kinds(self, device: str) -> tuple[str, ...]:
        return self.cpu_kinds if device == "cpu" else ("spin",)

    def cache_for(self, device: str) -> str:
        return self.cache.get(device.partition(":")[0], "cold")

    def timing_ms(self, device: str) -> float:
        """Nominal timing phase: warm-up plus timed loop of every kernel."""
        twins = len([b for b in self.twin_buckets_ms if b in self.buckets_ms])
        kernels = (len(self.buckets_ms) + twins) * len(self.kinds(device))
        return kernels * (self.warmup_ms + self.rep_ms)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        for key in ("buckets_ms", "cpu_kinds", "twin_buckets_ms"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)


DEFAULT = Profile()
QUICK = Profile(name="quick", import_ms=120.0, ctx_delay_ms=100.0, compile_ms=250.0,
                check_ms=60.0, warmup_ms=5.0, rep_ms=15.0)


def load(name_or_path: str | None, quick: bool) -> Profile:
    """``default`` / ``quick`` or a JSON file of overrides on top of the default."""
    if not name_or_path:
        return QUICK if quick else DEFAULT
    if name_or_path in ("default", "quick"):
        return QUICK if name_or_path == "quick" else DEFAULT
    with open(name_or_path) as f:
        base = QUICK if quick else DEFAULT
        return Profile.from_dict({**base.to_dict(), **json.load(f)})
