"""``krex serve``, ``krex stop``, ``krex status``, ``krex doctor``."""

from __future__ import annotations

import argparse
import dataclasses
import time
import typing
from collections.abc import Callable
from typing import Any

from krex.cli.output import JSON_OUTPUT, console, ms, print_json, table
from krex.errors import DaemonNotRunning


def add_serve(sub: argparse._SubParsersAction, with_flags: bool = True) -> None:
    """``krex serve``; its flags come from ``DaemonConfig`` (only when serve runs: client
    commands never import the daemon)."""
    p = sub.add_parser("serve", help="run the node daemon in the foreground",
                       description="Run the node daemon in the foreground.")
    if with_flags:
        from krex.daemon.config import DaemonConfig

        add_config_flags(p, DaemonConfig)
    p.set_defaults(func=cmd_serve)


def add_config_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """One flag per field of the dataclass ``config`` from its metadata
    (:func:`krex.daemon.config.flag`): ``--name-with-dashes``; a boolean that defaults
    to true becomes ``--no-name``.  Unset flags leave the field's own default."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        meta = f.metadata
        if not meta.get("cli", False):
            continue
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS,
                              "help": _help(f, meta)}
        name = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            on = f.default is True
            name = "--no-" + f.name.replace("_", "-") if on else name
            kw["action"] = "store_false" if on else "store_true"
        else:
            kw["type"] = meta["parse"] or _scalar(kind)
            kw["choices"] = meta["choices"]
            kw["metavar"] = meta["metavar"]
        parser.add_argument(name, **kw)


def _scalar(kind: Any) -> Callable[[str], Any]:
    """``float``, ``int | None``, ``str`` -> the converter of the flag's text."""
    args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
    return args[0]


def _help(f: dataclasses.Field, meta: Any) -> str:
    if meta["hidden"]:
        return argparse.SUPPRESS
    default = meta["shown_default"]
    value = f.default
    if default is None and value is not dataclasses.MISSING and value is not None \
            and not isinstance(value, bool):
        default = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{meta['help']} (default: {default})" if default else meta["help"]


def config_from_args(args: argparse.Namespace, config: type) -> Any:
    """The dataclass ``config`` with the flags that were given; the rest its defaults."""
    return config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config)
                     if hasattr(args, f.name)})


def cmd_serve(args: argparse.Namespace) -> int:
    from krex.daemon.config import DaemonConfig
    from krex.daemon.server import serve
    from krex.errors import UsageError

    try:
        config = config_from_args(args, DaemonConfig)
        config.pool_spec()  # the workers' flags checked before anything starts
    except ValueError as exc:
        raise UsageError(f"krex serve: {exc}") from None
    return serve(config)


def add_stop(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="stop the node daemon cleanly")
    p.set_defaults(func=cmd_stop)


def cmd_stop(args: argparse.Namespace) -> int:
    from krex.client.connection import Client  # here: `krex --help` builds the parser

    try:
        client = Client(autostart=False, check_installation=False)
    except DaemonNotRunning:
        console.print("krex: no daemon running")
        return 0
    console.print(f"krex: daemon {stop_daemon(client)} stopped")
    return 0


def stop_daemon(client: Any, timeout_s: float = 15.0) -> int | None:
    """Ask ``client``'s daemon to stop, close the client, wait (up to ``timeout_s``) for
    the daemon to exit; returns its pid."""
    pid = client.conn.welcome.get("daemon_pid")
    client.stop()
    client.close()
    deadline = time.monotonic() + timeout_s
    while pid and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pid


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="daemon, devices, holders, queues and jobs",
                       parents=[JSON_OUTPUT])
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from krex.cli.lean import status

    return status(json_out=args.json)


def add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="what this machine supports, and how to get the best",
                       parents=[JSON_OUTPUT])
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from krex.enforce.doctor import diagnose

    st = _running_status()
    report = diagnose(daemon=st["daemon"] if st else None,
                      clocks=st.get("enforcement", {}).get("clocks") if st else None)
    if args.json:
        print_json(report)
        return 0
    table("krex doctor", ["check", "status", "detail", "advice"],
          [[c["check"], "ok" if c["ok"] else "missing", c["detail"], c.get("advice", "")]
           for c in report["checks"]])
    return 0


def _running_status() -> dict | None:
    """The running daemon's ``status()``, or None: none runs (doctor never starts one)."""
    from krex.client.connection import Client
    from krex.errors import KrexError

    try:
        with Client(autostart=False, reply_timeout_s=5) as c:
            return c.status()
    except (KrexError, OSError):
        return None


__all__ = ["ms"]
