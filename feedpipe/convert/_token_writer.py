"""Writing token shards: a unit of text documents tokenised into tar members of ``.npy``
token arrays, the member format :class:`~feedpipe.Packed` reads straight out of a shard.

:class:`TokenSource` is the conversion's source: the executors hand it each part (a list of
units, :mod:`~feedpipe.convert._text_inputs`) through its :meth:`TokenSource.write_part`, as they
hand a small-file source's samples to :func:`~feedpipe.convert._writer.write_part`. Each
document becomes one sample ``<unit>-<record>`` with one member ``tokens.npy``: a ``.npy`` array
(format 1.0, the header ``np.save`` writes, 128 bytes for any length below 10**21) of the
document's ids in the dataset's dtype, the end-of-document id appended where one is given. A
document is tokenised exactly as ``tokenizer.encode(text).ids`` (in batches), so the shards hold
the same ids as tokenising the documents one by one.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from itertools import chain
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..format._sidecar_list import sidecar_name
from ..format._tar import BLOCK, member_header
from ._output_dir import unlink_quiet
from ._sources import SampleSpec, Source
from ._text_inputs import Bad, read_unit
from ._writer import PartResult, hidden, output_error, removed_on_error

if TYPE_CHECKING:  # a writer of other samples (ShardWriter) loads no tokenizer code, nor numpy
    import numpy as np

    from ..transforms._tokenizer import TokenizerRef

FIELD = "tokens.npy"
NPY_HEADER = 128  # bytes of the .npy header of a 1-D array (np.save's, growth padding included)
BATCH_DOCS = 1024  # documents tokenised in one call
_WRITE_BELOW = 8 << 20  # bytes gathered before one write
_ZEROS = bytes(BLOCK)
_HEADERS: dict[tuple[str, int], tuple[bytes, bytes]] = {}


def lengths_name(shard_name: str) -> str:
    """The lengths file of a shard: ``data-000000.tar`` -> ``data-000000.lengths.npy``."""
    return sidecar_name(shard_name, ".lengths.npy")


def save_lengths(out: str, name: str, lengths: np.ndarray | list[int]) -> None:
    """Write the lengths file of shard ``name`` of ``out`` (int64), atomically: a hidden temp
    file, synced, renamed."""
    import numpy as np

    path = os.path.join(out, lengths_name(name))
    tmp = hidden(out, name, f".lengths.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(lengths, dtype=np.int64))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        unlink_quiet(tmp)
        raise output_error(e, path) from e


def npy_header(descr: str, n: int) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a 1-D array of ``n`` items of ``descr``.

    Example:
        >>> import io, numpy as np
        >>> b = io.BytesIO(); np.save(b, np.zeros(12345, "<u2"))
        >>> npy_header("<u2", 12345) == b.getvalue()[:128]
        True
    """
    digits = str(n)
    parts = _HEADERS.get((descr, len(digits)))
    if parts is None:
        import numpy as np

        b = io.BytesIO()
        probe = 10 ** (len(digits) - 1)
        np.lib.format.write_array_header_1_0(
            b, {"descr": descr, "fortran_order": False, "shape": (probe,)})
        h = b.getvalue()
        cut = h.index(b"'shape': (") + len(b"'shape': (")
        parts = _HEADERS[descr, len(digits)] = (h[:cut], h[cut + len(digits):])
    head = parts[0] + digits.encode() + parts[1]
    if len(head) != NPY_HEADER:  # (only a length of 21 digits or more)
        raise ValueError(f"a document of {n} tokens is too long for a shard member")
    return head


