"""feedpipe: keep accelerators fed.

Shard small-file datasets into WebDataset tars, stream them deterministically to every rank and
worker, cache at three tiers, and hand batches to the device.

The public API is imported lazily: ``import feedpipe`` loads neither torch nor DALI, starts no
CUDA context and no thread, and reads no environment variable.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "FeedDataset": "dataset",
    "FeedLoader": "loader",
    "DeviceLoader": "device_loader",
    "DeviceCache": "device_cache",
    "ShardReader": "reader",
    "open_shard": "reader",
    "shard": "convert",
    "ShardSummary": "convert",
    "index": "indexer",
    "verify": "verify",
    "demo": "demo",
    "probe": "probe",
    "ProbeReport": "probe",
    "Manifest": "manifest",
    "load_manifest": "manifest",
    "Plan": "plan",
    "FunctionIndex": "function_index",
    "World": "world",
    "detect_world": "world",
    "FeedpipeError": "errors",
    "ShardFormatError": "errors",
    "CompressedShardError": "errors",
    "ManifestError": "errors",
    "KeyClashError": "errors",
    "InputError": "errors",
    "SourceNotFoundError": "errors",
    "OutputError": "errors",
    "PlanError": "errors",
    "StateError": "errors",
    "DeviceCacheError": "errors",
    "MissingDependencyError": "errors",
    "AccessDeniedError": "errors",
    "RemoteError": "errors",
    "ShardCache": "shard_cache",
    "merge": "merge",
    "PartsError": "errors",
    "DecodedStore": "decoded_store",
    "DecodedStoreError": "errors",
    "cache_stats": "cache_tiers",
    "cache_clear": "cache_tiers",
    "ImagePipeline": "transforms",
    "BatchCollator": "collator",
    "ShardSet": "shard_set",
    "ImageSpec": "transforms",
    "DaliStage": "dali",
    "DecodeError": "errors",
    "SampleSkipped": "errors",
    "ShardWriter": "shard_writer",
    "write_samples": "shard_writer",
    "FieldTypeError": "errors",
    "shard_from": "table_source",
    "ShardOptions": "shard_options",
    "MethodError": "errors",
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


class _Package(types.ModuleType):
    """Some public names are also submodule names (``index``, ``verify``, ``demo``, ``probe``).
    The import system binds a submodule on its package when it is first imported (``from .index
    import ...`` in half the package does that), which would hide the public function; keep every
    name of ``_LAZY`` for what ``__getattr__`` resolves. The submodules stay in ``sys.modules``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from .convert import ShardSummary, shard
    from .dataset import FeedDataset
    from .device_cache import DeviceCache
    from .device_loader import DeviceLoader
    from .errors import (
        AccessDeniedError,
        DeviceCacheError,
        FeedpipeError,
        InputError,
        KeyClashError,
        ManifestError,
        MissingDependencyError,
        OutputError,
        PlanError,
        RemoteError,
        ShardFormatError,
        SourceNotFoundError,
        StateError,
    )
    from .function_index import FunctionIndex
    from .loader import FeedLoader
    from .manifest import Manifest, load_manifest
    from .probe import ProbeReport, probe
    from .reader import ShardReader, open_shard
    from .shard_cache import ShardCache
    from .merge import merge
    from .errors import PartsError
    from .decoded_store import DecodedStore
    from .errors import DecodedStoreError
    from .errors import CompressedShardError
    from .cache_tiers import cache_clear, cache_stats
    from .dali import DaliStage
    from .errors import DecodeError, SampleSkipped
    from .transforms import ImagePipeline, ImageSpec
    from .collator import BatchCollator
    from .shard_set import ShardSet
    from .errors import FieldTypeError
    from .shard_writer import ShardWriter, write_samples
    from .table_source import shard_from
    from .shard_options import ShardOptions
    from .errors import MethodError
