"""``ServiceConfig``: where the service listens, keeps its state, and its limits."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from krex.errors import BadRequest

DEFAULT_PORT = 8765
KEEP_FINISHED = 20000  # finished jobs the jobs store keeps by default; older ones are pruned


@dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    state_dir: str = ""  # jobs database, tokens, job files (default: $XDG_STATE_HOME/krex)
    records: str | None = None  # the records database (default: krex.records' default)
    runners: int = 8  # jobs run at once (each a daemon client; the daemon's pools queue them)
    max_body_bytes: int = 256 * 1024  # larger request bodies: 413
    max_wait_s: float = 60.0  # longest long-poll
    max_exec_timeout_s: float = 600.0
    job_output_bytes: int = 64 * 1024  # the tail of an exec's output kept with the job
    node_poll_s: float = 1.0  # how often the daemon's status and regions are read
    timeline_s: float = 600.0  # regions kept for the node page
    trust_loopback: bool = False  # loopback without a token is tenant `local` (unsafe if shared)
    allow_hosts: tuple[str, ...] = ()  # more Host names it answers to (krex.service.guard)
    keep_finished: int = KEEP_FINISHED  # finished jobs the store keeps (krex.service.jobs)
    max_long_polls: int = 256  # long polls waiting at once; one tenant's at most half of them
    jobs_max_mb: float = 256.0  # the jobs database's pages in use at most (oldest finished go)
    records_max_mb: float | None = None  # the records database's, after each evaluation job

    def __post_init__(self) -> None:
        if not self.state_dir:
            base = os.environ.get("XDG_STATE_HOME") or os.path.join(
                os.path.expanduser("~"), ".local", "state")
            self.state_dir = os.path.join(base, "krex", "service")
        self.state_dir = os.path.abspath(self.state_dir)  # job folders: their processes' cwd
        if self.records is not None:
            self.records = os.path.abspath(self.records)  # is read from a process in "/"
        for bad, what, flag in ((self.runners < 1, f"runners {self.runners}", "--runners"),
                                (self.max_body_bytes < 1024,
                                 f"max_body_bytes {self.max_body_bytes}", "--max-body-kb"),
                                (self.keep_finished < 1, f"keep_finished {self.keep_finished}",
                                 "--keep-finished"),
                                (self.jobs_max_mb <= 0, f"jobs_max_mb {self.jobs_max_mb}",
                                 "--jobs-max-mb"),
                                (self.records_max_mb is not None and self.records_max_mb <= 0,
                                 f"records_max_mb {self.records_max_mb}", "--records-max-mb"),
                                (self.max_long_polls < 2,
                                 f"max_long_polls {self.max_long_polls}", "--max-long-polls")):
            if bad:
                raise BadRequest(f"{what} is too small",
                                 hint=f"give {flag} a larger number")

    @property
    def tokens_path(self) -> str:
        return os.path.join(self.state_dir, "tokens.json")

    @property
    def token_path(self) -> str:
        """The service's own token (tenant ``local``), in plain text, owner-only."""
        return os.path.join(self.state_dir, "token")

    @property
    def jobs_path(self) -> str:
        return os.path.join(self.state_dir, "jobs.sqlite3")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise BadRequest(f"not an address: {text!r}", hint="e.g. 127.0.0.1:8765")
    return host.strip("[]"), int(port)
