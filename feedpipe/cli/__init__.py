"""The ``feedpipe`` command: a thin shell over the library functions of the same names."""

from ._main import main

__all__ = ["main"]
