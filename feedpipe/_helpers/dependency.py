"""Optional dependencies: import on demand, fail with the exact ``pip install`` line."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from ..errors import MissingDependencyError

# module name -> (extra that brings it, pip distribution name)
_EXTRAS: dict[str, tuple[str, str]] = {
    "nvidia.dali": ("dali", "nvidia-dali-cuda130"),
    "s3fs": ("s3", "s3fs"),
    "gcsfs": ("gcs", "gcsfs"),
    "aiohttp": ("http", "aiohttp"),
    "dask": ("dask", "dask[distributed]"),
    "distributed": ("dask", "dask[distributed]"),
    "matplotlib": ("plot", "matplotlib"),
    "webdataset": ("test", "webdataset"),
}


def install_hint(module: str, extra: str | None = None) -> str:
    """Return the exact pip command that installs what ``module`` needs."""
    top = module
    known = _EXTRAS.get(module) or _EXTRAS.get(module.split(".")[0])
    if extra is None and known is not None:
        extra = known[0]
    if extra is not None:
        return f"pip install 'feedpipe[{extra}]'"
    return f"pip install {top.split('.')[0]}"


def require(module: str, *, extra: str | None = None, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the pip line.

    Example:
        >>> require("json").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        what = f" for {purpose}" if purpose else ""
        raise MissingDependencyError(
            f"feedpipe needs the optional package {module!r}{what}, which is not installed "
            f"({e}). Install it with: {install_hint(module, extra)}"
        ) from e


# the optional C extensions whose absence was logged, each with what runs instead (one extension
# may serve two callers, each said)
UNBUILT_SAID: set[str] = set()


def say_unbuilt(log: logging.Logger, extension: str, instead: str, same: str) -> None:
    """Log once a process that the optional C extension ``feedpipe.<extension>`` was not built
    and what runs ``instead`` (its output ``same`` as the extension's, made more slowly)."""
    said = f"{extension}: {instead}"
    if said not in UNBUILT_SAID:
        UNBUILT_SAID.add(said)
        log.info("feedpipe: %s: the C extension feedpipe.%s was not built (it needs a C compiler "
                 "when feedpipe is installed); %s, made more slowly", instead, extension, same)
