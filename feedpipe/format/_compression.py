"""Compressed tar shards: how they are recognised (by name and by leading bytes) and the sentence
that refuses them. feedpipe reads each sample at its byte offset in a plain tar, which a
compressed stream does not allow; the refusal says how to convert."""

from __future__ import annotations

from ..errors import CompressedShardError

# name suffix -> (compression, the command that undoes it)
SUFFIXES = {".tar.gz": ("gzip", "gunzip"), ".tgz": ("gzip", "gunzip"),
            ".tar.bz2": ("bzip2", "bunzip2"), ".tbz2": ("bzip2", "bunzip2"),
            ".tar.xz": ("xz", "unxz"), ".txz": ("xz", "unxz"),
            ".tar.zst": ("zstd", "unzstd"), ".tzst": ("zstd", "unzstd")}
# leading bytes, compression, the command that undoes it
MAGIC = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"),
         (b"\xfd7zXZ\x00", "xz", "unxz"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"))


def compressed_suffix(name: str) -> str | None:
    """The compressed-tar suffix ``name`` ends with, or None.

    Example:
        >>> compressed_suffix("shards/a.TGZ"), compressed_suffix("a.tar")
        ('.tgz', None)
    """
    low = name.lower()
    return next((s for s in SUFFIXES if low.endswith(s)), None)


def compressed_error(path: str, kind: str | None = None) -> CompressedShardError:
    """The refusal of a compressed shard, saying how to convert it.

    Args:
        path: the shard; a name with a compressed suffix when ``kind`` is None.
        kind: the compression found in the file's leading bytes (under a ``.tar`` name).
    """
    where = path.rsplit("/", 1)[0] if "/" in path else "."
    if kind is None:
        suffix = compressed_suffix(path) or ".tar.gz"
        tool = SUFFIXES[suffix][1]
        plain = path[: len(path) - len(suffix)] + ".tar"
        how, what = f"`{tool} -k {path}` writes {plain}", ""
    else:
        tool = next(t for _, k, t in MAGIC if k == kind)
        how = f"`{tool} < {path} > {path}.plain && mv {path}.plain {path}`"
        what = f" the file is {kind}-compressed, not a plain tar:"
    err = CompressedShardError(
        f"{path}:{what} compressed shards are not supported for random access (feedpipe reads "
        f"each sample at its byte offset in a plain tar). Decompress it ({how}), then run "
        f"`feedpipe index {where}`; or convert the source files with `feedpipe shard SRC OUT`")
    err.shard, err.offset, err.kind = path, 0, "compressed"
    return err