class TokenSource(Source):
    """The text corpus at ``root`` as a conversion's source of token documents.

    Args:
        root: the directory the units' files are relative to.
        tokenizer: what tokenises (:class:`~feedpipe.transforms._tokenizer.TokenizerRef`).
        text_field: the JSON field or table column holding each document's text.
        eos_id: appended to every document (``None``: nothing appended).
    """

    def __init__(self, root: str, tokenizer: TokenizerRef, text_field: str = "text",
                 eos_id: int | None = None) -> None:
        super().__init__(root)
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.eos_id = eos_id
        self.dtype = tokenizer.dtype
        if eos_id is not None and not 0 <= eos_id < tokenizer.vocab_size:
            raise ValueError(f"eos_id {eos_id} is not an id of the vocabulary (0.."
                             f"{tokenizer.vocab_size - 1})")

    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "tokenizer": self.tokenizer,
                "text_field": self.text_field, "eos_id": self.eos_id, "dtype": self.dtype}

    def write_part(self, units: list[SampleSpec], path: str, on_error: str) -> PartResult:
        """Tokenise the documents of ``units`` into the tar members of ``path``. A bad record
        raises :class:`InputError` naming it (``on_error="raise"``) or is listed in the result's
        ``skipped`` (``"skip"``). The result's ``files`` counts the tokens written (the progress
        bar's unit)."""
        result = PartResult()
        with removed_on_error(path), open(path, "wb") as out:
            w = _PartWriter(out, result, self.dtype, self.eos_id)
            for unit in units:
                keys: list[str] = []
                texts: list[str] = []
                for j, (_where, text) in enumerate(self.documents(unit)):
                    if isinstance(text, Bad):
                        if on_error == "raise":
                            raise InputError(
                                f"{text.where}: bad record ({text.kind}): {text.reason}; fix "
                                "it, or use --on-error skip to leave bad records out (each is "
                                "named in the manifest)")
                        result.skipped.append((text.where, f"bad record ({text.kind}): "
                                                           f"{text.reason}"))
                        continue
                    keys.append(f"{unit.key}-{j:07d}")
                    texts.append(text)
                    if len(texts) >= BATCH_DOCS:
                        w.add(keys, self._ids(texts, unit))
                        keys, texts = [], []
                if texts:
                    w.add(keys, self._ids(texts, unit))
            w.flush()
        return result

    def documents(self, unit: SampleSpec) -> Iterator[tuple[str, str | Bad]]:
        """The documents of ``unit``, in order: ``(where, text or Bad)``."""
        return read_unit(self.root, unit, self.text_field)

    def _ids(self, texts: list[str], unit: SampleSpec) -> list[np.ndarray]:
        """Each text's ids in the dataset's dtype, the end-of-document id appended."""
        import numpy as np

        ids = self.tokenizer.encode(texts)
        if len(ids) != len(texts):
            raise ValueError(f"tokenizer {self.tokenizer.name} gave {len(ids)} results for "
                             f"{len(texts)} texts")
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        if len(flat) and (flat.min() < 0 or flat.max() >= self.tokenizer.vocab_size):
            bad = int(flat.max()) if flat.max() >= self.tokenizer.vocab_size else int(flat.min())
            raise ValueError(f"tokenizer {self.tokenizer.name} gave the id {bad}, outside its "
                             f"vocabulary of {self.tokenizer.vocab_size} (unit {unit.key}, "
                             f"{unit.describe()}); give the right vocab_size")
        if self.eos_id is not None:
            lengths += 1
            ends = np.cumsum(lengths)
            full = np.empty(int(ends[-1]), dtype=self.dtype)
            mask = np.ones(len(full), dtype=bool)
            mask[ends - 1] = False
            full[mask] = flat
            full[ends - 1] = self.eos_id
        else:
            full = flat.astype(self.dtype)
        cuts = np.cumsum(lengths)[:-1]
        return np.split(full, cuts)


class _PartWriter:
    """Tar members of token documents, gathered into large writes."""

    def __init__(self, out: Any, result: PartResult, dtype: np.dtype,
                 eos_id: int | None) -> None:
        self.out, self.result = out, result
        # the header's descr of the stored dtype: '<u2', '|u1', ... (always little-endian)
        self.descr: str = (dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype).str
        self.pos = 0
        self.pending: list[bytes] = []
        self.pending_bytes = 0

    def add(self, keys: list[str], docs: list[np.ndarray]) -> None:
        members = self.result.members
        pending = self.pending
        descr = self.descr
        pos = self.pos
        tokens = 0
        for key, doc in zip(keys, docs):
            data = doc.astype(doc.dtype.newbyteorder("<"), copy=False).tobytes()
            size = NPY_HEADER + len(data)
            name = f"{key}.{FIELD}"
            head = member_header(name, size)
            members.append((name, pos + len(head), size))
            tail = -size % BLOCK
            pending += (head, npy_header(descr, len(doc)), data, _ZEROS[:tail])
            pos += len(head) + size + tail
            self.result.bytes += size
            tokens += len(doc)
        self.result.files += tokens
        self.pending_bytes += pos - self.pos
        self.pos = pos
        if self.pending_bytes >= _WRITE_BELOW:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.out.write(b"".join(self.pending))
            self.pending.clear()
            self.pending_bytes = 0
