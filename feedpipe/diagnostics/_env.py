"""The environment a probe ran in: CPUs, memory, the filesystem under the target, library
versions. The one place the probe reads ``/proc``; versions come from package metadata, so
nothing heavy is imported to learn them."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

_LIBS = ("feedpipe", "numpy", "torch", "fsspec", "simplejpeg", "matplotlib", "nvidia-dali-cuda130")


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - not installed
        return None


def memory() -> dict[str, int]:
    """``total_bytes`` and ``available_bytes`` from ``/proc/meminfo`` (empty elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                k, v = line.split(":", 1)
                name = {"MemTotal": "total_bytes", "MemAvailable": "available_bytes",
                        "Cached": "page_cache_bytes"}.get(k)
                if name:
                    out[name] = int(v.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _unescape(field: str) -> str:
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def filesystem_of(path: str) -> dict[str, Any]:
    """The mount holding ``path`` (longest matching mount point in ``/proc/mounts``) and what
    ``os.statvfs`` says about it."""
    out: dict[str, Any] = {"type": None, "mount_point": None, "device": None}
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            best = ""
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = _unescape(parts[1])
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best = mnt
                    out.update(type=parts[2], mount_point=mnt, device=_unescape(parts[0]))
    except OSError:
        pass
    try:
        st = os.statvfs(real if os.path.isdir(real) else os.path.dirname(real) or ".")
        out.update(block_size=st.f_bsize, total_bytes=st.f_blocks * st.f_frsize,
                   free_bytes=st.f_bavail * st.f_frsize)
    except OSError:
        pass
    return out


def jpeg_window_decoder() -> str | None:
    """The libjpeg-turbo behind feedpipe's window-only JPEG decoding (the optional C extension
    ``feedpipe._native._jpegcrop``), e.g. ``"libjpeg-turbo 2.1.5"``; ``None`` where it did not
    build and simplejpeg decodes whole images."""
    try:
        from .._native import _jpegcrop
    except ImportError:
        return None
    v = int(_jpegcrop.LIBJPEG_TURBO_VERSION_NUMBER)
    return f"libjpeg-turbo {v // 1000000}.{v // 1000 % 1000}.{v % 1000}"


def environment(target_path: str | None, local: bool) -> dict[str, Any]:
    """Everything a reader of the figures needs to know about where they were measured."""
    env: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "memory": memory(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {lib: _version(lib) for lib in _LIBS},
        "jpeg_window_decoder": jpeg_window_decoder(),
    }
    if target_path is not None and local:
        env["filesystem"] = filesystem_of(target_path)
    else:
        env["filesystem"] = {"type": target_path.split("://", 1)[0] if target_path else None,
                             "remote": True}
    return env


def usable_cpus() -> int:
    """CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
