"""``EpochState``: one reader's place in a dataset's epochs.

A :class:`~feedpipe.FeedDataset` describes data; it does not say which epoch is being read, how
far, or in batches of what size. Whoever reads owns that: each :class:`~feedpipe.FeedLoader` has
an ``EpochState`` of its own, handed to its worker processes, and the dataset keeps one for the
plain ``DataLoader`` that reads it directly. Any number of loaders may therefore share a dataset
without changing each other's epoch, position or batches.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.data import get_worker_info

if TYPE_CHECKING:
    from ..plan._order import Plan, Split
    from ._source import Source

_EPOCH, _START, _BATCH, _WHOLE, _LAYOUT, _PER_NODE = 0, 1, 2, 3, 4, 5
_WORLD = -1  # the layout slot's "the dataset's world now" (0: the global order)


class EpochState:
    """The epoch being read, the global position in its plan to start from, the batch size
    batches are dealt in and whether each rank's short last batch is left out.

    The four values live in shared memory: persistent DataLoader workers, started once, see a
    ``set_epoch`` or a resume made in the training process after they started.

    Args:
        batch_size: samples per batch dealt to a reader.
        whole_batches: leave out each rank's short last batch.

    Example:
        >>> state = EpochState(batch_size=4)
        >>> state.set_epoch(2)
        >>> state.epoch, state.start, state.batch_size, state.whole_batches
        (2, 0, 4, False)
    """

    def __init__(self, batch_size: int = 1, whole_batches: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self._values = torch.zeros(6, dtype=torch.int64).share_memory_()
        self._values[_LAYOUT] = _WORLD
        self._values[_BATCH] = int(batch_size)
        self._values[_WHOLE] = int(bool(whole_batches))
        self._owner = os.getpid()  # the process whose workers share the values

    @property
    def epoch(self) -> int:
        return int(self._values[_EPOCH])

    @property
    def start(self) -> int:
        """The global position in the epoch's plan the next pass starts from."""
        return int(self._values[_START])

    @property
    def batch_size(self) -> int:
        return int(self._values[_BATCH])

    @property
    def whole_batches(self) -> bool:
        return bool(self._values[_WHOLE])

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` from its beginning."""
        self.resume(epoch, 0)

    def resume(self, epoch: int, start: int) -> None:
        """Read ``epoch`` from global position ``start`` of its plan (laid out for the
        dataset's world until :meth:`keep_layout` says otherwise)."""
        self.own()
        self._values[_EPOCH] = int(epoch)
        self._values[_START] = int(start)
        self._values[_LAYOUT] = _WORLD

    def keep_layout(self, dataset: object, state: dict[str, object]) -> None:
        """Read the resumed epoch with the node layout ``state`` was saved with (the rest of its
        positions are that layout's), where the dataset lays epochs out by node."""
        saved = getattr(dataset, "resume_layout", None)
        layout = saved(state) if saved is not None else _WORLD
        if layout == _WORLD:
            return
        self._values[_LAYOUT] = int(layout[0]) if isinstance(layout, tuple) else 0
        self._values[_PER_NODE] = int(layout[1]) if isinstance(layout, tuple) else 0

    @property
    def layout(self) -> tuple[int, int] | None | int:
        """The resumed epoch's saved node layout (``None``: the global order), or ``-1`` to lay
        the epoch out for the dataset's world."""
        v = int(self._values[_LAYOUT])
        if v == _WORLD:
            return _WORLD
        return None if v == 0 else (v, int(self._values[_PER_NODE]))

    def stamp(self, state: dict[str, object]) -> dict[str, object]:
        """``state`` (a dataset's ``state_at``) naming the resumed epoch's saved layout where
        this reader kept one: a state saved again later in that epoch resumes it the same way."""
        layout = self.layout
        if layout != _WORLD and "layout" in state and state.get("position"):
            state["layout"] = None if not isinstance(layout, tuple) else list(layout)
        return state

    def plan(self, dataset: Any) -> Plan:
        """The plan of the epoch being read."""
        layout = self.layout
        if layout == _WORLD:
            return dataset.plan(self.epoch)
        return dataset.plan(self.epoch, layout=layout)

    def own(self) -> None:
        """Make these values this process's own when the state came from another training
        process (a rank spawned by a launcher, as Lightning's ``ddp_spawn`` sends a loader to
        each rank): a copy shares its sender's memory, and ranks must never move each other's
        epoch. A DataLoader worker keeps sharing its training process's values."""
        if self._owner != os.getpid() and get_worker_info() is None:
            self._values = self._values.clone().share_memory_()
            self._owner = os.getpid()

    def split(self, dataset: Source) -> Split:
        """This rank's share of the rest of the epoch of ``dataset``."""
        layout = self.layout
        if layout == _WORLD:
            return dataset.split_at(self.start, self.whole_batches, epoch=self.epoch)
        # a node layout is saved by a FeedDataset only (what its state recorded)
        return cast(Any, dataset).split_at(self.start, self.whole_batches, epoch=self.epoch,
                                           layout=layout)
