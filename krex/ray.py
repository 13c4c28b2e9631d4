"""``import krex.ray``: the Ray integration (see :mod:`krex.integrations.ray`)."""

from krex.integrations.ray import *  # noqa: F403
from krex.integrations.ray import __all__  # noqa: F401
