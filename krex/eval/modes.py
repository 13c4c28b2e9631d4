"""The modes compared by the eval: how a command gets (or does not get) its device.

| mode | daemon flags | how a command runs |
|---|---|---|
| ``none`` | default | fresh process, managed job of mode ``none``: no exclusivity |
| ``command`` | default | fresh process holding the device from start to exit |
| ``function`` | default | fresh host process compiles; check and timing: each a |
|  |  | fresh process holding the device for that call |
| ``region`` | default | warm worker (``Client.exec``); regions around the timed loops |
| ``region-noworkers`` | default | fresh process (managed job, mode ``region``) |
| ``region-nofreeze`` | ``--freeze off`` | warm worker |
| ``region-nogate`` | ``--no-gate`` | warm worker |
| ``region-noisolate`` | ``--no-isolate`` | warm worker |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    launch: str  # fresh | function | exec
    job_mode: str  # none | command | region (the managed job's mode for fresh processes)
    serve_args: tuple[str, ...] = ()
    frozen_regions: bool = True  # siblings stop while a region is held (for the bound)

    @property
    def warm(self) -> bool:
        return self.launch == "exec"


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("none", "fresh", "none", frozen_regions=False),
    Mode("command", "fresh", "command", frozen_regions=False),
    Mode("function", "function", "command", frozen_regions=False),
    Mode("region", "exec", "region"),
    Mode("region-noworkers", "fresh", "region"),
    Mode("region-nofreeze", "exec", "region", ("--freeze", "off"), frozen_regions=False),
    Mode("region-nogate", "exec", "region", ("--no-gate",)),
    Mode("region-noisolate", "exec", "region", ("--no-isolate",)),
)}
DEFAULT_MODES = tuple(MODES)


def parse_modes(text: str | None) -> list[Mode]:
    """``none,command,region`` -> modes; unknown names raise ValueError."""
    names = [n.strip() for n in (text or ",".join(DEFAULT_MODES)).split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    return [MODES[n] for n in names]
