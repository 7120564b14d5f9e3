"""``TokenDocs``: where each token document of a dataset lies in its shards, learnt from the
``.npy`` headers alone.

A document stored as a ``.npy`` member is a header (magic, version, a Python dict literal
giving ``descr``, ``fortran_order`` and ``shape``) followed by the raw array. Its token count
follows from the member's size in the shard index and the header's length and dtype, so the
lengths a packing needs are known without reading a token, and a row's tokens are sliced
straight out of the shard's map. The headers ``np.save`` writes for one dtype share every byte
up to the shape's digits: one document's header is parsed, and the others are checked against
it a shard at a time (the shape's digits against the count the size implies). A header that
differs (another dtype, another version) is parsed on its own.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PackedFieldError
from ._token_lengths import layout

if TYPE_CHECKING:
    from ..format._reader import ShardReader
    from ._mixture_shards import MixtureShards
    from ._shard_set import ShardSet

_MAGIC = b"\x93NUMPY"
_SHAPE = b"'shape': ("
_HEAD = 64 * 1024  # the most header bytes looked at (np.save pads headers to 64 bytes)


class NotMapped(Exception):
    """A shard this process cannot map (remote, uncached): its documents are read whole."""


class TokenDocs:
    """Per global sample id: the shard, the byte offset of the document's array data in it, its
    token count and its dtype (an index into :attr:`dtypes`).

    Args:
        shards: the dataset's shards (each is opened once, to read its index and headers).
        field: the ``.npy`` field holding each sample's document.
        url: the dataset's URL, for messages.

    Raises:
        NotMapped: a shard is not a local map.
        PackedFieldError: a sample lacks the field, or its array is not 1-D integer.
    """

    def __init__(self, shards: ShardSet | MixtureShards, field: str, url: str) -> None:
        n = shards.num_samples
        self.field, self.url = field, url
        self.shard = np.repeat(np.arange(len(shards), dtype=np.int64),
                               np.asarray(shards.counts, dtype=np.int64))
        self.start = np.zeros(n, dtype=np.int64)
        self.length = np.zeros(n, dtype=np.int64)
        self.kind = np.zeros(n, dtype=np.int64)
        self.dtypes: list[np.dtype] = []
        for s in range(len(shards)):
            r = shards.reader(s, index=False)  # (the index is read where the lengths fall short)
            if r.buffer is None and len(r):
                raise NotMapped(r.url)
            lo = int(shards.first[s])
            if not self._from_lengths(r, lo, int(shards.counts[s])):
                self._scan(r, lo)
        self.itemsize = np.array([d.itemsize for d in self.dtypes] or [1], dtype=np.int64)

    def _dtype(self, dt: np.dtype) -> int:
        if dt not in self.dtypes:
            self.dtypes.append(dt)
        return self.dtypes.index(dt)

    def _from_lengths(self, r: ShardReader, lo: int, count: int) -> bool:
        """A token shard of ``feedpipe shard --tokenizer``: its documents' places from its
        lengths file (:func:`~feedpipe.stream._token_lengths.layout`), no header read; whether
        it was one."""
        got = layout(r.url, r.buffer, r.size, count, self.field)
        if got is None:
            return False
        starts, lengths, dt = got
        self.start[lo:lo + count] = starts
        self.length[lo:lo + count] = lengths
        self.kind[lo:lo + count] = self._dtype(dt)
        return True

    def _scan(self, r: ShardReader, lo: int) -> None:
        idx = r.index
        count = len(idx)
        if not count:
            return
        starts = np.asarray(idx.starts, dtype=np.int64)
        member = np.flatnonzero(np.asarray(idx.exts, dtype=object) == self.field)
        owner = np.searchsorted(starts, member, side="right") - 1
        if len(member) != count or (owner != np.arange(count)).any():
            have = set(owner.tolist())
            i = next(i for i in range(count) if i not in have)
            a, b = idx.starts[i], idx.starts[i + 1]
            raise PackedFieldError(
                f"sample {idx.keys[i]!r} of shard {r.url} has no field {self.field!r} (it has "
                f"{sorted(idx.exts[a:b])}): pass Packed(..., field=) the field holding the token "
                "ids")
        offs = np.asarray(idx.offsets, dtype=np.int64)[member]
        sizes = np.asarray(idx.sizes, dtype=np.int64)[member]
        buf = np.frombuffer(r.buffer, dtype=np.uint8)  # type: ignore[arg-type]
        head, dt = self._parse(buf, int(offs[0]), int(sizes[0]), r.url, idx.keys[0])
        lengths = np.full(count, -1, dtype=np.int64)
        text = bytes(buf[offs[0]:offs[0] + head])
        cut = text.find(_SHAPE)
        if cut > 0:  # the headers of this dtype and version agree up to the shape's digits
            prefix = np.frombuffer(text[:cut + len(_SHAPE)], dtype=np.uint8)
            p = len(prefix)
            ok = sizes >= head
            at = np.where(ok, offs, 0)
            ok &= (buf[at[:, None] + np.arange(p)] == prefix).all(axis=1)
            n = (sizes - head) // dt.itemsize
            ok &= (sizes - head) % dt.itemsize == 0
            digits = np.maximum(1, np.floor(np.log10(np.maximum(n, 1))).astype(np.int64) + 1)
            end = len(buf) - 1
            w = 18  # digits of a count read at once (value stays within int64)
            window = buf[np.minimum(at[:, None] + p + np.arange(w), end)].astype(np.int64) - 48
            inside = np.arange(w) < digits[:, None]
            ok &= np.where(inside, (window >= 0) & (window <= 9), True).all(axis=1)
            value = np.where(inside, window, 0) @ (10 ** np.arange(w - 1, -1, -1, dtype=np.int64))
            ok &= (digits < w) & (value // 10 ** (w - np.minimum(digits, w)) == n)
            comma = buf[np.minimum(at + p + digits, end)]
            close = buf[np.minimum(at + p + digits + 1, end)]
            ok &= (comma == ord(",")) & (close == ord(")"))
            lengths[ok] = n[ok]
            self.kind[lo:lo + count][ok] = self._dtype(dt)
            self.start[lo:lo + count][ok] = offs[ok] + head
        for i in np.flatnonzero(lengths < 0).tolist():  # headers of their own
            h, d = self._parse(buf, int(offs[i]), int(sizes[i]), r.url, idx.keys[i])
            k = (int(sizes[i]) - h) // d.itemsize
            lengths[i] = k
            self.kind[lo + i] = self._dtype(d)
            self.start[lo + i] = offs[i] + h
        self.length[lo:lo + count] = lengths

    def _parse(self, buf: np.ndarray, off: int, size: int, url: str,
               key: str) -> tuple[int, np.dtype]:
        """One member's header: its length in bytes and the array's dtype; a member that is not
        a 1-D integer array raises :class:`PackedFieldError`."""
        where = f"sample {key!r} of shard {url}: field {self.field!r}"
        raw = bytes(buf[off:off + min(size, _HEAD)])
        try:
            f = io.BytesIO(raw)
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dt = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dt = np.lib.format.read_array_header_2_0(f)
            head = f.tell()
        except (ValueError, SyntaxError, OSError) as e:
            raise PackedFieldError(f"{where} is not a .npy array ({e}); Packed needs a 1-D "
                                   "integer array of token ids per document") from e
        if len(shape) != 1 or not np.issubdtype(dt, np.integer):
            raise PackedFieldError(
                f"{where} is a {dt} array of shape {shape}; Packed needs a 1-D integer array "
                "of token ids per document")
        if head + shape[0] * dt.itemsize != size:
            raise PackedFieldError(
                f"{where}: its header gives {shape[0]} tokens of {dt}, the member holds "
                f"{size - head} bytes after the header; the shard is damaged (`feedpipe "
                "verify DIR`)")
        return head, dt

