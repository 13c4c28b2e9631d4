"""The version of this krex: one place, imported by the package root and the handshake."""

__version__ = "0.1.0"
