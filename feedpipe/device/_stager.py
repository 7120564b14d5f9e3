"""The pinned staging ring and the side stream of a :class:`~feedpipe.DeviceLoader` on CUDA
(steps 2 and 3 of the hand-off in :mod:`feedpipe.device._loader`)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ._placement import map_tensors


class PinnedStager:
    """The pinned ring and the side stream (CUDA only). ``__call__`` runs in the producer thread.

    Args:
        device: the CUDA device batches are copied to.
        depth: slots in the ring: one page-locked buffer per tensor position in a batch, each.
    """

    def __init__(self, device: torch.device, depth: int) -> None:
        self.device = device
        self.depth = depth
        self.stream = torch.cuda.Stream(device)
        self.slots: list[dict[int, torch.Tensor]] = [{} for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.held: list[list[torch.Tensor]] = [[] for _ in range(depth)]  # pinned sources in flight
        self.n = 0
        self.pinned_allocs = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for slot in self.slots for b in slot.values())

    def _staged(self, bufs: dict[int, torch.Tensor], i: int, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        buf = bufs.get(i)
        if buf is None or buf.numel() < nbytes:
            # A smaller tensor (the last batch of an epoch) reuses the buffer; a larger one
            # replaces it (the slot's last copy has finished: __call__ waited for its event).
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            bufs[i] = buf
            self.pinned_allocs += 1
        view = buf[:nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    def __call__(self, batch: Any) -> tuple[Any, torch.cuda.Event, list[torch.Tensor]]:
        """``batch`` copied to the device on the side stream: the device batch, the event
        recorded after its last copy, and the device tensors made (for ``record_stream``)."""
        s = self.n % self.depth
        self.n += 1
        last = self.events[s]
        if last is not None:
            # The copy that last read slot s has finished (almost always long ago): a host wait,
            # but in the producer thread, so the training loop never sees it.
            last.synchronize()
        bufs = self.slots[s]
        fresh: list[torch.Tensor] = []
        held: list[torch.Tensor] = []
        pos = itertools.count()

        def move(t: torch.Tensor) -> torch.Tensor:
            i = next(pos)
            if t.device == self.device:
                return t
            if t.device.type != "cpu" or t.is_pinned():
                src = t
                held.append(t)  # copied from asynchronously: referenced until the copy is done
            else:
                src = self._staged(bufs, i, t)  # a CPU copy: the source is free right after
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)  # on the side stream
            out.copy_(src, non_blocking=True)
            fresh.append(out)
            return out

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = map_tensors(move, batch)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[s] = event
        self.held[s] = held  # the previous holders of slot s are released: their copy is done
        return out, event, fresh

    def release(self) -> None:
        """Wait for the copies in flight, then drop the buffers and held sources (not in a loop:
        at close)."""
        for e in self.events:
            if e is not None:
                e.synchronize()
        self.slots, self.held, self.events = [], [], []
