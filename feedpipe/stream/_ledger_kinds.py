"""What the ledger's checker recomputes of an epoch, per kind of source, from what ``ledger.json``
recorded: a dataset's :class:`~feedpipe.plan._order.Plan` (each sample once), a mixture's
:class:`~feedpipe.plan._mixture.MixturePlan` (each sample as many times as the epoch draws it),
and a :class:`~feedpipe.Packed`'s rows (:mod:`feedpipe.plan._packing`), made with the same pure
functions the reader used from the documents' lengths the ledger holds. A Packed ledger's ids
are the epoch's rows, each once; a row is named by its pieces ``(document, start, length)``. A
:class:`~feedpipe.VideoClips` ledger's ids are the epoch's clips (:class:`~feedpipe.plan._clips.
ClipOrder`), each once; a clip is named ``(video, clip)``."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from functools import lru_cache
from typing import Any

import numpy as np

from ..errors import StateError
from ..plan._clips import ClipOrder
from ..plan._mixture import INTERLEAVE, MixtureEpoch, MixturePlan
from ..plan._order import Plan, Split
from ..plan._packing import ConcatenateAndCut, Layout, packing_named
from ..plan._packing_chunks import ChunkedCut, MixtureTokens
from ._ledger import Ordered


def is_mixture(info: dict[str, Any]) -> bool:
    return info.get("kind") == "mixture"


def is_packed(info: dict[str, Any]) -> bool:
    return info.get("kind") == "packed"


def is_clips(info: dict[str, Any]) -> bool:
    return info.get("kind") == "video-clips"


def _clip_counts(info: dict[str, Any]) -> np.ndarray | None:
    """Each video's count of clips a VideoClips ledger of ``clips_per_video="all"`` holds,
    checked against their digest (``None``: the same count for every video)."""
    if "clip_counts" not in info:
        return None
    return _lengths(info, "clip_counts")


def clip_order(info: dict[str, Any], epoch: int) -> ClipOrder:
    """A VideoClips epoch's order of clips, recomputed."""
    counts = _clip_counts(info)
    return ClipOrder(samples(info), 0 if counts is not None else int(info["clips"]),
                     info["seed"], epoch, counts)


def clip_pairs(info: dict[str, Any], ids: np.ndarray) -> list[list[int]]:
    """The ``[video, clip]`` of each clip id of a VideoClips ledger (repeats kept)."""
    videos, clips = clip_order(info, 0).locate(np.asarray(ids, dtype=np.int64))
    return [[int(v), int(c)] for v, c in zip(videos.tolist(), clips.tolist())]


@lru_cache(maxsize=4)
def _mixture_plan(key: str) -> tuple[MixturePlan, np.ndarray]:
    """The mixture's plan made from what ``ledger.json`` recorded (``key``: that, as JSON), and
    each source's first sample number."""
    info = json.loads(key)
    if info.get("interleave", 1) != INTERLEAVE:
        raise StateError(
            f"this ledger's mixture of {info['sources']} was written by a feedpipe whose plan "
            f"interleaves the sources otherwise (interleave {info.get('interleave', 1)}, this "
            f"feedpipe's {INTERLEAVE}): check this ledger with the feedpipe version that wrote "
            "it")
    plan = MixturePlan(info["shards"], info["weights"], info["epoch_size"], info["seed"],
                       info["shuffle"])
    if plan.counts.tolist() != info["draws"]:
        raise StateError(
            f"this feedpipe's mixture plan draws {plan.counts.tolist()} samples of the sources "
            f"{info['sources']} an epoch, the ledger's writer drew {info['draws']}: check this "
            "ledger with the feedpipe version that wrote it")
    sizes = np.array([sum(c) for c in info["shards"]], dtype=np.int64)
    return plan, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def mixture_of(info: dict[str, Any]) -> tuple[MixturePlan, np.ndarray]:
    keys = ("shards", "weights", "epoch_size", "seed", "shuffle", "draws", "sources")
    return _mixture_plan(json.dumps({**{k: info[k] for k in keys},
                                     "interleave": info.get("interleave", 1)}))


# -- a Packed's rows ---------------------------------------------------------------------------

def lengths_record(lengths: np.ndarray) -> dict[str, Any]:
    """What a Packed ledger records of its documents' lengths (by the documents' sample
    numbers): their count, tokens, a digest, and the lengths themselves (compressed)."""
    raw = np.ascontiguousarray(lengths, dtype="<i8").tobytes()
    return {"documents": len(lengths), "tokens": int(np.sum(lengths, dtype=np.int64)),
            "digest": hashlib.blake2b(raw, digest_size=16).hexdigest(),
            "zlib": base64.b64encode(zlib.compress(raw, 6)).decode()}


