"""Which way a conversion runs: the method and its executor, chosen in one place."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MethodError


@dataclass(frozen=True)
class Facts:
    """What the choice depends on, all known before anything is listed or read.

    ``requested``: the ``method`` option; ``source``: ``"tree"``, ``"manifest"`` (a JSONL/CSV
    file lists the samples) or ``"table"`` (Parquet); ``local``: source and output both on the
    local filesystem; ``gave_back``: the one-pass staging was tried and gave the tree back (its
    reason), so the choice is made again without it.
    """

    requested: str = "auto"
    source: str = "tree"
    local: bool = True
    resume: bool = False
    shuffle: bool = False
    part: bool = False
    dask: bool = False
    workers: int = 1
    gave_back: str | None = None


@dataclass(frozen=True)
class Choice:
    """``method``: ``"general"``, ``"one-pass"`` or ``"table"`` (recorded in the manifest);
    ``executor``: ``"serial"``, ``"pool"``, ``"dask"`` or ``"staged"``;
    ``why``: why not the other method, for the summary (empty when nothing needs saying)."""

    method: str
    executor: str
    why: str


def choose_method(f: Facts) -> Choice:
    """Choose the method and executor of a conversion (pure).

    =============  ====================================================  ========  ========
    ``method=``    the input and options                                 method    executor
    =============  ====================================================  ========  ========
    auto,          a table (Parquet, a ``datasets.Dataset``) converted   table     staged
    one-pass       afresh into a local OUT: no ``resume``, ``part``,
                   ``shuffle``, ``dask``: its rows staged as they are
                   listed, the shards cut from the staged bytes
    any            any other table (``one-pass``: refused, saying why):  table     serial,
                   its rows listed, then read again to write them as               pool or
                   a tree's files are                                              dask
    auto, general  ``dask=`` (``one-pass``: refused)                     general   dask
    auto           a local folder tree converted afresh: no ``resume``,  one-pass  staged
                   ``part``, ``shuffle``, ``manifest`` (if the staging
                   gives the tree back, chosen again without it)
    one-pass       the same, else refused saying why (also when the      one-pass  staged
                   staging gives the tree back)
    auto, general  anything else, one worker                             general   serial
    auto, general  anything else, several workers                        general   pool
    =============  ====================================================  ========  ========

    The one-pass staging gives back a tree it cannot convert byte for byte as the general
    method would (see :mod:`~feedpipe.convert._onepass`): files at the root, fewer top-level
    directories than workers, links, bad inputs. Both methods write the same shards and indexes.
    The manifest records which one ran.

    Raises:
        MethodError: a forced method that cannot serve the input, saying why.

    Example:
        >>> choose_method(Facts(workers=2))
        Choice(method='one-pass', executor='staged', why='')
        >>> choose_method(Facts(resume=True, workers=2)).executor
        'pool'
    """
    if f.source == "table":
        return _table_choice(f)
    return _tree_choice(f)


_NO_DASK = ("--method one-pass cannot run on a Dask cluster (--dask): the cluster writes with "
            "the general method; use --method auto")


def _table_choice(f: Facts) -> Choice:
    """:func:`choose_method` for a table (Parquet, a ``datasets.Dataset``)."""
    req = f.requested
    if f.dask:
        if req == "one-pass":
            raise MethodError(_NO_DASK)
        return Choice("table", "dask", "")
    against = [why for why, on in (
        ("--resume (the general method keeps the committed shards)", f.resume),
        ("--part", f.part), ("--shuffle", f.shuffle),
        ("an output that is not a local directory", not f.local)) if on]
    if req != "general" and not against:
        return Choice("table", "staged", "")
    if req == "one-pass":
        raise MethodError(f"--method one-pass cannot serve this table: {'; '.join(against)};"
                          " use --method auto or general")
    return Choice("table", "serial" if f.workers <= 1 else "pool", "")


def _tree_choice(f: Facts) -> Choice:
    """:func:`choose_method` for a tree of files or a list of them (``--manifest``)."""
    req = f.requested
    if f.dask:
        if req == "one-pass":
            raise MethodError(_NO_DASK)
        return Choice("general", "dask", "")
    if req != "general" and f.gave_back is None:
        against = [why for why, on in (
            ("--resume (the general method keeps the committed shards)", f.resume),
            ("--part", f.part), ("--shuffle", f.shuffle),
            ("--manifest (a list of files, not a tree)", f.source == "manifest"),
            ("a source or output that is not a local directory", not f.local)) if on]
        if not against:
            return Choice("one-pass", "staged", "")
        if req == "one-pass":
            raise MethodError(f"--method one-pass cannot serve this run: {'; '.join(against)}; "
                              "use --method auto or general")
    if req == "one-pass":
        raise MethodError(f"--method one-pass cannot convert this tree: {f.gave_back}; use "
                          "--method auto or general")
    why = "" if f.gave_back is None else f"one pass gave the tree back: {f.gave_back}"
    if f.workers <= 1:
        return Choice("general", "serial", why)
    return Choice("general", "pool", why)
