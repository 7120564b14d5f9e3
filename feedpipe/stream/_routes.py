"""Batch routes: the named ways of turning the plan's ids into batches, and the one function that
picks among them. Pure: no I/O, no torch.

Every route is one combination of four parts of the batch loop (:mod:`feedpipe.stream._batch_loop`):

* **fetch**: ``samples`` (each id's sample dict from the shards, or its output from the decoded
  store; for a :class:`~feedpipe.Mixture`, ``mixture``: each sample read through its own
  source, as the mixture's plan draws it), ``refs`` (where each member of a batch lies in the
  shards: a few arrays, no bytes), ``gather`` (a whole batch copied out of a complete decoded
  store) or ``packed`` (rows of token documents cut to a context length,
  :class:`~feedpipe.Packed`: the ids are rows);
* **compute**: ``none`` (raw samples), ``call`` (``transform(sample)``) or ``into`` (the transform
  writes each image into its batch row, ``transform.into(sample, row)``);
* **executor**: ``inline`` (the training process), ``threads`` (a pool of threads in the training
  process, ``FeedLoader(transform_threads=N)``) or ``workers`` (DataLoader worker processes);
* **sink**: ``collate`` (the loader's ``collate_fn``), ``rows`` (rows of a
  :class:`~feedpipe.BatchCollator`'s buffers) or ``resolve`` (the references' bytes copied out of
  this process's maps of the shards) or ``packed`` (the fetch made the batch whole: token
  rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Route:
    """One named combination of the four parts (see the module docstring); a loader's
    :attr:`FeedLoader.route <feedpipe.FeedLoader.route>` says which it runs.

    Attributes:
        name: the route's name, as ``FeedLoader(route=...)`` takes it (the names are listed
            under :ref:`concepts-routes`).
        fetch: ``samples`` (``mixture`` when the dataset is a :class:`~feedpipe.Mixture`),
            ``refs``, ``gather`` or ``packed``.
        compute: ``none``, ``call`` or ``into``.
        executor: ``inline``, ``threads`` or ``workers``.
        sink: ``collate``, ``rows``, ``resolve`` or ``packed``.
        leaves: the asked-for executors (``"workers"``, ``"threads"``) this route may leave
            unused, because it serves better from the training process.
        here: why it does (the sentence logged when it leaves them unused).

    Example:
        >>> print(ROUTES["rows-workers"])
        rows-workers (fetch=samples, compute=into, executor=workers, sink=rows)
    """

    name: str
    fetch: str
    compute: str
    executor: str
    sink: str
    leaves: tuple[str, ...] = ()
    here: str = ""

    def __str__(self) -> str:
        return (f"{self.name} (fetch={self.fetch}, compute={self.compute}, "
                f"executor={self.executor}, sink={self.sink})")

    # -- what running the route takes: read by the loader, its workers and the assembly, so
    # that the parts are compared with names here only
    @property
    def in_workers(self) -> bool:
        """It runs in DataLoader worker processes (``executor=workers``)."""
        return self.executor == "workers"

    @property
    def on_threads(self) -> bool:
        """It runs the transform on threads of this process (``executor=threads``)."""
        return self.executor == "threads"

    @property
    def by_reference(self) -> bool:
        """Its fetch plans where each member of a batch lies (``fetch=refs``)."""
        return self.fetch == "refs"

    @property
    def gathers(self) -> bool:
        """Its fetch copies whole batches out of a complete decoded store (``fetch=gather``)."""
        return self.fetch == "gather"

    @property
    def source_batches(self) -> bool:
        """The source's own fetch makes each batch whole (``fetch=packed``,
        :meth:`Source.batch_fetch <feedpipe.Source.batch_fetch>`)."""
        return self.fetch == "packed"

    @property
    def counts_reads(self) -> bool:
        """The loader counts the shard bytes its fetch reads (not a store's, nor a source's own)."""
        return self.fetch not in ("gather", "packed")

    @property
    def writes_rows(self) -> bool:
        """Its sink writes into a :class:`~feedpipe.BatchCollator`'s rows (``sink=rows``)."""
        return self.sink == "rows"

    @property
    def writes_into(self) -> bool:
        """The transform writes each output into its row (``compute=into``)."""
        return self.compute == "into"

    @property
    def resolves(self) -> bool:
        """The training process copies the referenced bytes (``sink=resolve``)."""
        return self.sink == "resolve"

    @property
    def rows_ring(self) -> bool:
        """Each worker writes its batches into reused buffers of a BatchCollator's rows
        (``rows-workers``)."""
        return self.executor == "workers" and self.sink == "rows"

    @property
    def bytes_ring(self) -> bool:
        """Each worker writes the source's whole batches into reused byte buffers
        (``packed-workers``)."""
        return self.executor == "workers" and self.sink == "packed"