def _lengths(info: dict[str, Any], key: str = "lengths") -> np.ndarray:
    """The documents' lengths a Packed ledger holds (``key="clip_counts"``: the videos' clip
    counts of a VideoClips'), checked against their digest once per ``info`` read (kept in
    it)."""
    got = info.get("_" + key)
    if got is None:
        rec = info[key]
        raw = zlib.decompress(base64.b64decode(rec["zlib"]))
        if hashlib.blake2b(raw, digest_size=16).hexdigest() != rec["digest"]:
            what = "documents' lengths" if key == "lengths" else "videos' clip counts"
            raise StateError(f"the {what} in ledger.json do not match their digest: "
                             "the ledger is damaged and cannot be checked")
        got = info["_" + key] = np.frombuffer(raw, dtype="<i8").astype(np.int64)
    return got


def check_info(info: dict[str, Any]) -> None:
    """Refuse a ``ledger.json`` whose record cannot be trusted (a Packed's documents' lengths
    that do not match their digest) with :class:`~feedpipe.errors.StateError`, before any
    part is read."""
    if is_packed(info):
        _lengths(info)
    if is_clips(info):
        _clip_counts(info)


@lru_cache(maxsize=8)
def _packed_epoch(key: str, epoch: int) -> tuple[Any, Layout | ChunkedCut]:
    """A Packed epoch's documents in order and its rows (``key``: what ``ledger.json`` holds
    of the packing, as JSON, its lengths named by their digest). A mixture's rows cut from the
    concatenation are planned a window of documents at a time, as its reader planned them
    (:mod:`feedpipe.plan._packing_chunks`): no array the size of its epoch."""
    info = json.loads(key)
    inner = info["inner"]
    try:
        packing = packing_named(info["packing"])
    except KeyError:
        raise StateError(f"the ledger's rows were packed by {info['packing']!r}, a packing "
                         "strategy this feedpipe does not know by name: its rows cannot be "
                         "recomputed") from None
    if is_mixture(inner) and isinstance(packing, ConcatenateAndCut):
        plan, bases = mixture_of(inner)
        chunked = ChunkedCut(MixtureTokens(plan, epoch, _LENGTHS_BY_KEY[key], bases),
                             int(info["seq_len"]))
        return chunked.order, chunked
    order = epoch_plan(inner, epoch).sample_ids(np.arange(positions(inner, epoch),
                                                          dtype=np.int64))
    return order, packing.layout(_LENGTHS_BY_KEY[key][order], int(info["seq_len"]))


_LENGTHS_BY_KEY: dict[str, np.ndarray] = {}


def packed_epoch(info: dict[str, Any], epoch: int) -> tuple[Any, Layout | ChunkedCut]:
    """A Packed epoch's documents in plan order and its rows, recomputed."""
    key = json.dumps({"inner": info["inner"], "packing": info["packing"],
                      "seq_len": info["seq_len"], "lengths": info["lengths"]["digest"]})
    if key not in _LENGTHS_BY_KEY and len(_LENGTHS_BY_KEY) >= 8:
        _LENGTHS_BY_KEY.clear()  # a process checking many ledgers keeps a few
    _LENGTHS_BY_KEY[key] = _lengths(info)
    return _packed_epoch(key, int(epoch))


# the most tokens apart of rows whose pieces are found together (a window of a mixture's
# documents: its memory is per document of the window)
TOKENS_AT_ONCE = 1 << 22


