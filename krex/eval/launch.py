"""Run one command of the workload in a given mode, from an agent's thread.

Each agent thread owns a :class:`Launcher` (its own daemon connection: a
region or whole-job acquire blocks that connection).  ``run_command`` runs
the command and returns its merged phase record (program results plus the
agent-side wall time).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from krex.client.connection import Client
from krex.client.job import ManagedJob
from krex.eval.modes import Mode

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "program.py")


class Launcher:
    def __init__(self, socket_path: str, device: str, env: dict[str, str], log_path: str,
                 timeout_s: float = 120.0) -> None:
        self.client = Client(socket_path, autostart=False)
        self.device, self.env, self.log_path = device, env, log_path
        self.timeout_s = timeout_s  # a hung command is killed and counted as failed (124)

    def close(self) -> None:
        self.client.close()

    def fresh(self, argv: list[str], job_mode: str, name: str) -> int:
        """A fresh process as a managed job (``command``: holding the device throughout)."""
        with ManagedJob(self.client, device=self.device, name=name, mode=job_mode,
                        hold_label=f"whole {name}", stop_signal=signal.SIGKILL) as job:
            with open(self.log_path, "ab") as log:
                job.spawn(argv, self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            return job.wait(self.timeout_s)

    def exec(self, args: list[str]) -> int:
        with open(self.log_path, "a") as log:
            result = self.client.exec(PROGRAM, args, device=self.device, env=self.env,
                                      timeout_s=self.timeout_s,
                                      on_output=lambda _s, text: log.write(text))
        return result.exit_code


def run_command(launcher: Launcher, mode: Mode, spec_path: str, result_base: str,
                seed: int, name: str) -> dict[str, Any]:
    """Run one command; return its phases, kernels, exit codes and wall seconds."""
    args = [spec_path]
    t0 = time.monotonic()
    codes, parts = [], []
    if mode.launch == "exec":
        codes.append(launcher.exec([*args, f"{result_base}.json", "--seed", str(seed)]))
        parts.append(f"{result_base}.json")
    elif mode.launch == "fresh":
        argv = [sys.executable, PROGRAM, *args, f"{result_base}.json", "--seed", str(seed)]
        codes.append(launcher.fresh(argv, mode.job_mode, name))
        parts.append(f"{result_base}.json")
    else:  # function: host compile, then one leased fresh process per device call
        for phase, job_mode in (("compile", "none"), ("check", "command"), ("time", "command")):
            path = f"{result_base}.{phase}.json"
            argv = [sys.executable, PROGRAM, *args, path, "--phase", phase, "--seed", str(seed)]
            codes.append(launcher.fresh(argv, job_mode, f"{name}-{phase}"))
            parts.append(path)
    t1 = time.monotonic()
    return {"start_mono_s": t0, "end_mono_s": t1, "wall_s": t1 - t0,
            "exit_codes": codes, "ok": all(c == 0 for c in codes), **_merge_parts(parts)}


def _merge_parts(paths: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"kernels": [], "phases": {}}
    for path in paths:
        try:
            with open(path) as f:
                part = json.load(f)
        except (OSError, ValueError):
            continue
        out["kernels"].extend(part.pop("kernels", []))
        for key, value in part.items():
            if key.endswith("_s"):
                out["phases"][key] = out["phases"].get(key, 0.0) + value
    return out
