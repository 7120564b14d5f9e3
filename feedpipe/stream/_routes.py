"""Batch routes: the named ways of turning the plan's ids into batches, and the one function that
picks among them. Pure: no I/O, no torch.

Every route is one combination of four parts of the batch loop (:mod:`feedpipe.stream._batch_loop`):

* **fetch**: ``samples`` (each id's sample dict from the shards, or its output from the decoded
  store), ``refs`` (where each member of a batch lies in the shards: a few arrays, no bytes) or
  ``gather`` (a whole batch copied out of a complete decoded store);
* **compute**: ``none`` (raw samples), ``call`` (``transform(sample)``) or ``into`` (the transform
  writes each image into its batch row, ``transform.into(sample, row)``);
* **executor**: ``inline`` (the training process), ``threads`` (a pool of threads in the training
  process, ``FeedLoader(transform_threads=N)``) or ``workers`` (DataLoader worker processes);
* **sink**: ``collate`` (the loader's ``collate_fn``), ``rows`` (rows of a
  :class:`~feedpipe.BatchCollator`'s buffers) or ``resolve`` (the references' bytes copied out of
  this process's maps of the shards).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One named combination of the four parts (see the module docstring).

    Args:
        name: the route's name, as ``FeedLoader(route=...)`` takes it (:data:`ROUTES`).
        fetch: ``samples``, ``refs`` or ``gather``.
        compute: ``none``, ``call`` or ``into``.
        executor: ``inline``, ``threads`` or ``workers``.
        sink: ``collate``, ``rows`` or ``resolve``.

    Example:
        >>> print(ROUTES["rows-workers"])
        rows-workers (fetch=samples, compute=into, executor=workers, sink=rows)
    """

    name: str
    fetch: str
    compute: str
    executor: str
    sink: str

    def __str__(self) -> str:
        return (f"{self.name} (fetch={self.fetch}, compute={self.compute}, "
                f"executor={self.executor}, sink={self.sink})")


@dataclass(frozen=True)
class Config:
    """What the route choice depends on, read off a :class:`~feedpipe.FeedLoader`.

    Args:
        num_workers: DataLoader worker processes asked for.
        threads: transform threads asked for (``transform_threads=``).
        transform: the dataset has a transform.
        into: the transform writes into the rows of the loader's BatchCollator
            (``transform.into`` with the collator's shape and dtype).
        collator: the loader's ``collate_fn`` is a :class:`~feedpipe.BatchCollator`.
        default_collate: the loader's ``collate_fn`` is the default one.
        local: the shards are local files read without a cache (this process can map them).
        store: the decoded store's state: ``"none"``, ``"partial"`` or ``"complete"``.
        gatherable: a complete store whose records are the collator's image (and an int label).
        shards_fit: every shard fits in the dataset's ``max_open_shards`` at once.
    """

    num_workers: int = 0
    threads: int = 0
    transform: bool = False
    into: bool = False
    collator: bool = False
    default_collate: bool = True
    local: bool = True
    store: str = "none"
    gatherable: bool = False
    shards_fit: bool = True


ROUTES: dict[str, Route] = {r.name: r for r in (
    Route("refs", "refs", "none", "inline", "resolve"),
    Route("refs-workers", "refs", "none", "workers", "resolve"),
    Route("gather", "gather", "none", "inline", "rows"),
    Route("rows", "samples", "into", "inline", "rows"),
    Route("rows-threads", "samples", "into", "threads", "rows"),
    Route("rows-workers", "samples", "into", "workers", "rows"),
    Route("samples", "samples", "call", "inline", "collate"),
    Route("samples-threads", "samples", "call", "threads", "collate"),
    Route("samples-workers", "samples", "call", "workers", "collate"),
)}


