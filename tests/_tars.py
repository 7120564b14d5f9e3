"""Hand-made tar bytes for the format tests: headers with chosen fields, PAX records written
verbatim, base-256 numbers, and ``tarfile`` as the oracle of what the bytes hold."""

from __future__ import annotations

import io
import tarfile

BLOCK = 512


def checksummed(block: bytes | bytearray) -> bytes:
    """``block`` with its checksum field recomputed (as a writer would)."""
    b = bytearray(block)
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


def header(name: str | bytes, size: int, typeflag: bytes = b"0", *,
           size_field: bytes | None = None, gnu: bool = False) -> bytes:
    """One 512-byte header block; ``size_field`` replaces the 12-byte size field verbatim."""
    info = tarfile.TarInfo("x")
    info.size, info.type, info.mode, info.mtime = size, typeflag, 0o644, 0
    b = bytearray(info.tobuf(format=tarfile.GNU_FORMAT if gnu else tarfile.USTAR_FORMAT))
    raw = name.encode("utf-8") if isinstance(name, str) else name
    b[0:100] = raw[:100].ljust(100, b"\0")
    if size_field is not None:
        assert len(size_field) == 12
        b[124:136] = size_field
    return checksummed(b)


def pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


def member(name: str | bytes, data: bytes, **kw: object) -> bytes:
    """Header, data and padding of one regular file."""
    return header(name, len(data), **kw) + pad(data)  # type: ignore[arg-type]


def pax(records: bytes, typeflag: bytes = b"x") -> bytes:
    """A PAX extended header carrying ``records`` byte for byte (well formed or not)."""
    return header("PaxHeader/x", len(records), typeflag) + pad(records)


def pax_record(key: str, value: str | bytes) -> bytes:
    """One well-formed ``"%d %s=%s\\n"`` record."""
    v = value.encode("utf-8") if isinstance(value, str) else value
    body = b" " + key.encode() + b"=" + v + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def base256(n: int) -> bytes:
    """A 12-byte GNU base-256 numeric field (what GNU tar writes for sizes of 8 GiB and more)."""
    return b"\x80" + n.to_bytes(11, "big")


END = b"\0" * (2 * BLOCK)


def tarfile_members(raw: bytes) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of every regular member, as the standard library reads ``raw``."""
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        out = []
        for m in tf:
            if m.isreg():
                f = tf.extractfile(m)
                assert f is not None
                out.append((m.name, f.read()))
        return out


def build(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT,
          pax_headers: dict[str, str] | None = None) -> bytes:
    """A tar written by the standard library (deterministic metadata)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax_headers or {}) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
