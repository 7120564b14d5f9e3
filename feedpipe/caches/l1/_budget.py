"""The node-wide side of an L1 cache directory's byte budget: who is reading, one admission at a
time, and the largest size the directory reached.

Every process that reads through a cache directory shares three files there:

- ``.budget``: 16 bytes, the *ledger*. A process holds ``LOCK_EX`` on it while it admits a
  download (looks at what the directory holds, evicts, reserves the download's full size), so
  admissions never overlap and each sees every reservation made before it. The ledger records
  the largest directory size an admission produced and the most readers seen reading at once.
- ``.reader-<pid>-<n>``: one empty file per process now reading, held ``LOCK_EX`` by it. The
  count of such files whose lock is held is the number of readers; a file whose lock can be
  taken belongs to a dead process and is removed. The kernel drops the locks of a killed
  process, so a crash never leaves a reader counted or the ledger locked.

Nothing here evicts or downloads: :class:`~feedpipe.caches._shards.ShardCache` does, under
:meth:`Budget.admission`, counting what the directory holds with :func:`scan`.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

from ..._helpers.file_lock import EXCLUSIVE, lock, same_file

LEDGER = ".budget"
READER = ".reader-"
_RECORD = struct.Struct("<QQ")  # peak bytes, most readers at once
_budgets: weakref.WeakSet[Budget] = weakref.WeakSet()
_fork_hook = False
_serial = itertools.count()


def _forget_inherited() -> None:
    """In a forked child: the registrations are the parent's; let go of the child's copies of
    their descriptors (the parent's locks stay, and the child registers itself when it reads)."""
    for b in list(_budgets):
        b._let_go_inherited()


def scan(path: str) -> tuple[dict[str, int], int, int]:
    """What a cache directory holds, in apparent bytes: ``({entry key: bytes of its .tar and
    .idx}, bytes of .part files, bytes of every other file)``."""
    entries: dict[str, int] = {}
    parts = other = 0
    try:
        it = os.scandir(path)
    except FileNotFoundError:
        return entries, 0, 0
    with it:
        for e in it:
            name = e.name
            try:
                size = e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # evicted meanwhile
            if name.endswith(".part"):
                parts += size
            elif name.endswith((".tar", ".idx")):
                key = name[:-4]
                entries[key] = entries.get(key, 0) + size
            else:
                other += size
    return entries, parts, other


class Budget:
    """The shared accounting of one cache directory (see the module docstring).

    Args:
        path: the cache directory (must exist before :meth:`admission` or :meth:`register`).
    """

    def __init__(self, path: str) -> None:
        global _fork_hook
        self.path = path
        self._fd: int | None = None  # this process's registration
        self._mine: str | None = None
        self._guard = threading.Lock()
        _budgets.add(self)
        if not _fork_hook:
            _fork_hook = True
            os.register_at_fork(after_in_child=_forget_inherited)

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    # -- readers -------------------------------------------------------------------------------
    def register(self) -> None:
        """Count this process among the readers (until :meth:`unregister` or its exit)."""
        with self._guard:
            if self._fd is not None:
                return
            mine = os.path.join(self.path, f"{READER}{os.getpid()}-{next(_serial)}")
            self._fd = lock(mine, EXCLUSIVE)
            self._mine = mine

    def unregister(self) -> None:
        """This process no longer reads: it stops counting."""
        with self._guard:
            fd, mine, self._fd, self._mine = self._fd, self._mine, None, None
            if fd is None or mine is None:
                return
            try:
                os.unlink(mine)  # before the close: a counter never sees it unlocked
            except FileNotFoundError:
                pass
            os.close(fd)

    def _let_go_inherited(self) -> None:
        fd, self._fd, self._mine = self._fd, None, None
        if fd is not None:
            os.close(fd)

    @property
    def registered(self) -> bool:
        return self._fd is not None

    def readers(self) -> int:
        """Processes reading now (this one included when registered); removes dead ones' files."""
        try:
            names = [n for n in os.listdir(self.path) if n.startswith(READER)]
        except FileNotFoundError:
            return 0
        n = 0
        for name in names:
            p = os.path.join(self.path, name)
            if p == self._mine:
                n += 1
                continue
            try:
                fd = os.open(p, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                n += 1  # held: its process is alive and reading
            else:
                if same_file(fd, p):  # nobody holds it: its process is gone
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
            finally:
                os.close(fd)
        return n

    # -- admissions ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def admission(self, opener: Callable[..., Any] = os.open) -> Iterator[Ledger]:
        """Hold the ledger's lock: no other admission runs on this directory meanwhile.

        Args:
            opener: opens the ledger file (the cache's, which names a full disk).
        """
        fd = cast(int, lock(os.path.join(self.path, LEDGER), EXCLUSIVE, opener=opener))
        try:
            if os.fstat(fd).st_size != _RECORD.size:  # new, or torn by a full disk
                with contextlib.suppress(OSError):  # the record is a courtesy
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, _RECORD.pack(0, 0), 0)
            yield Ledger(fd)
        finally:
            os.close(fd)

    def discard(self) -> bool:
        """Remove the ledger when no process reads through the directory (``feedpipe cache
        clear``); True when removed."""
        path = os.path.join(self.path, LEDGER)
        if not os.path.exists(path):
            return True
        with self.admission():
            if self.readers():
                return False
            os.unlink(path)  # under its lock: a waiting locker re-checks the inode
        return True

    def peak(self) -> tuple[int, int]:
        """``(largest directory size an admission produced, most readers at once)``."""
        try:
            with open(os.path.join(self.path, LEDGER), "rb") as f:
                raw = f.read(_RECORD.size)
        except FileNotFoundError:
            return 0, 0
        return _RECORD.unpack(raw) if len(raw) == _RECORD.size else (0, 0)


class Ledger:
    """The ledger while its lock is held."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def note(self, total: int, readers: int) -> None:
        """Record a directory size an admission produced, and the readers then."""
        raw = os.pread(self._fd, _RECORD.size, 0)
        peak, most = _RECORD.unpack(raw) if len(raw) == _RECORD.size else (0, 0)
        if total > peak or readers > most:
            with contextlib.suppress(OSError):  # a courtesy: never fail a read over it
                os.pwrite(self._fd, _RECORD.pack(max(peak, total), max(most, readers)), 0)