@dataclass(frozen=True)
class Capabilities:
    """What a source offers the routes (:meth:`Source.capabilities
    <feedpipe.Source.capabilities>`): the route choice reads these, never the source's class.

    Args:
        transform: the source has work to share among workers or threads (a transform; for a
            source that makes its batches whole, documents to read whole).
        into: its transform writes into the rows of the loader's BatchCollator
            (``transform.into`` with the collator's shape and dtype).
        local: its shards are local files read without a cache (this process can map them).
        store: its decoded store's state: ``"none"``, ``"partial"`` or ``"complete"``.
        gatherable: a complete store whose records are the collator's image (and an int label).
        shards_fit: every shard fits in its ``max_open_shards`` at once.
        fetch: the name of its fetch of samples, as :attr:`Route.fetch` reports it
            (``"samples"``; a :class:`~feedpipe.Mixture`'s is ``"mixture"``: each sample read
            through its own source).
        decodes_agree: its samples' fields are decoded one way (a mixture's sources may
            differ, ``decode=``).
        makes_batches: its ids are rows whose batches its own fetch makes whole
            (:meth:`Source.batch_fetch <feedpipe.Source.batch_fetch>`: token rows of a
            :class:`~feedpipe.Packed`), not samples.
    """

    transform: bool = False
    into: bool = False
    local: bool = True
    store: str = "none"
    gatherable: bool = False
    shards_fit: bool = True
    fetch: str = "samples"
    decodes_agree: bool = True
    makes_batches: bool = False


