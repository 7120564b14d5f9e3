"""The error hierarchy.

Every error feedpipe raises derives from :class:`FeedpipeError` and also from the builtin a
caller would naturally catch, so ``except ValueError`` or ``except FileNotFoundError`` keeps
working around feedpipe calls.
"""

from __future__ import annotations

from ._redact import redact


class FeedpipeError(Exception):
    """Base class of every error feedpipe raises.

    Its message never holds a URL's secrets: the query values and user information of every URL
    in it are replaced by ``<redacted>`` when the error is made, so an error printed, logged or
    pasted into an issue tracker carries no token.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ShardFormatError(FeedpipeError, ValueError):
    """A shard, index or manifest is truncated, corrupted or not in the expected format."""

    # set where known (the tar scanner sets all three): the file, the byte offset, and the kind of
    # problem ("truncated", "header", "unsupported", "compressed", "index")
    shard: str | None = None
    offset: int | None = None
    kind: str = "format"


class CompressedShardError(ShardFormatError):
    """A shard is compressed (``.tar.gz``, ``.tgz``, or gzip/bzip2/xz/zstd bytes under a ``.tar``
    name): feedpipe reads samples by byte offset and needs plain tar. The message says how to
    convert it."""


class ManifestError(FeedpipeError, ValueError):
    """A manifest is missing fields, inconsistent, or from a newer format version."""


class KeyClashError(FeedpipeError, ValueError):
    """Two inputs map to the same sample key and field."""


class InputError(FeedpipeError, ValueError):
    """A source input is unusable (zero bytes, no extension, unreadable, bad manifest row)."""


class SourceNotFoundError(FeedpipeError, FileNotFoundError):
    """A source path or URL does not exist or is not what it must be (e.g. not a directory)."""


class OutputError(FeedpipeError, OSError):
    """The output cannot be written: not writable, not empty, disk full."""


class PartsError(FeedpipeError, ValueError):
    """The parts of a ``feedpipe shard --part I/N`` conversion cannot be merged: one is missing or
    unfinished, or they were made from different inputs or options (the message names the part)."""


class PlanError(FeedpipeError, ValueError):
    """A sampling plan cannot be made from these arguments (empty dataset, bad world shape)."""


class StateError(FeedpipeError, ValueError):
    """A saved loader state does not fit the dataset it is loaded into."""


class DecodeError(FeedpipeError, ValueError):
    """A sample's bytes cannot be decoded or transformed (corrupt or unsupported image, a label
    that is not an integer); the message names the sample's key and shard."""


class SampleSkipped(DecodeError):
    """Raised by a transform to leave one sample out of its batch instead of stopping the epoch
    (e.g. ``ImagePipeline(on_error="skip")`` on a corrupt image). The loader logs a warning naming
    the sample, counts it in ``loader.stats()["skipped"]`` and goes on; the resume position is
    unaffected (the sample counts as consumed)."""


class EmptyEpochError(FeedpipeError, RuntimeError):
    """An epoch delivered no batch at all: its transform left out every sample
    (:class:`SampleSkipped`), so training would run zero steps in silence."""


class DeviceCacheError(FeedpipeError, ValueError):
    """A sample does not fit a DeviceCache's field layout, or the cache cannot serve a request
    (not warmed up, an id outside the dataset, no fallback for samples that are not resident)."""


class DecodedStoreError(FeedpipeError, ValueError):
    """A transform's output does not fit the decoded store (not fixed-shape, another shape or
    dtype than the samples stored before it); the message names the sample's key and shard."""


class UncacheableTransformError(FeedpipeError, ValueError):
    """A cache (the decoded store, the function index) was given a transform it would freeze: one
    that draws at random or depends on the epoch; the message names the part or the sample."""


class MixtureError(FeedpipeError, ValueError):
    """A :class:`~feedpipe.Mixture` cannot be made or read as asked (a weight that is not a
    finite number, sources with other fields or another world shape); the message names the
    source."""


class PackedFieldError(FeedpipeError, ValueError):
    """A document of a :class:`~feedpipe.Packed` dataset is not a 1-D integer array, or a sample
    lacks the token field; the message names the sample's key and shard."""


class AccessDeniedError(FeedpipeError, PermissionError):
    """A remote source refused the request (wrong or missing credentials, no permission)."""


class RemoteError(FeedpipeError, OSError):
    """A remote source kept failing (connection reset, timeout, 5xx) after bounded retries."""


class MissingDependencyError(FeedpipeError, ImportError):
    """An optional dependency is not installed; the message carries the exact pip line."""


class MethodError(FeedpipeError, ValueError):
    """A conversion method forced with ``method=``/``--method`` cannot serve the input or the
    options (the message says why and which method would)."""


class FieldTypeError(InputError, TypeError):
    """A sample field's value has a type that :class:`feedpipe.ShardWriter` does not store
    without an explicit encoder (no pickle by default); the message names the sample and field."""


class StartMethodError(FeedpipeError, RuntimeError):
    """Worker processes cannot be started safely the way asked (forked from a process that runs
    DALI's threads); the message names the fix."""


class InterruptedWriteError(SourceNotFoundError):
    """A dataset directory's write is under way or was interrupted (its writer was killed or
    never closed): its committed shards are not the dataset. The message names the directory,
    the writer's pid and the file it left, and says how to redo the write."""
