"""The LMDB environments of the L2 function index: one per directory and process, shared.

py-lmdb refuses to open one environment twice in a process, so every
:class:`~feedpipe.caches.l2._index.FunctionIndex` of a directory uses the same one; a table
counts its users. LMDB serialises writers with a robust cross-process lock and lets any number of
readers run beside them. Another process may grow the map at any moment: a read or an open that
meets ``MDB_MAP_RESIZED`` adopts the new size and tries again. A write that finds the map full
doubles it and tries again.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

_ENVS: dict[str, tuple[int, Any, int]] = {}  # path -> (pid, env, users)


def shared(path: str) -> Any | None:
    """The environment at ``path`` that this process has open already, counting one more user;
    ``None`` when it has none open."""
    held = _ENVS.get(path)
    if held is None or held[0] != os.getpid():
        return None
    _ENVS[path] = (held[0], held[1], held[2] + 1)
    return held[1]


def open_env(path: str, map_size: int) -> Any:
    """Open the environment at ``path`` (a directory that exists). Raises ``lmdb.Error``."""
    import lmdb

    # Opening begins a transaction; if another process grows the map at that moment LMDB
    # answers MDB_MAP_RESIZED. A fresh open reads the new size, so try again a few times.
    def attempt() -> Any:
        return lmdb.open(path, map_size=map_size, subdir=True, max_dbs=0,
                         sync=False, metasync=False, readahead=False, lock=True)

    for _ in range(7):
        try:
            return attempt()
        except lmdb.MapResizedError:
            continue
    return attempt()


def share(path: str, env: Any) -> None:
    """Record a freshly opened environment as this process's (one user), and free the reader
    slots of processes that died."""
    _ENVS[path] = (os.getpid(), env, 1)
    env.reader_check()


def release(path: str, env: Any) -> None:
    """One user less of ``env``; the last one closes it."""
    pid, held, users = _ENVS.get(path, (0, None, 0))
    if held is env:
        if users <= 1:
            del _ENVS[path]
            env.close()
        else:
            _ENVS[path] = (pid, env, users - 1)


def open_here(path: str) -> bool:
    """Whether this process has the environment at ``path`` open (``feedpipe cache clear``
    refuses to remove one in use)."""
    return path in _ENVS


def read(env: Any, key: bytes) -> bytes | None:
    """The bytes stored under ``key``, or ``None``."""
    import lmdb

    for _ in range(3):
        try:
            with env.begin(buffers=False) as txn:
                return txn.get(key)
        except lmdb.MapResizedError:
            env.set_mapsize(0)  # another process grew the map: adopt its size
    return None


def write(env: Any, pending: dict[bytes, bytes], owner: Any = None) -> bool:
    """Commit ``pending`` in one transaction and empty it; False when the environment cannot
    store entries any more (a warning says so; the entries are dropped).

    Args:
        env: the environment.
        pending: key -> record, emptied in every case.
        owner: the index that holds ``pending``. Unused here; the exit finalizer passes it so
            that the index stays referenced until the process exits.
    """
    import lmdb

    if not pending:
        return True
    for _ in range(40):
        try:
            with env.begin(write=True) as txn:
                for k, v in pending.items():
                    txn.put(k, v)
            pending.clear()
            return True
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)
        except lmdb.MapResizedError:
            env.set_mapsize(0)
        except lmdb.Error as e:
            pending.clear()
            warnings.warn(f"{env.path()}: function index cannot store entries any more ({e}); "
                          "values are still computed, but not kept", RuntimeWarning,
                          stacklevel=2)
            return False
    pending.clear()
    return False
