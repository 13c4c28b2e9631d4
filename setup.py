"""Build hook: compiles the native parts (interposer, fakegpu) at install time.

Everything else about the package lives in pyproject.toml.
"""

from setuptools import setup

setup()