@dataclass(frozen=True)
class Config(Capabilities):
    """What the route choice depends on: the source's :class:`Capabilities` and what the
    :class:`~feedpipe.FeedLoader` asks.

    Args:
        num_workers: DataLoader worker processes asked for.
        threads: transform threads asked for (``transform_threads=``).
        collator: the loader's ``collate_fn`` is a :class:`~feedpipe.BatchCollator`.
        default_collate: the loader's ``collate_fn`` is the default one.
    """

    num_workers: int = 0
    threads: int = 0
    collator: bool = False
    default_collate: bool = True

    @classmethod
    def of(cls, source: Capabilities, **loader: Any) -> Config:
        """The configuration of a loader (``loader``: the fields of this class) over a source
        offering ``source``."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(Capabilities)}, **loader)


ROUTES: dict[str, Route] = {r.name: r for r in (
    Route("refs", "refs", "none", "inline", "resolve", ("workers",),
          "every shard is open here and batches are planned from the index"),
    Route("refs-workers", "refs", "none", "workers", "resolve"),
    Route("gather", "gather", "none", "inline", "rows", ("workers", "threads"),
          "every sample is in the complete decoded store, gathered whole"),
    Route("rows", "samples", "into", "inline", "rows"),
    Route("rows-threads", "samples", "into", "threads", "rows"),
    Route("rows-workers", "samples", "into", "workers", "rows"),
    Route("samples", "samples", "call", "inline", "collate", ("workers",),
          "every sample is in the complete decoded store"),
    Route("samples-threads", "samples", "call", "threads", "collate"),
    Route("samples-workers", "samples", "call", "workers", "collate"),
    Route("packed", "packed", "none", "inline", "packed", ("workers",),
          "the rows' tokens are copied straight out of the shards' maps, with no transform "
          "to run: a worker would only add sending each batch to this process"),
    Route("packed-workers", "packed", "none", "workers", "packed"),
)}

# -- the table of parts: what each part asks of the configuration --------------------------
Check = Callable[[Config, Route], "str | None"]


def _workers_asked(c: Config, r: Route) -> str | None:
    if not c.num_workers:
        return "it runs in worker processes, and num_workers is 0 (pass num_workers=N)"
    return None


def _no_workers_on_threads(c: Config, r: Route) -> str | None:
    if c.num_workers:
        return (f"it runs on threads in the training process, not in the "
                f"num_workers={c.num_workers} worker processes (pass num_workers=0)")
    return None


def _workers_left(c: Config, r: Route) -> str | None:
    if c.num_workers and "workers" not in r.leaves:
        return (f"it runs in the training process, not in the num_workers={c.num_workers} "
                "worker processes (pass num_workers=0)")
    return None


def _threads_asked(c: Config, r: Route) -> str | None:
    if not c.threads:
        return "it runs the transform on threads, and transform_threads is 0"
    return None


def _threads_left(c: Config, r: Route) -> str | None:
    if c.threads and "threads" not in r.leaves:
        return (f"transform_threads={c.threads} asks for the threads route "
                "(rows-threads or samples-threads)")
    return None


def _raw(c: Config, r: Route) -> str | None:
    """Why raw batches by reference cannot serve ``c``, or ``None``."""
    if c.transform:
        return "it delivers raw samples, and the dataset has a transform"
    if not c.default_collate:
        return "it builds the default collation's batches, and a collate_fn was given"
    if not c.local:
        return "it maps the shards in this process, and they are remote or cached"
    if c.store != "none":
        return "it reads the shards, and the dataset has a decoded store"
    return None


def _one_decode(c: Config, r: Route) -> str | None:
    if not c.decodes_agree:
        return ("it decodes a batch's fields one way, and the mixture's sources decode theirs "
                "differently (decode=)")
    return None


def _shards_fit_here(c: Config, r: Route) -> str | None:
    if c.num_workers and not c.shards_fit:
        return ("it keeps every shard open here, and there are more shards than "
                "max_open_shards (use refs-workers)")
    return None


def _store_complete(c: Config, r: Route) -> str | None:
    if c.store != "complete":
        return "it reads a complete decoded store, and the store is " + (
            "missing (pass decoded_cache=)" if c.store == "none"
            else "not complete yet (one epoch fills it)")
    return None


def _store_gatherable(c: Config, r: Route) -> str | None:
    if not (c.collator and c.gatherable):
        return ("it copies records into a BatchCollator's rows, and the collate_fn is not "
                "a BatchCollator whose shape and dtype the store's records have")
    return None


def _collator(c: Config, r: Route) -> str | None:
    if not c.collator:
        return "it writes into a BatchCollator's rows, and the collate_fn is not one"
    return None


def _rows_not_stored(c: Config, r: Route) -> str | None:
    if r.fetch == "samples" and c.store != "none":
        return "it writes outputs into rows directly, and the decoded store keeps them"
    return None


def _writes_into(c: Config, r: Route) -> str | None:
    if r.compute == "into" and r.executor != "threads" and not c.into:
        return ("the transform does not write into the collator's rows (it needs into() "
                "and the collator's out_shape and out_dtype)")
    return None


def _rows_transform(c: Config, r: Route) -> str | None:
    if r.fetch == "samples" and not c.transform:
        return "it writes the transform's outputs, and the dataset has no transform"
    return None


def _threads_transform(c: Config, r: Route) -> str | None:
    if not c.transform:
        return "it runs the transform on threads, and the dataset has no transform"
    return None


def _packed_dataset(c: Config, r: Route) -> str | None:
    if not c.makes_batches:
        return ("it has the source make each batch whole (token rows of a Packed), and the "
                "source makes samples")
    if not c.default_collate:
        return "the source makes its batches whole, and a collate_fn was given (leave it out)"
    return None


def _not_packed(c: Config, r: Route) -> str | None:
    if c.makes_batches:
        return ("it reads samples, and the source makes its batches whole (token rows of a "
                "Packed: they take a packed route)")
    return None


#: What each part asks of the configuration, in the order :func:`refusal` checks it:
#: ``(part, values, check)``; ``part`` is a field of :class:`Route` (``name`` for a route of its
#: own), ``check(config, route)`` says why the configuration does not serve it, or ``None``.
#: :func:`choose` reads this table too, through :func:`refusal`: a condition is written once.
REQUIREMENTS: tuple[tuple[str, tuple[str, ...], Check], ...] = (
    ("executor", ("workers",), _workers_asked),
    ("executor", ("threads",), _no_workers_on_threads),
    ("executor", ("inline",), _workers_left),
    ("executor", ("threads",), _threads_asked),
    ("executor", ("inline", "workers"), _threads_left),
    ("fetch", ("refs",), _raw),
    ("fetch", ("refs",), _one_decode),
    ("name", ("refs",), _shards_fit_here),
    ("fetch", ("gather",), _store_complete),
    ("fetch", ("gather",), _store_gatherable),
    ("sink", ("rows",), _collator),
    ("sink", ("rows",), _rows_not_stored),
    ("sink", ("rows",), _writes_into),
    ("sink", ("rows",), _rows_transform),
    ("executor", ("threads",), _threads_transform),
    ("fetch", ("packed",), _packed_dataset),
    ("fetch", ("samples", "refs", "gather"), _not_packed),
)


def refusal(route: Route, config: Config) -> str | None:
    """Why ``route`` cannot serve ``config`` (a sentence), or ``None`` when it can: the first
    condition of :data:`REQUIREMENTS` that one of its parts puts and ``config`` does not meet."""
    for part, values, check in REQUIREMENTS:
        if getattr(route, part) in values:
            why = check(config, route)
            if why is not None:
                return why
    return None


def _always(c: Config) -> bool:
    return True


def _asked_threads(c: Config) -> bool:
    return bool(c.threads)


def _store_is_complete(c: Config) -> bool:
    return c.store == "complete"


#: The ``"auto"`` choice, in order of preference: ``(when, candidates, binding)``. The first row
#: whose ``when`` holds and one of whose candidates can serve (:func:`refusal`) gives the route;
#: a ``binding`` row (the user asked for it) that none can serve is refused, not passed over.
def _is_packed(c: Config) -> bool:
    return c.makes_batches


def _packed_reads_documents(c: Config) -> bool:
    return c.makes_batches and (c.transform or not c.local)


PREFERENCE: tuple[tuple[Callable[[Config], bool], tuple[str, ...], bool], ...] = (
    (_packed_reads_documents, ("packed-workers", "packed"), True),
    (_is_packed, ("packed", "packed-workers"), True),
    (_always, ("gather",), False),
    (_asked_threads, ("rows-threads", "samples-threads"), True),
    (_always, ("refs", "refs-workers"), False),
    (_store_is_complete, ("samples",), False),
    (_always, ("rows-workers", "rows"), False),
    (_always, ("samples-workers", "samples"), True),
)


def choose(config: Config, route: str = "auto") -> tuple[Route, str | None]:
    """The route for ``config``, and a note when the choice deserves one (it runs in the training
    process although ``num_workers > 0``). ``route``: ``"auto"`` or a name of :data:`ROUTES`;
    a named route that cannot serve ``config`` raises ``ValueError`` saying why.

    ``"auto"`` takes the first row of :data:`PREFERENCE` that applies and can serve
    (:func:`refusal`):

    ======================  =================================================  =================
    condition               why                                                route
    ======================  =================================================  =================
    a :class:`~feedpipe.    token rows cut from documents read whole           ``packed-workers``
    Packed` whose           (through the transform, or from remote shards):    or ``packed`` (0
    documents are read      workers share the reading                          workers)
    whole
    a :class:`~feedpipe.    token rows copied straight out of the local        ``packed``
    Packed` of raw          shards' maps: a worker would add only the
    ``.npy`` documents      transfer of each batch
    complete decoded store  one copy per image out of the store, no shard      ``gather``
    of collator-shaped      read, no transform call (workers would add a
    records                 pickle and a pipe per batch)
    ``transform_threads``   the user asked for threads                         ``rows-threads``
                                                                               (collator, no
                                                                               store) else
                                                                               ``samples-threads``
    raw samples, default    a batch is planned from the index as a few array  ``refs`` when the
    collation, local        gathers and copied from this process's maps        shards fit
    uncached shards         (workers would add only start-up and a pipe);     (``max_open_shards``)
                            with more shards than fit, workers plan            or no workers,
                                                                               else
                                                                               ``refs-workers``
    complete decoded store  reading a record costs one copy; a worker would    ``samples``
                            add a pickle, a pipe and an unpickle of it
    transform writes into   no per-sample tensor, no collation copy            ``rows-workers``
    the collator's rows                                                        or ``rows`` (0
                                                                               workers)
    anything else           the DataLoader's way                               ``samples-workers``
                                                                               or ``samples``
    ======================  =================================================  =================

    Example:
        >>> choose(Config(num_workers=2))[0].name
        'refs'
        >>> choose(Config(num_workers=2, transform=True))[0].name
        'samples-workers'
        >>> choose(Config(transform=True), "refs")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: route 'refs' cannot serve this loader: it delivers raw samples, and the ...
    """
    if route != "auto":
        picked = ROUTES.get(route)
        if picked is None:
            raise ValueError(f"unknown route {route!r}; the routes are "
                             f"{', '.join(['auto', *ROUTES])}")
        why = refusal(picked, config)
        if why is not None:
            raise ValueError(f"route {route!r} cannot serve this loader: {why}")
        return _resolved(picked, config), _note(picked, config)
    reasons: list[str] = []
    for when, candidates, binding in PREFERENCE:
        if not when(config):
            continue
        reasons = []
        for name in candidates:
            why = refusal(ROUTES[name], config)
            if why is None:
                return _resolved(ROUTES[name], config), _note(ROUTES[name], config)
            reasons.append(f"{name!r} would, but {why}")
        if binding:  # the arguments contradict each other (threads and workers, ...)
            break
    raise ValueError(f"no route serves this loader: {'; '.join(reasons)}")


def _note(route: Route, config: Config) -> str | None:
    """The sentence to log when ``route`` leaves asked-for workers or threads unused."""
    w, t = config.num_workers, config.threads
    unused = []
    if w and route.executor != "workers":
        unused.append(f"num_workers={w} worker processes")
    if t and route.executor != "threads":
        unused.append(f"transform_threads={t} threads")
    if not unused:
        return None
    return (f"route {route.name!r} runs in the training process and leaves the "
            f"{' and the '.join(unused)} unused: {route.here} (force another with "
            "FeedLoader(route=...))")


def _resolved(route: Route, config: Config) -> Route:
    """``route`` with its fetch and compute parts as this configuration has it."""
    if route.fetch != "samples":
        return route
    if config.fetch != route.fetch:  # the source's own name for its fetch of samples
        route = replace(route, fetch=config.fetch)
    if route.sink == "rows":
        compute = "into" if config.into else "call"
    else:
        compute = "call" if config.transform else "none"
    if compute == route.compute:
        return route
    return replace(route, compute=compute)
