"""The probe's run of the loader a training script gets: a :class:`~feedpipe.FeedLoader` built
as a script builds it (the route chosen by FeedLoader, or each route named with ``--route``),
read for up to ``duration`` seconds, and what it says of itself: ``stats()["time"]`` (seconds per
part), ``stats()["bound"]`` (the part that bounds the pass) and ``stats()["io"]`` (bytes and
requests per tier), with the remote figures scaled to a whole epoch and, given prices, what an
epoch costs.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._helpers.storage import is_local

Decode = Callable[[dict[str, Any]], Any]
LOOP_PARTS = ("fetch", "compute", "sink")  # the batch loop's own parts, start-up apart


def epoch_cost(io: dict[str, Any], price_per_gb: float | None,
               price_per_1k_requests: float | None) -> float | None:
    """What the remote reads of ``io`` cost: bytes at ``price_per_gb`` (per 10^9 bytes) and
    requests at ``price_per_1k_requests``; ``None`` without a price.

    Example:
        >>> epoch_cost({"remote": {"requests": 2000, "bytes": 5 * 10**9}}, 0.09, 0.0004)
        0.4508
    """
    if price_per_gb is None and price_per_1k_requests is None:
        return None
    remote = io["remote"]
    return round(remote["bytes"] / 1e9 * (price_per_gb or 0.0)
                 + remote["requests"] / 1e3 * (price_per_1k_requests or 0.0), 10)


def _scaled(io: dict[str, Any], factor: float) -> dict[str, Any]:
    return {k: (_scaled(v, factor) if isinstance(v, dict) else round(v * factor))
            for k, v in io.items()}


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        keys = batch.get("__key__")
        return len(keys) if keys is not None else len(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)) and batch and hasattr(batch[0], "shape"):
        return int(batch[0].shape[0])
    return len(batch)


def run_loader(src: str, route: str | None, *, decode: Decode | None,
               collate: Callable[[list[Any]], Any], batch_size: int, workers: int,
               seconds: float, samples: int, price_per_gb: float | None = None,
               price_per_1k_requests: float | None = None) -> dict[str, Any]:
    """One pass (at most ``seconds`` long) of ``FeedLoader(FeedDataset(src, transform=decode),
    batch_size=..., num_workers=workers, route=route)``: ``route=None`` lets the loader choose,
    as a script's loader does. A named route runs with ``workers`` worker processes (a
    ``workers`` route) or transform threads (a ``threads`` route), else in this process.
    ``samples``: the dataset's sample count, to scale the io figures to an epoch.

    Returns a dict: ``asked`` (the route asked for, ``"auto"``), ``route``, ``parts``,
    ``samples`` read, ``workers`` (worker processes it ran), ``seconds``, ``samples_per_s``,
    ``epoch_fraction``, ``time``, ``bound``, ``loop_bound`` (the largest of fetch, compute and
    sink: what bounds once the workers have started), ``io`` (this pass), ``io_per_epoch`` and
    ``cost_per_epoch``; or ``error`` when the route
    cannot serve this dataset.
    """
    from ..stream._dataset import FeedDataset
    from ..stream._loader import FeedLoader
    from ..stream._routes import ROUTES

    asked = route or "auto"
    kw: dict[str, Any] = {"num_workers": workers}
    if route is not None:
        executor = ROUTES[route].executor if route in ROUTES else "inline"
        kw = ({"num_workers": workers} if executor == "workers" else
              {"transform_threads": max(1, workers)} if executor == "threads" else {})
    n = 0
    t0 = time.perf_counter()
    # a remote dataset is read through an L1 directory of its own, empty: each run's epoch is
    # cold, as a script's first one is (the process's read-ahead directory, which a script
    # without cache_dir gets, is warm from the probe's earlier stages)
    cold = None if is_local(src) else tempfile.mkdtemp(prefix="feedpipe-probe-l1-")
    try:
        ds = (FeedDataset(src, transform=decode, rank=0, world_size=1) if cold is None else
              FeedDataset(src, transform=decode, rank=0, world_size=1, cache_dir=cold))
        loader = FeedLoader(ds, batch_size=batch_size, collate_fn=collate, route=asked, **kw)
        try:
            deadline = t0 + seconds
            for batch in loader:
                n += _batch_len(batch)
                if time.perf_counter() >= deadline:
                    break
            s = loader.stats()
        finally:
            del loader
            gc.collect()
    except Exception as e:  # noqa: BLE001 - reported per route; the others still run
        return {"asked": asked, "error": f"{type(e).__name__}: {e}"}
    finally:
        if cold is not None:
            shutil.rmtree(cold, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    fraction = n / samples if samples else 0.0
    per_epoch = _scaled(s["io"], 1 / fraction) if fraction > 0 else None
    t = s["time"]
    return {"asked": asked, "route": s["route"], "parts": s["parts"], "samples": n,
            "workers": kw.get("num_workers", 0),
            "seconds": round(elapsed, 6), "samples_per_s": n / elapsed if elapsed > 0 else None,
            "epoch_fraction": round(fraction, 6), "time": t, "bound": s["bound"],
            "loop_bound": max(LOOP_PARTS, key=lambda k: t.get(k, 0.0)),
            "io": s["io"], "io_per_epoch": per_epoch,
            "cost_per_epoch": (epoch_cost(per_epoch, price_per_gb, price_per_1k_requests)
                               if per_epoch is not None else None)}


def parse_routes(value: str | Sequence[str] | None) -> list[str | None]:
    """``--route NAME[,NAME]``: the routes to run (``None``: the loader's own choice). An
    unknown name is refused with the list of routes.

    Example:
        >>> parse_routes("samples,refs"), parse_routes(None)
        (['samples', 'refs'], [None])
    """
    from ..stream._routes import ROUTES

    if value is None:
        return [None]
    names = value.split(",") if isinstance(value, str) else list(value)
    out: list[str | None] = []
    for name in (x.strip() for x in names):
        if name in ("", "auto"):
            out.append(None)
        elif name not in ROUTES:
            raise ValueError(f"--route {name}: no such route; the routes are "
                             f"{', '.join(ROUTES)} (or auto: the loader's own choice)")
        else:
            out.append(name)
    return out


def script_loader(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run of the loader a script gets (its own route choice), else the first that ran."""
    ok = [r for r in runs if "error" not in r]
    return next((r for r in ok if r["asked"] == "auto"), ok[0] if ok else None)


def fewer_workers(asked: int | None, ran: int, cpus: int) -> str | None:
    """Why the accounts' loader ran fewer worker processes than ``--workers`` asked for."""
    if asked is None or asked <= ran:
        return None
    return (f"ran num_workers={ran}, not the {asked} asked for (--workers): this machine has "
            f"{cpus} usable CPU(s), and worker processes beyond the cores only take turns on "
            f"them; the worker scaling above measures num_workers={asked} itself where it "
            "ran (at most 4 per core)")


def slower_than_best(run: dict[str, Any], scaling: Sequence[dict[str, Any]]) -> str | None:
    """Why ``run`` (one pass of the loader a script gets) delivered less than half the best
    rate of the worker scaling runs, where it did; ``None`` otherwise.

    Example:
        >>> run = {"samples_per_s": 10.0, "workers": 2, "seconds": 2.0, "route": "rows-workers",
        ...        "time": {"startup": 3.0, "fetch": 0.1, "compute": 0.4, "sink": 0.1}}
        >>> note = slower_than_best(run, [{"workers": 2, "samples_per_s": 300.0}])
        >>> "start-up took 3 s of this pass" in note
        True
    """
    rate = run.get("samples_per_s")
    rated = [r for r in scaling if r.get("samples_per_s")]
    if not rate or not rated:
        return None
    best = max(rated, key=lambda r: r["samples_per_s"])
    if rate * 2 > best["samples_per_s"]:
        return None
    t = run["time"]
    why = []
    loop = sum(t.get(k, 0.0) for k in LOOP_PARTS)
    if t.get("startup", 0.0) >= loop:
        why.append(f"start-up took {t['startup']:.3g} s of this pass (added up over its "
                   f"{run['workers']} worker process(es)) against {loop:.3g} s in its loop's "
                   "parts: a short pass is mostly start-up")
    if run["workers"] != best["workers"]:
        why.append(f"it ran num_workers={run['workers']}, the fastest scaling run "
                   f"num_workers={best['workers']}")
    why.append("each scaling run starts its clock at its first batch and keeps its workers "
               "across epochs (persistent_workers=True), while this is one pass from its start, "
               "as a script's first epoch")
    return (f"{rate:,.1f} samples/s against {best['samples_per_s']:,.0f} at best "
            f"(num_workers={best['workers']}): " + "; ".join(why))
