"""feedpipe: keep accelerators fed.

Shard small-file datasets into WebDataset tars, stream them deterministically to every rank and
worker, cache at three tiers, and hand batches to the device.

The public API is the names below, imported lazily: ``import feedpipe`` loads neither torch nor
DALI, starts no CUDA context and no thread, and reads no environment variable. The subpackages
follow the data flow (``format``, ``plan``, ``caches``, ``transforms``, ``stream``, ``device``,
``convert``, ``diagnostics``, ``cli``); their modules are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module (under feedpipe) that defines it
_LAZY = {
    "shard": "convert._shard",
    "ShardSummary": "convert._summary",
    "ShardOptions": "convert._options",
    "shard_from": "convert._shard_from",
    "shard_tokens": "convert._token_shard",
    "merge": "convert._merge",
    "index": "format._indexer",
    "record_image_sizes": "format._image_sizes",
    "record_video_frames": "format._video_frames",
    "verify": "format._verify",
    "VerifyReport": "format._verify",
    "Problem": "format._verify",
    "ShardWriter": "convert._shard_writer",
    "write_samples": "convert._shard_writer",
    "ShardReader": "format._reader",
    "ShardIndex": "format._index",
    "open_shard": "format._reader",
    "Manifest": "format._manifest",
    "ShardRecord": "format._manifest",
    "load_manifest": "format._manifest",
    "source_path": "format._keys",
    "Plan": "plan._order",
    "World": "plan._world",
    "detect_world": "plan._world",
    "FeedDataset": "stream._dataset",
    "FeedLoader": "stream._loader",
    "check_ledger": "stream._ledger_check",
    "Packed": "stream._packed",
    "Bucketed": "stream._bucketed",
    "BucketCrop": "transforms._bucket_crop",
    "sdxl_buckets": "plan._buckets",
    "generated_buckets": "plan._buckets",
    "BestFit": "plan._packing",
    "ConcatenateAndCut": "plan._packing",
    "Packing": "plan._packing",
    "Layout": "plan._packing",
    "Pieces": "plan._packing",
    "Mixture": "stream._mixture",
    "ShardSet": "stream._shard_set",
    "BatchCollator": "stream._collator",
    "Route": "stream._routes",
    "Source": "stream._source",
    "VideoClips": "stream._video",
    "Capabilities": "stream._routes",
    "ImagePipeline": "transforms._pipeline",
    "ImageSpec": "transforms._pipeline",
    "ImageText": "transforms._image_text",
    "CaptionTokens": "transforms._image_text",
    "DaliStage": "transforms._dali",
    "DaliBatch": "transforms._dali",
    "DaliVideoStage": "transforms._dali_video",
    "image_decoders": "transforms._decode",
    "VideoClip": "transforms._video",
    "VideoInfo": "transforms._video",
    "video_info": "transforms._video",
    "ShardCache": "caches._shards",
    "DecodedStore": "caches.decoded._store",
    "FunctionIndex": "caches.l2._index",
    "cache_stats": "caches._tiers",
    "cache_clear": "caches._tiers",
    "DeviceLoader": "device._loader",
    "DeviceCache": "device._cache",
    "probe": "diagnostics._probe",
    "ProbeReport": "diagnostics._probe",
    "demo": "cli._demo",
    "FeedpipeError": "errors",
    "ShardFormatError": "errors",
    "CompressedShardError": "errors",
    "ManifestError": "errors",
    "KeyClashError": "errors",
    "InputError": "errors",
    "FieldTypeError": "errors",
    "SourceNotFoundError": "errors",
    "OutputError": "errors",
    "PartsError": "errors",
    "MethodError": "errors",
    "PlanError": "errors",
    "StateError": "errors",
    "StartMethodError": "errors",
    "DecodeError": "errors",
    "SampleSkipped": "errors",
    "EmptyEpochError": "errors",
    "InterruptedWriteError": "errors",
    "DeviceCacheError": "errors",
    "DecodedStoreError": "errors",
    "UncacheableTransformError": "errors",
    "MissingDependencyError": "errors",
    "AccessDeniedError": "errors",
    "RemoteError": "errors",
    "MixtureError": "errors",
    "PackedFieldError": "errors",
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


if TYPE_CHECKING:  # the same names for type checkers (tests/test_import.py keeps both in step)
    from .caches._shards import ShardCache
    from .caches._tiers import cache_clear, cache_stats
    from .caches.decoded._store import DecodedStore
    from .caches.l2._index import FunctionIndex
    from .cli._demo import demo
    from .convert._merge import merge
    from .convert._options import ShardOptions
    from .convert._shard import shard
    from .convert._shard_from import shard_from
    from .convert._shard_writer import ShardWriter, write_samples
    from .convert._summary import ShardSummary
    from .convert._token_shard import shard_tokens
    from .device._cache import DeviceCache
    from .device._loader import DeviceLoader
    from .diagnostics._probe import ProbeReport, probe
    from .errors import (
        AccessDeniedError,
        CompressedShardError,
        DecodedStoreError,
        DecodeError,
        DeviceCacheError,
        EmptyEpochError,
        FeedpipeError,
        FieldTypeError,
        InputError,
        InterruptedWriteError,
        KeyClashError,
        ManifestError,
        MethodError,
        MissingDependencyError,
        MixtureError,
        OutputError,
        PackedFieldError,
        PartsError,
        PlanError,
        RemoteError,
        SampleSkipped,
        ShardFormatError,
        SourceNotFoundError,
        StartMethodError,
        StateError,
        UncacheableTransformError,
    )
    from .format._image_sizes import record_image_sizes
    from .format._index import ShardIndex
    from .format._indexer import index
    from .format._keys import source_path
    from .format._manifest import Manifest, ShardRecord, load_manifest
    from .format._reader import ShardReader, open_shard
    from .format._verify import Problem, VerifyReport, verify
    from .format._video_frames import record_video_frames
    from .plan._buckets import generated_buckets, sdxl_buckets
    from .plan._order import Plan
    from .plan._packing import BestFit, ConcatenateAndCut, Layout, Packing, Pieces
    from .plan._world import World, detect_world
    from .stream._bucketed import Bucketed
    from .stream._collator import BatchCollator
    from .stream._dataset import FeedDataset
    from .stream._ledger_check import check_ledger
    from .stream._loader import FeedLoader
    from .stream._mixture import Mixture
    from .stream._packed import Packed
    from .stream._routes import Capabilities, Route
    from .stream._shard_set import ShardSet
    from .stream._source import Source
    from .stream._video import VideoClips
    from .transforms._bucket_crop import BucketCrop
    from .transforms._dali import DaliBatch, DaliStage
    from .transforms._dali_video import DaliVideoStage
    from .transforms._decode import image_decoders
    from .transforms._image_text import CaptionTokens, ImageText
    from .transforms._pipeline import ImagePipeline, ImageSpec
    from .transforms._video import VideoClip, VideoInfo, video_info
