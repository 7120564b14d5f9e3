"""An epoch's document order, computed once by the training process and read by its worker
processes (:class:`SharedOrder`), instead of each of them computing it again each epoch."""

from __future__ import annotations

import os

import numpy as np
import torch

from ._collator import shared_empty

# Orders of more documents are computed by each process for itself: the board would double the
# training process's memory for them (the order it keeps, and the board's copy).
MOST_DOCUMENTS = 1 << 22


class SharedOrder:
    """A board in shared memory holding one epoch's document order, written only by the process
    that made it (the training process: a worker forked from it, or unpickled from it, has
    another pid) and read by the others. Slot 0 holds the epoch written (``-1`` while it is
    written), slot 1 its length, then the order: a reader copies the order and checks the
    header again, so an order read while it was rewritten is never taken (the reader computes
    its own instead). Every process gets the same order for an epoch, so a copy of the board
    (a plain pickle copies it) is right for the epoch it names.

    >>> board = SharedOrder(4)
    >>> board.publish(3, np.array([2, 0, 3, 1]))
    >>> board.read(3).tolist(), board.read(4)
    ([2, 0, 3, 1], None)
    """

    def __init__(self, n: int) -> None:
        self.owner = os.getpid()
        self.board = shared_empty((n + 2,), torch.int64)
        self.board[:2] = -1

    def publish(self, epoch: int, order: np.ndarray) -> None:
        """Write ``order`` as ``epoch``'s (in the process that made the board only)."""
        if os.getpid() != self.owner or len(order) + 2 > len(self.board):
            return
        b = self.board.numpy()
        b[0] = -1  # readers leave it from here until the new order is whole
        b[1] = len(order)
        b[2:2 + len(order)] = order
        b[0] = epoch

    def read(self, epoch: int) -> np.ndarray | None:
        """``epoch``'s order, a copy, where the board holds it whole; else ``None``."""
        b = self.board.numpy()
        if int(b[0]) != epoch:
            return None
        n = int(b[1])
        if not 0 <= n <= len(b) - 2:
            return None
        order = b[2:2 + n].copy()
        return order if int(b[0]) == epoch and int(b[1]) == n else None
