"""Who is writing a dataset directory: the writer's lock, and the marks an unfinished write leaves.

A writer (:class:`feedpipe.ShardWriter`, ``feedpipe shard``) holds a lock file in the directory
from its start until its manifest is written: ``.feedpipe-writer.lock`` for a whole dataset,
``.feedpipe-writer-pIIIIIofNNNNN.lock`` for one part of ``--part I/N`` (parts write one
directory together). The file holds the writer's pid, host and tool, and is held with
``flock``. The kernel lets go of it when the writer's process ends however it ends, so a lock
file that nobody holds is the mark of a writer that died (``kill -9``, OOM) or never closed.
A second writer of the same directory (or of the same part) is refused while the first lives,
naming it; a dead writer's lock is taken over.

:func:`write_marks` reads the other marks of an unfinished write too: hidden temp files
(``.NAME.tmp-PID``) and the resume state of ``feedpipe shard``. ``verify``, ``index`` and
``FeedDataset`` use it to say that a directory's write is under way or was interrupted, rather
than take its committed shards for a dataset (the samples after them were never written).
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from .._helpers.processes import pid_alive
from .._redact import logger
from ..errors import InterruptedWriteError, OutputError

log = logger("feedpipe.format")

LOCK_PREFIX = ".feedpipe-writer"
_LOCK = re.compile(r"^\.feedpipe-writer(-p\d{5}of\d{5})?\.lock$")
_TEMP = re.compile(r"^\..+\.tmp-(\d+)$")
_STATE = re.compile(r"^\.feedpipe-shard-state(-p\d{5}of\d{5})?\.json$")
_RECORD = re.compile(r"^\..+\.tar\.record\.json$")  # what a resume of feedpipe shard reuses


def lock_name(tag: str | None = None) -> str:
    """The lock file of a whole dataset's writer, or of the part tagged ``tag``
    (``p00000of00002``)."""
    return f"{LOCK_PREFIX}{'-' + tag if tag else ''}.lock"


def _flock() -> Any:
    try:
        import fcntl
    except ImportError:  # (no flock on this platform: the pid alone says who lives)
        return None
    return fcntl


def _read_record(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        doc = json.loads(raw.decode("utf-8")) if raw else {}
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}



def holder(path: str) -> dict[str, Any] | None:
    """The record (``pid``, ``host``, ``tool``) of the live writer holding the lock file
    ``path``; ``None`` when the file is missing or nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        record = _read_record(fd)
        fcntl = _flock()
        if fcntl is None:
            return record if pid_alive(record.get("pid")) else None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return record
        except OSError:  # (a filesystem without flock: the pid alone says who lives)
            return record if pid_alive(record.get("pid")) else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def describe(record: dict[str, Any]) -> str:
    """``feedpipe shard (pid 123 on host h)`` from a lock record."""
    pid = record.get("pid", "?")
    who = f"{record.get('tool') or 'a writer'} (pid {pid}"
    if record.get("host") and record.get("host") != socket.gethostname():
        who += f" on host {record['host']}"
    elif pid == os.getpid():
        who += ", this process"
    return who + ")"


