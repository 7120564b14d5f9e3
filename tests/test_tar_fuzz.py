"""One tar parser for ``feedpipe index``, ``feedpipe verify`` and the reader (issue 23): on random
archives (ustar, GNU and PAX, long names, base-256 sizes, PAX size and path records, directory
entries) and mutated ones (bit flips with and without a recomputed checksum, truncations, bytes
appended or zeroed; hidden files, hard and symbolic links, to members or to nothing), the three
either all succeed and serve exactly the bytes :mod:`tarfile` reads (a hard link: its target's),
or all refuse with :class:`ShardFormatError`. Every other member tarfile lists (a directory
aside) is in the manifest's ``skipped`` with a reason (issue 41). Nothing else escapes, nothing
hangs, nothing half-written is left."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile

from _tars import base256, checksummed, pad, pax_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedpipe.errors import KeyClashError, ShardFormatError
from feedpipe.format._index import index_path
from feedpipe.format._indexer import index_dataset
from feedpipe.format._keys import split_member
from feedpipe.format._manifest import load_manifest
from feedpipe.format._reader import ShardReader
from feedpipe.format._verify import verify, verify_shard

_FORMATS = (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)


Data = bytes | None | tuple[bytes, str]


def _write(members: list[tuple[str, Data]], fmt: int) -> bytes:
    """A tar by the standard library; ``None`` data makes a directory entry, ``(type, target)``
    a hard or symbolic link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = 0o644, 0
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, tuple):
                info.type, info.linkname = data
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _headers(raw: bytes) -> list[tuple[int, int]]:
    """``(header offset, data size)`` of every regular member, by tarfile's reading."""
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        return [(m.offset_data - 512, m.size) for m in tf.getmembers() if m.isreg()]


@st.composite
def archives(draw: st.DrawFn) -> bytes:
    fmt = draw(st.sampled_from(_FORMATS))
    members: list[tuple[str, Data]] = []
    for i in range(draw(st.integers(0, 4)) or draw(st.integers(0, 1))):
        folder = draw(st.sampled_from(["", "a/", "d.ir/", "é/", "q" * 120 + "/"]))
        stem = draw(st.sampled_from(["s", "x" * 110, "猫", "k.v2", "s", "a b", ""])) + str(i)
        if draw(st.integers(0, 5)) == 0:
            members.append((f"{folder}{stem}", None))
        if draw(st.integers(0, 5)) == 0:  # a hidden file: its key is empty
            members.append((f"{folder}.{stem}", draw(st.binary(max_size=50))))
        for ext in draw(st.lists(st.sampled_from(["jpg", "json", "cls", "seg.png"]),
                                 min_size=1, max_size=3, unique=True)):
            name = f"{folder}{stem}.{ext}"
            files = [n for n, d in members if isinstance(d, bytes)]
            link = draw(st.sampled_from(["", "", "", "hard", "symbolic"]))
            if link:  # to an earlier file, or to a name the tar does not hold
                target = draw(st.sampled_from([*files, "gone.jpg", "z" * 140 + ".jpg"]))
                kind = tarfile.LNKTYPE if link == "hard" else tarfile.SYMTYPE
                members.append((name, (kind, target)))
            else:
                members.append((name, draw(st.binary(max_size=1100))))
    try:
        raw = _write(members, fmt)
    except ValueError:  # a name ustar cannot hold
        raw = _write(members, tarfile.GNU_FORMAT)
    heads = _headers(raw)
    if heads and draw(st.booleans()):  # GNU base-256 size field on one member
        pos, size = draw(st.sampled_from(heads))
        raw = raw[:pos] + checksummed(raw[pos:pos + 124] + base256(size)
                                      + raw[pos + 136:pos + 512]) + raw[pos + 512:]
    if heads and draw(st.booleans()):  # a PAX header giving one member's size (and a path)
        pos, size = draw(st.sampled_from(heads))
        records = pax_record("size", str(size))
        if draw(st.booleans()):
            records += pax_record("path", draw(st.sampled_from(["p/x.txt", "p/" + "z" * 130])))
        from _tars import header

        raw = raw[:pos] + header("PaxHeader/x", len(records), b"x") + pad(records) + raw[pos:]
    return raw


def _is_header(block: bytes) -> bool:
    try:
        return len(block) == 512 and tarfile.nti(block[148:156]) in tarfile.calc_chksums(block)
    except tarfile.HeaderError:
        return False


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(archives()))
    how = draw(st.sampled_from(["none", "flip", "flip+checksum", "truncate", "append", "zero"]))
    if not raw or how == "none":
        return bytes(raw)
    if how.startswith("flip"):
        for _ in range(draw(st.integers(1, 3))):
            p = draw(st.integers(0, len(raw) - 1))
            start = p - p % 512
            block = bytes(raw[start:start + 512])
            raw[p] ^= 1 << draw(st.integers(0, 7))
            if how == "flip+checksum" and _is_header(block):
                raw[start:start + 512] = checksummed(raw[start:start + 512])
    elif how == "truncate":
        del raw[draw(st.integers(0, len(raw) - 1)):]
    elif how == "append":
        raw += draw(st.binary(min_size=1, max_size=700))
    else:
        a, n = draw(st.integers(0, len(raw) - 1)), draw(st.integers(1, 600))
        raw[a:a + n] = bytes(len(raw[a:a + n]))
    return bytes(raw)