def row_pieces(info: dict[str, Any], epoch: int, rows: np.ndarray) -> list[list[int]]:
    """The pieces ``[document, start, length]`` of ``rows`` (ascending, repeats kept) of a
    Packed ledger's ``epoch``, a document's consecutive pieces in one."""
    order, layout = packed_epoch(info, epoch)
    rows, counts = np.unique(np.asarray(rows, dtype=np.int64), return_counts=True)
    out: list[list[int]] = []
    apart, a = max(1, TOKENS_AT_ONCE // int(info["seq_len"])), 0
    while a < len(rows):  # rows far apart: each run of near ones read from its own window
        b = int(np.searchsorted(rows, rows[a] + apart))
        p = layout.pieces(rows[a:b])
        times = counts[a:b][p.row]  # a row repeated twice: twice
        for d, s, k, t in zip(order[p.doc].tolist(), p.start.tolist(), p.length.tolist(),
                              times.tolist()):
            for _ in range(t):
                last = out[-1] if out else None
                if last is not None and t == 1 and last[0] == d and last[1] + last[2] == s:
                    last[2] += k
                else:
                    out.append([d, s, k])
        a = b
    return out


class _Rows:
    """A Packed epoch's positions: position ``p`` is row ``p``."""

    def __init__(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)


# -- any kind ----------------------------------------------------------------------------------

def epoch_plan(info: dict[str, Any], epoch: int, layout: Any = None) -> Ordered:
    """What each position of ``epoch`` holds: a sample number, or a Packed's row; ``layout``:
    the node layout a part recorded (``None``: the global order)."""
    if is_mixture(info):
        return MixtureEpoch(*mixture_of(info)[:1], epoch, mixture_of(info)[1])
    if is_packed(info):
        return _Rows(epoch)
    if is_clips(info):
        return clip_order(info, epoch)
    return Plan(tuple(info["counts"]), info["seed"], epoch, info["shuffle"], info["window"],
                None if not layout else (int(layout[0]), int(layout[1])))


def positions(info: dict[str, Any], epoch: int) -> int:
    """The positions of an epoch: a mixture's ``epoch_size``, a dataset's samples, a Packed's
    rows."""
    if is_mixture(info):
        return mixture_of(info)[0].epoch_size
    if is_packed(info):
        return int(packed_epoch(info, epoch)[1].num_rows)
    if is_clips(info):
        return clip_order(info, epoch).num_samples
    return int(sum(info["counts"]))


def expected(info: dict[str, Any], epoch: int) -> np.ndarray:
    """How many times ``epoch`` holds each id: once for a dataset's samples, a Packed's rows and
    a VideoClips' clips; for a mixture what its plan draws (a source drawn more than its size
    repeats samples, one drawn less leaves some out)."""
    if is_packed(info) or is_clips(info):
        return np.ones(positions(info, epoch), dtype=np.int64)
    n = int(sum(info["counts"]))
    if not is_mixture(info):
        return np.ones(n, dtype=np.int64)
    ids = epoch_plan(info, epoch).sample_ids(np.arange(positions(info, epoch), dtype=np.int64))
    return np.bincount(ids, minlength=n).astype(np.int64)


def part_split(info: dict[str, Any], h: dict[str, Any]) -> Split:
    """A part's share of its epoch (a Packed's rows past the epoch's are padding, as a
    dataset's repeated positions are)."""
    return Split(positions(info, int(h["epoch"])), h["world_size"], h["rank"], h["start"],
                 info["drop_last"], h["whole_batches"], pad_own=bool(h.get("layout")))


def check_rows(info: dict[str, Any], h: dict[str, Any]) -> None:
    """Refuse a Packed part whose writer made another number of rows of its epoch than this
    feedpipe's packing of the recorded lengths makes (every part records its epoch's positions:
    its rows and a world size of padding rows)."""
    if is_packed(info) and "positions" in h:
        epoch, rows = int(h["epoch"]), int(h["positions"]) - int(h["world_size"])
        if rows != positions(info, epoch):
            raise ValueError(
                f"the packing that wrote it made {rows} rows of epoch {epoch}, this feedpipe's "
                f"makes {positions(info, epoch)}: check this ledger with the feedpipe version "
                "that wrote it")


def check_plan(info: dict[str, Any], h: dict[str, Any]) -> None:
    """Refuse a run whose plan ordered the epoch otherwise than this feedpipe's: the first part
    of a run holds the ids its writer's plan gave at a few positions (a Packed's positions are
    its rows: :func:`check_rows` checks every part's row count instead)."""
    if is_packed(info):
        return
    positions_, ids = (np.asarray(x, dtype=np.int64) for x in h["checked"])
    plan = epoch_plan(info, int(h["epoch"]), h.get("layout"))
    if not np.array_equal(plan.sample_ids(positions_), ids):
        raise ValueError(
            "the plan that wrote it ordered epoch "
            f"{h['epoch']} otherwise than this feedpipe's does (ids {ids.tolist()} at positions "
            f"{positions_.tolist()}): check this ledger with the feedpipe version that wrote it")


def samples(info: dict[str, Any]) -> int:
    """The samples of the dataset (a Packed's: its documents; a VideoClips': its videos)."""
    return int(sum(info["counts"]))
