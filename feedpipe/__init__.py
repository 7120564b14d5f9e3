"""feedpipe: keep accelerators fed.

Shard small-file datasets into WebDataset tars, stream them deterministically to every rank and
worker, cache at three tiers, and hand batches to the device.

The public API is imported lazily: ``import feedpipe`` loads neither torch nor DALI, starts no
CUDA context and no thread, and reads no environment variable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "FeedDataset": "dataset",
    "FeedLoader": "loader",
    "ShardReader": "reader",
    "open_shard": "reader",
    "shard": "convert",
    "ShardSummary": "convert",
    "index": "indexer",
    "verify": "verify",
    "demo": "demo",
    "Manifest": "manifest",
    "load_manifest": "manifest",
    "Plan": "plan",
    "FunctionIndex": "function_index",
    "World": "world",
    "detect_world": "world",
    "FeedpipeError": "errors",
    "ShardFormatError": "errors",
    "ManifestError": "errors",
    "KeyClashError": "errors",
    "InputError": "errors",
    "SourceNotFoundError": "errors",
    "OutputError": "errors",
    "PlanError": "errors",
    "StateError": "errors",
    "MissingDependencyError": "errors",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'feedpipe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from .convert import ShardSummary, shard
    from .dataset import FeedDataset
    from .errors import (
        FeedpipeError,
        InputError,
        KeyClashError,
        ManifestError,
        MissingDependencyError,
        OutputError,
        PlanError,
        ShardFormatError,
        SourceNotFoundError,
        StateError,
    )
    from .function_index import FunctionIndex
    from .loader import FeedLoader
    from .manifest import Manifest, load_manifest
    from .reader import ShardReader, open_shard
