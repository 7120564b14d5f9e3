"""Byte sizes written by people: ``"256MB"``, ``"1GiB"``, ``"20GB"``, ``4096``. Pure."""

from __future__ import annotations

import re

from ..errors import InputError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12,
          "TIB": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"256MB"`` -> 256000000, ``"1GiB"`` -> 1073741824, ``"4096"`` or ``4096`` -> 4096.

    Example:
        >>> parse_size("20GB"), parse_size("1.5KiB"), parse_size(7)
        (20000000000, 1536, 7)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InputError(f"not a size: {text} (a size cannot be negative)")
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise InputError(f"not a size: {text!r} (e.g. 256MB, 1GiB, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    """Bytes for people, in decimal units.

    Example:
        >>> format_size(512), format_size(1_234_567), format_size(3e12)
        ('512 B', '1.2 MB', '3.0 TB')
    """
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)