def choose(config: Config, route: str = "auto") -> tuple[Route, str | None]:
    """The route for ``config``, and a note when the choice deserves one (it runs in the training
    process although ``num_workers > 0``). ``route``: ``"auto"`` or a name of :data:`ROUTES`;
    a named route that cannot serve ``config`` raises ``ValueError`` saying why.

    ``"auto"`` takes the first row that applies:

    ======================  =================================================  =================
    condition               why                                                route
    ======================  =================================================  =================
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
    w = config.num_workers
    raw = _raw_refusal(config) is None
    if config.store == "complete" and config.gatherable and config.collator:
        picked = ROUTES["gather"]
    elif config.threads:
        picked = ROUTES["rows-threads" if config.collator and config.store == "none"
                        else "samples-threads"]
    elif raw:
        picked = ROUTES["refs" if config.shards_fit or not w else "refs-workers"]
    elif config.store == "complete":
        picked = ROUTES["samples"]
    elif config.into and config.store == "none":
        picked = ROUTES["rows-workers" if w else "rows"]
    else:
        picked = ROUTES["samples-workers" if w else "samples"]
    why = refusal(picked, config)
    if why is not None:  # the arguments contradict each other (threads and workers, ...)
        raise ValueError(f"no route serves this loader: {picked.name!r} would, but {why}")
    return _resolved(picked, config), _note(picked, config)


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
    reason = {
        "gather": "every sample is in the complete decoded store, gathered whole",
        "refs": "every shard is open here and batches are planned from the index",
        "samples": "every sample is in the complete decoded store",
    }[route.name]
    return (f"route {route.name!r} runs in the training process and leaves the "
            f"{' and the '.join(unused)} unused: {reason} (force another with "
            "FeedLoader(route=...))")


def _resolved(route: Route, config: Config) -> Route:
    """``route`` with its compute part as this configuration has it."""
    if route.fetch != "samples":
        return route
    if route.sink == "rows":
        compute = "into" if config.into else "call"
    else:
        compute = "call" if config.transform else "none"
    if compute == route.compute:
        return route
    return Route(route.name, route.fetch, compute, route.executor, route.sink)


def _raw_refusal(config: Config) -> str | None:
    """Why raw batches by reference cannot serve ``config``, or ``None``."""
    if config.transform:
        return "it delivers raw samples, and the dataset has a transform"
    if not config.default_collate:
        return "it builds the default collation's batches, and a collate_fn was given"
    if not config.local:
        return "it maps the shards in this process, and they are remote or cached"
    if config.store != "none":
        return "it reads the shards, and the dataset has a decoded store"
    return None


def refusal(route: Route, config: Config) -> str | None:
    """Why ``route`` cannot serve ``config`` (a sentence), or ``None`` when it can."""
    w, name = config.num_workers, route.name
    if route.executor == "workers" and not w:
        return "it runs in worker processes, and num_workers is 0 (pass num_workers=N)"
    if route.executor != "workers" and w and route.executor != "inline":
        return (f"it runs on threads in the training process, not in the num_workers={w} "
                "worker processes (pass num_workers=0)")
    if route.executor == "inline" and w and name not in ("refs", "gather", "samples"):
        return (f"it runs in the training process, not in the num_workers={w} worker "
                "processes (pass num_workers=0)")
    if route.executor == "threads" and not config.threads:
        return "it runs the transform on threads, and transform_threads is 0"
    if route.executor != "threads" and config.threads and name != "gather":
        return (f"transform_threads={config.threads} asks for the threads route "
                "(rows-threads or samples-threads)")
    if route.fetch == "refs":
        why = _raw_refusal(config)
        if why is not None:
            return why
        if name == "refs" and w and not config.shards_fit:
            return ("it keeps every shard open here, and there are more shards than "
                    "max_open_shards (use refs-workers)")
    if route.fetch == "gather":
        if config.store != "complete":
            return "it reads a complete decoded store, and the store is " + (
                "missing (pass decoded_cache=)" if config.store == "none"
                else "not complete yet (one epoch fills it)")
        if not (config.collator and config.gatherable):
            return ("it copies records into a BatchCollator's rows, and the collate_fn is not "
                    "a BatchCollator whose shape and dtype the store's records have")
    if route.sink == "rows":
        if not config.collator:
            return "it writes into a BatchCollator's rows, and the collate_fn is not one"
        if route.fetch == "samples" and config.store != "none":
            return "it writes outputs into rows directly, and the decoded store keeps them"
        if route.compute == "into" and route.executor != "threads" and not config.into:
            return ("the transform does not write into the collator's rows (it needs into() "
                    "and the collator's out_shape and out_dtype)")
        if route.fetch == "samples" and not config.transform:
            return "it writes the transform's outputs, and the dataset has no transform"
    if route.executor == "threads" and not config.transform:
        return "it runs the transform on threads, and the dataset has no transform"
    return None