def _tarfile_members(raw: bytes) -> list[tuple[str, bytes]] | None:
    """Regular members and hard links to an earlier one (their target's bytes) that make
    samples (the WebDataset key rule), as tarfile reads them."""
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
            out = []
            for m in tf:
                if m.isreg() or m.islnk():
                    try:
                        f = tf.extractfile(m)
                    except KeyError:  # a hard link to a name no member before it holds
                        continue
                    assert f is not None
                    out.append((m.name, f.read()))
    except Exception:  # noqa: BLE001 - whatever tarfile makes of it, it read no archive
        return None
    return [(n, b) for n, b in out if split_member(n)[0] and not split_member(n)[0].endswith("/")]


def _tarfile_names(raw: bytes) -> list[str]:
    """Every member tarfile lists that is not a directory (links, devices and all)."""
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        return [m.name for m in tf if not m.isdir()]


def _shown(name: str) -> str:
    """A tarfile member name as feedpipe lists it: bytes that are not UTF-8 replaced."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _served(path: str, raw: bytes) -> list[tuple[str, bytes]]:
    """``(member name, bytes)`` as the reader serves them (with the ``.idx`` if there is one)."""
    out = []
    with ShardReader(path) as r:
        idx = r.index
        for i in range(len(r)):
            s = r.sample(i)
            assert s["__key__"] == split_member(idx.names[idx.starts[i]])[0]
            for m in range(idx.starts[i], idx.starts[i + 1]):
                data = raw[idx.offsets[m]:idx.offsets[m] + idx.sizes[m]]
                if idx.exts.count(idx.exts[m]) == 1:
                    assert bytes(s[idx.exts[m]]) == data
                out.append((idx.names[m], data))
    return out


def _check(raw: bytes, d: str) -> str:
    path = os.path.join(d, "s.tar")
    with open(path, "wb") as f:
        f.write(raw)
    oracle = _tarfile_members(raw)
    try:
        index_dataset([path], root=d, show_progress=False)
    except KeyClashError:  # refused by the index only: the reader still reads what tarfile reads
        assert _served(path, raw) == oracle
        return "key clash"
    except ShardFormatError as e:
        leftovers = sorted(n for n in os.listdir(d) if n != "s.tar")
        assert leftovers == [], leftovers  # no .idx, no manifest, no temp file
        if "holds no samples" in str(e) or "whitespace" in str(e):
            assert _served(path, raw) == (oracle or [])
            return "index refused"
        try:
            ShardReader(path)
        except ShardFormatError as r:
            assert (r.offset, r.kind) == (e.offset, e.kind)  # the same parser found the same
        else:
            raise AssertionError(f"index refused ({e}) but the reader's scan read the shard")
        problems = verify_shard(path, None, len(raw), None)
        assert [(p.kind, p.offset) for p in problems] == [(e.kind, e.offset)], problems
        return "refused"
    assert oracle is not None, "feedpipe indexed a shard tarfile cannot read"
    assert _served(path, raw) == oracle  # through the index
    # nothing vanishes: a member tarfile lists is served, or left out with its reason
    left = {x["path"] for x in load_manifest(d).skipped if x["reason"]}
    served = {n for n, _ in oracle}
    # (a name that is not UTF-8 is listed as shown, its undecodable bytes replaced by U+FFFD;
    # tarfile keeps them as surrogate escapes)
    assert [n for n in _tarfile_names(raw) if n not in served and _shown(n) not in left] == []
    assert left.isdisjoint(served)
    report = verify(d)
    assert report.ok and not report.warnings, report.problems + report.warnings
    os.unlink(index_path(path))
    assert _served(path, raw) == oracle  # the scan, without an index
    return "read"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_index_verify_and_reader_agree_with_tarfile(raw: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="feedpipe-fuzz-") as d:
        _check(raw, d)


def test_the_strategies_reach_every_outcome() -> None:
    """The fuzz test above must see sound archives read and broken ones refused, not only one
    kind (a generator that made only garbage would test nothing)."""
    seen: set[str] = set()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(mutated())
    def collect(raw: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="feedpipe-fuzz-") as d:
            seen.add(_check(raw, d))

    collect()
    assert {"read", "refused", "index refused"} <= seen
