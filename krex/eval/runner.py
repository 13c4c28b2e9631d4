"""Run the eval: calibrate, then interleaved blocks of every mode, with references.

In: an :class:`EvalConfig`.  Out: the raw results document (``blocks`` of
commands, kernel records, region records and the isolated references taken
just before and after each block), ready for :mod:`krex.eval.metrics`.

Machine drift cancels two ways: modes are interleaved (each round runs every
mode once, in a shuffled order), and every kernel's inflation is taken
against references measured alone right before and right after its block.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from krex import resultfile
from krex.errors import KrexError
from krex.eval import compile as cc
from krex.eval import kernels as kn
from krex.eval.daemon import EvalDaemon
from krex.eval.launch import PROGRAM, Launcher, run_command
from krex.eval.modes import MODES, Mode
from krex.eval.profile import Profile

Progress = Callable[[str, int, int], None]  # (label, done, total)


@dataclass
class EvalConfig:
    device: str = "cpu"
    agents: int = 8
    commands: int = 8  # per agent and mode, split over the rounds
    modes: list[Mode] = field(default_factory=lambda: list(MODES.values()))
    rounds: int = 2
    profile: Profile = field(default_factory=Profile)
    seed: int = 0
    command_timeout_s: float = 120.0  # a hung command is killed and counted as failed
    # Agents start spread over one nominal command (agent a after a/agents of it):
    # real agents are not in lockstep, and agents that all compile at once and then
    # all wait for the device at once leave host and device idle by turns.
    stagger: bool = True

    def start_offset_s(self, agent: int) -> float:
        if not self.stagger or self.agents < 2:
            return 0.0
        p = self.profile
        period_ms = p.import_ms + p.compile_ms + p.check_ms + p.timing_ms(self.device)
        return agent * period_ms / 1e3 / self.agents


def calibrate(cfg: EvalConfig, workdir: str) -> dict[str, Any]:
    """Kernel sizes and compile size for this machine; written to ``spec.json``."""
    p = cfg.profile
    twins = (p.twin_buckets_ms, p.twin_ratio)
    specs = (kn.calibrate_cpu(p.buckets_ms, p.cpu_kinds, *twins) if cfg.device == "cpu"
             else kn.device_specs(cfg.device, p.buckets_ms, *twins))
    spec = {"device": cfg.device, "profile": p.to_dict(), "n_funcs": cc.calibrate(p.compile_ms),
            "kernels": [k.to_dict() for k in specs]}
    resultfile.write(os.path.join(workdir, "spec.json"), spec, indent=None)
    return spec


def schedule(cfg: EvalConfig) -> list[tuple[int, Mode, int]]:
    """(round, mode, commands per agent) in interleaved, shuffled order."""
    rng = random.Random(cfg.seed)
    rounds = max(1, min(cfg.rounds, cfg.commands))
    per = [cfg.commands // rounds + (r < cfg.commands % rounds) for r in range(rounds)]
    out = []
    for r in range(rounds):
        order = list(cfg.modes)
        rng.shuffle(order)
        out += [(r, m, per[r]) for m in order]
    return out


def _warm(d: EvalDaemon, workdir: str, agents: int) -> None:
    """One no-op program per agent at once, so every worker is up before the clock starts."""
    spec = os.path.join(workdir, "spec.json")

    def one(i: int) -> None:
        la = Launcher(d.socket, d.device, d.env, os.path.join(workdir, "warm.log"))
        try:
            la.exec([spec, os.path.join(workdir, f"warm{i}.json"), "--phase", "noop"])
        finally:
            la.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def reference(d: EvalDaemon, mode: Mode, workdir: str, tag: str) -> list[dict[str, Any]]:
    """Every kernel timed alone, nothing else running, the way the mode runs commands
    (a warm worker for ``exec`` modes, else a fresh process)."""
    la = Launcher(d.socket, d.device, d.env, os.path.join(workdir, "ref.log"))
    base = os.path.join(workdir, f"ref-{tag}")
    args = [os.path.join(workdir, "spec.json"), f"{base}.json", "--phase", "time"]
    try:
        if mode.warm:
            la.exec(args)
        else:
            la.fresh([sys.executable, PROGRAM, *args], "region", f"ref-{tag}")
        with open(f"{base}.json") as f:
            return json.load(f)["kernels"]
    except (OSError, ValueError, KrexError):
        return []  # a missing reference: the other side of the block is used alone
    finally:
        la.close()


def _agent(d: EvalDaemon, mode: Mode, workdir: str, agent: int, n: int, tag: str,
           out: list[dict[str, Any]], tick: Callable[[], None], timeout_s: float,
           offset_s: float = 0.0) -> None:
    la = Launcher(d.socket, d.device, d.env, os.path.join(workdir, f"{tag}-a{agent}.log"),
                  timeout_s=timeout_s)
    try:
        time.sleep(offset_s)
        for i in range(n):
            base = os.path.join(workdir, f"{tag}-a{agent}-c{i}")
            t0 = time.monotonic()
            try:
                rec = run_command(la, mode, os.path.join(workdir, "spec.json"), base,
                                  seed=agent * 1000 + i, name=f"{tag}-a{agent}-c{i}")
            except KrexError as exc:  # e.g. the daemon refused a whole-job hold
                rec = {"start_mono_s": t0, "end_mono_s": time.monotonic(), "ok": False,
                       "wall_s": time.monotonic() - t0, "exit_codes": [], "kernels": [],
                       "phases": {}, "error": f"{type(exc).__name__}: {exc}"}
            out.append({"agent": agent, "index": i, **rec})
            tick()
    finally:
        la.close()


def run_block(cfg: EvalConfig, mode: Mode, rnd: int, n: int, workdir: str,
              tick: Callable[[], None]) -> dict[str, Any]:
    tag = f"{mode.name}-r{rnd}"
    with EvalDaemon(workdir, list(mode.serve_args), cfg.device, cfg.agents, cfg.profile) as d:
        if mode.warm:
            _warm(d, workdir, cfg.agents)
        before = reference(d, mode, workdir, f"{tag}-before")
        commands: list[dict[str, Any]] = []
        busy0 = d.device_busy_ns() if d.gpu is not None else None
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        threads = [threading.Thread(target=_agent, args=(d, mode, workdir, a, n, tag, commands,
                                                         tick, cfg.command_timeout_s,
                                                         cfg.start_offset_s(a)))
                   for a in range(cfg.agents)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t1 = time.monotonic()
        busy1 = d.device_busy_ns() if busy0 is not None else None
        after = reference(d, mode, workdir, f"{tag}-after")
        regions = _regions(d)
    busy_s = (busy1 - busy0) / 1e9 if busy0 is not None and busy1 is not None else None
    return {"mode": mode.name, "round": rnd, "start_mono_s": t0, "wall_s": t1 - t0,
            "device_busy_s": busy_s, "loadavg_1min": [load0, os.getloadavg()[0]],
            "commands": sorted(commands, key=lambda c: (c["agent"], c["index"])),
            "refs": {"before": before, "after": after}, "regions": regions}


def _regions(d: EvalDaemon) -> list[dict[str, Any]]:
    la = Launcher(d.socket, d.device, d.env, os.devnull)
    try:
        keep = ("region", "job", "device", "label", "exclusive", "nested", "granted_mono_s",
                "waited_s", "held_s", "outcome")
        return [{k: r.get(k) for k in keep} for r in la.client.regions(limit=100000)]
    finally:
        la.close()


def alone(cfg: EvalConfig, workdir: str, repeats: int = 2) -> dict[str, Any]:
    """Commands alone, fresh and warm: the phase sizes the bound is computed from."""
    quiet = Mode("alone", "fresh", "region")
    spec = os.path.join(workdir, "spec.json")
    out: dict[str, list[dict[str, Any]]] = {"fresh": [], "warm": []}
    with EvalDaemon(workdir, [], cfg.device, 1, cfg.profile) as d:
        _warm(d, workdir, 1)
        la = Launcher(d.socket, d.device, d.env, os.path.join(workdir, "alone.log"))
        try:
            for i in range(repeats):
                for kind, mode in (("fresh", quiet), ("warm", MODES["region"])):
                    base = os.path.join(workdir, f"alone-{kind}{i}")
                    out[kind].append(run_command(la, mode, spec, base, i, f"alone-{kind}{i}"))
        finally:
            la.close()
    return out


def run_eval(cfg: EvalConfig, progress: Progress | None = None,
             keep_dir: str | None = None) -> dict[str, Any]:
    """Calibrate, measure alone, run every block; return the raw document."""
    workdir = keep_dir or tempfile.mkdtemp(prefix="krex-eval-")
    os.makedirs(workdir, exist_ok=True)
    progress = progress or (lambda label, done, total: None)
    try:
        progress("calibrating", 0, 1)
        spec = calibrate(cfg, workdir)
        solo = alone(cfg, workdir)
        progress("calibrating", 1, 1)
        blocks = []
        for rnd, mode, n in schedule(cfg):
            done = [0]
            label = f"{mode.name} (round {rnd + 1})"

            def tick(label: str = label, done: list[int] = done, total: int = n) -> None:
                done[0] += 1
                progress(label, done[0], total * cfg.agents)

            progress(label, 0, n * cfg.agents)
            blocks.append(run_block(cfg, mode, rnd, n, workdir, tick))
        return {"spec": spec, "alone": solo, "blocks": blocks}
    finally:
        if keep_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
