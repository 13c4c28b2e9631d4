"""A fake management library's device state in a JSON file (tests/fakenvml's ``pynvml``
and tests/fakeamdsmi's ``amdsmi`` share it): every call reads the file, so a test or a
job changes the device's state with ``update``, even inside a region."""

from __future__ import annotations

import json
import os
from typing import Any


class StateFile:
    def __init__(self, env: str, default: dict[str, Any]) -> None:
        self.env = env  # the variable naming the file
        self.default = default

    def load(self) -> dict[str, Any]:
        path = os.environ.get(self.env)
        if not path or not os.path.exists(path):
            return dict(self.default)
        with open(path) as f:
            return {**self.default, **json.load(f)}

    def update(self, **changes: Any) -> None:
        """Change the device's state (atomically: a reader never sees half a file)."""
        path = os.environ[self.env]
        state = {**self.load(), **changes}
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)
