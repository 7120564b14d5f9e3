"""The distributed world: the one place that looks at ``torch.distributed`` and the environment.

Everything else in feedpipe is passed ``rank=``/``world_size=`` explicitly.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..errors import PlanError

# (rank, world size) variables of the launchers people use, most specific first.
_ENV = (
    ("RANK", "WORLD_SIZE"),  # torchrun, torch.distributed.launch
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
)
_LOCAL_ENV = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
)


@dataclass(frozen=True)
class World:
    """Where this process stands among the training ranks.

    Args:
        rank: this process's rank, ``0 .. world_size - 1``.
        world_size: the number of training processes.
        local_rank: this process's rank on its node.
        local_world_size: the training processes on this node.

    Example:
        >>> World(rank=1, world_size=2)
        World(rank=1, world_size=2, local_rank=0, local_world_size=1)
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise PlanError(f"rank {self.rank} is outside a world of {self.world_size} ranks")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        return None
    return int(value)


def detect_world(*, strict: bool = False) -> World:
    """The world from an initialised ``torch.distributed``, else the launcher's variables, else a
    single process.

    Reads ``RANK``/``WORLD_SIZE`` (torchrun), ``SLURM_PROCID``/``SLURM_NTASKS``,
    ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` or ``PMI_RANK``/``PMI_SIZE``, and the
    matching local variables. This is the one place that looks.

    Args:
        strict: refuse (:class:`~feedpipe.errors.PlanError`) a world that says it has several
            ranks (``WORLD_SIZE`` above 1) without saying which one this process is (no
            ``RANK``, ``torch.distributed`` not initialised), as a launcher that initialises
            ``torch.distributed`` later leaves it (Lightning's own): reading as rank 0 of 1
            there would give every rank the whole epoch.

    Example:
        >>> w = detect_world()
        >>> 0 <= w.rank < w.world_size
        True
    """
    local_rank, local_size = 0, 1
    for r_name, s_name in _LOCAL_ENV:
        r = _int_env(r_name)
        if r is not None:
            local_rank, local_size = r, _int_env(s_name) or 1
            break
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), local_rank, max(local_size, 1))
    for r_name, s_name in _ENV:
        r, s = _int_env(r_name), _int_env(s_name)
        if r is not None and s is not None:
            return World(r, s, local_rank, max(local_size, 1))
    size = _int_env("WORLD_SIZE")
    if strict and size is not None and size > 1:
        raise PlanError(
            f"WORLD_SIZE={size} says there are {size} ranks, but neither RANK nor an "
            "initialised torch.distributed says which one this process is; start it with "
            "torchrun (which sets RANK), iterate the loader after torch.distributed is "
            "initialised (Lightning does so by the time it trains), or pass FeedDataset(rank=, "
            "world_size=)")
    return World()


def resolve_world(rank: int | None, world_size: int | None) -> World:
    """Explicit ``rank``/``world_size`` win; missing ones are detected."""
    if rank is not None and world_size is not None:
        return World(rank, world_size)
    if (rank is None) != (world_size is None):
        raise PlanError("give both rank= and world_size=, or neither (to detect them)")
    return detect_world()
