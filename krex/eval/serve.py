"""``python -m krex.eval.serve POOL.json -- SERVE-ARGS``: ``krex serve`` with eval pool settings.

The eval needs one warm worker per agent, the framework stand-in preloaded
(``krex.eval.heavy``) and fakegpu's context-creation delay.  These are set on
the daemon's :class:`DaemonConfig` (whatever its ``serve`` flags are) before
the daemon starts; every other flag goes through ``krex serve`` unchanged.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _patched_serve(overrides: dict[str, Any]) -> Any:
    import krex.daemon.server as server

    original = server.serve

    def serve(config: Any) -> int:
        for key, value in overrides.items():
            if hasattr(config, key):
                setattr(config, key, value)
        return original(config)

    server.serve = serve
    return serve


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        overrides = json.load(f)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    _patched_serve(overrides)
    from krex.cli.main import main as krex_main

    return krex_main(["serve", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