class WriterLock:
    """The lock of one writer on a directory (see the module docstring); :meth:`release` at
    the end of the write."""

    def __init__(self, out: str, tag: str | None, tool: str) -> None:
        self.path = os.path.join(out, lock_name(tag))
        self.stale: dict[str, Any] | None = None  # the record of a dead writer taken over
        self._fd: int | None = None
        self._take(out, tag, tool)

    def _take(self, out: str, tag: str | None, tool: str) -> None:
        fcntl = _flock()
        for _ in range(8):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                record = _read_record(fd)
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        raise _busy(out, record) from None
                    except OSError:  # (no flock here: fall back to the pid)
                        fcntl = None
                if fcntl is None and pid_alive(record.get("pid")) \
                        and record.get("host", socket.gethostname()) == socket.gethostname():
                    raise _busy(out, record)
                # its last holder may have removed the file between our open and our lock
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.path))
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
            except BaseException:
                if self._fd != fd:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                raise
            self._fd = fd
            break
        else:
            raise OutputError(f"{out}: cannot take the writer lock {self.path}: it keeps being "
                              "replaced by other writers; write into a directory of its own")
        if record.get("pid") is not None:
            self.stale = record
            log.info("%s: the writer lock of %s, which ended without finishing its write, is "
                     "taken over", out, describe(record))
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "tool": tool}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(doc).encode(), 0)
        try:
            self._refuse_other_writers(out, tag)
        except BaseException:
            self.release()
            raise

    def _refuse_other_writers(self, out: str, tag: str | None) -> None:
        """A whole-dataset writer and a part writer never share a directory alive."""
        for name in os.listdir(out):
            if not _LOCK.match(name) or name == os.path.basename(self.path):
                continue
            if tag is not None and name != lock_name():
                continue  # (parts write one directory together)
            record = holder(os.path.join(out, name))
            if record is not None:
                raise _busy(out, record)

    def release(self) -> None:
        """Remove the lock file and let go of it (the write is finished or abandoned)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def _busy(out: str, record: dict[str, Any]) -> OutputError:
    return OutputError(
        f"{out}: another writer is writing this directory now: {describe(record)}; two writers "
        "of one directory would lose samples. Wait for it to finish, or write into another "
        "directory (parallel writers: one part each, ShardWriter(part=(i, n)) or feedpipe shard "
        "--part I/N)")


@dataclass
class WriteMarks:
    """What a directory shows of an unfinished write: ``live`` (the lock record of a writer at
    work), ``dead`` (lock records of writers that ended without finishing), the hidden temp
    files, and ``feedpipe shard``'s resume state files."""

    live: list[dict[str, Any]] = field(default_factory=list)
    dead: list[dict[str, Any]] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    locks: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)  # (no mark alone: a finished part keeps them)

    def __bool__(self) -> bool:
        return bool(self.live or self.dead or self.temps or self.states)

    def message(self, root: str) -> str:
        """What the marks mean and what to do (empty for a clean directory)."""
        if self.live:
            return (f"{root}: is being written now by {describe(self.live[0])}: its "
                    "manifest.json comes last; wait for the writer to finish")
        if not self:
            return ""
        redo = ("rerun the same `feedpipe shard SRC OUT` with --resume, or remove the directory "
                "and write it again" if self.states else
                "remove the directory and write it again")
        return (f"{self.what(root)}. The write must be redone: {redo} "
                "(`feedpipe index --adopt-interrupted` keeps only what was written)")

    def what(self, root: str) -> str:
        """Which writer was interrupted and what it left (see :meth:`message`)."""
        pids = [r.get("pid") for r in self.dead]
        pids += [int(m.group(1)) for t in self.temps if (m := _TEMP.match(t))]
        who = describe(self.dead[0]) if self.dead else (
            f"a writer (pid {pids[0]})" if pids else "`feedpipe shard`")
        left = [os.path.join(root, n) for n in (self.temps + self.states + self.locks)]
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        return (f"{root}: the write of this dataset was interrupted: {who} ended before writing "
                f"its manifest (it left {left[0]}{more}), so the samples after its last "
                "committed shard were never written")


def write_marks(root: str) -> WriteMarks:
    """The marks of an unfinished write in the local directory ``root`` (none for a remote
    URL, which shows no hidden files)."""
    from .._helpers.storage import is_local, local_path

    marks = WriteMarks()
    if not is_local(root):
        return marks
    path = local_path(root)
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return marks
    for name in names:
        if _LOCK.match(name):
            record = holder(os.path.join(path, name))
            if record is not None:
                marks.live.append(record)
            else:
                marks.locks.append(name)
                try:
                    with open(os.path.join(path, name), "rb") as f:
                        doc = json.loads(f.read(4096) or b"{}")
                    marks.dead.append(doc if isinstance(doc, dict) else {})
                except (OSError, ValueError):
                    marks.dead.append({})
        elif _STATE.match(name):
            marks.states.append(name)
        elif _RECORD.match(name):
            marks.records.append(name)
        elif _TEMP.match(name):
            marks.temps.append(name)
    return marks


def interrupted_error(root: str) -> InterruptedWriteError | None:
    """The error to raise for a local directory whose write is under way or was interrupted,
    or ``None``."""
    marks = write_marks(root)
    return InterruptedWriteError(marks.message(root)) if marks else None


def clear_marks(root: str, marks: WriteMarks) -> None:
    """Remove the temp files, state files and dead locks of an interrupted write (once what it
    wrote has been adopted)."""
    for name in marks.temps + marks.states + marks.locks + marks.records:
        try:
            os.unlink(os.path.join(root, name))
        except FileNotFoundError:
            pass
