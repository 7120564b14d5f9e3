"""A benchmark's JSON results as Markdown tables (``render_results.py`` writes the document).

The JSON shapes differ from one benchmark to the next, so the shape decides the layout: a dict
whose children are records with mostly the same keys is a table with a row per child; nested
figures of a row become columns (``a.b``), or tables of their own when there are more than
``MAX_COLS``; tables that all have the same rows (the same measures for every system, say) are
turned round into one table per measure when that makes fewer, longer tables; a record on its own
is a two-column table; a list of records is a table with a row per item. The unit in a key's name
goes into its header (:func:`header`); numbers are rounded to about three significant digits
(:func:`number`). Per-pass lists longer than ``SHORT_LIST`` and raw run records (``RAW``) are
left to the JSON.
"""

from __future__ import annotations

import math
import re
from typing import Any

RAW = {"runs", "log", "times_s"}  # raw per-pass records: left to the JSON
MAX_COLS = 9
SHORT_LIST = 4  # longer lists of numbers are per-pass values: left to the JSON


def number(v: float) -> str:
    """A figure rounded to about three significant digits, thousands separated."""
    if v == 0:
        return "0"
    if abs(v) < 0.01:
        return f"{v:.3g}"
    return f"{v:,.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"


# -- cells and headers ----------------------------------------------------------------------------

def cell(v: Any, key: str = "", limit: int = 100) -> str:
    """One value as a table cell (``key``: its key, for the separator of a spread)."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{int(v):,}" if v.is_integer() and abs(v) < 1e15 else number(v)
    if isinstance(v, list):
        items = [cell(x) for x in v]
        if len(items) == 2 and re.search(r"spread|range", key):
            return " – ".join(items)
        return ("; " if any("," in x for x in items) else ", ").join(items) or "–"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {cell(x)}" for k, x in v.items())
    s = str(v).replace("|", "\\|").replace("\n", " ")
    return s if len(s) <= limit else s[:limit - 1] + "…"


_SUFFIX = (("_seconds", "s"), ("_bytes", "bytes"), ("_GBps", "GB/s"), ("_MBps", "MB/s"),
           ("_ms", "ms"), ("_us", "µs"), ("_mb", "MB"), ("_MB", "MB"), ("_pct", "%"),
           ("_s", "s"))
_ALONE = {"s": "s", "ms": "ms", "us": "µs", "mb": "MB", "MB": "MB", "bytes": "bytes"}


def _words(s: str) -> str:
    return " ".join({"mb": "MB", "gb": "GB"}.get(w, w) for w in s.split("_") if w)


def header(key: str) -> str:
    """A column header from a (dotted) key, its unit spelled out: ``wall_s`` -> ``wall (s)``,
    ``payload_mb_per_s`` -> ``payload MB/s``, ``us_per_image`` -> ``µs/image``."""
    prefix, dot, leaf = key.rpartition(".")
    if leaf in _ALONE:
        return f"{prefix}{dot}{_ALONE[leaf]}"
    m = re.fullmatch(r"(.+?)_per_s(?:_(.+))?", leaf)
    if m:
        return f"{prefix}{dot}{_words(m[1])}/s" + (f" {_words(m[2])}" if m[2] else "")
    m = re.fullmatch(r"(us|ms|s)_per_(.+)", leaf)
    if m:
        return f"{prefix}{dot}{_ALONE[m[1]]}/{_words(m[2])}"
    for suf, unit in _SUFFIX:
        if leaf.endswith(suf) and len(leaf) > len(suf):
            return f"{prefix}{dot}{_words(leaf[:-len(suf)])} ({unit})"
    return f"{prefix}{dot}{_words(leaf)}"


def table(head: list[str], rows: list[list[Any]], keys: list[str], limit: int = 100) -> list[str]:
    """A Markdown table; numeric columns right-aligned, text cut at ``limit`` characters."""
    num = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) for i in
           range(len(head))]
    out = ["| " + " | ".join(head) + " |",
           "| " + " | ".join("---:" if n else "---" for n in num) + " |"]
    out += ["| " + " | ".join(cell(v, k, limit) for v, k in zip(r, keys)) + " |" for r in rows]
    return out + [""]


# -- the shape of a section -----------------------------------------------------------------------

def scalar_list(v: Any) -> bool:
    return isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)


def _depth(v: Any) -> int:
    """Nesting of dicts; a list counts as a value (a list of records in a row gets a table of
    its own below the row's table)."""
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


def _record_lists(rec: dict) -> dict[str, list]:
    return {k: v for k, v in rec.items() if isinstance(v, list) and v and not scalar_list(v)
            and k not in RAW}


def _flat(v: Any) -> bool:
    return isinstance(v, dict) and bool(v) and _depth(v) <= 1


def _leafy(v: Any) -> bool:
    return isinstance(v, dict) and bool(v) and _depth(v) <= 2


def _groups(recs: dict[str, dict]) -> list[dict[str, dict]]:
    """Records split into groups that share at least half their keys (the rows of one table)."""
    groups: list[tuple[set[str], dict[str, dict]]] = []
    for k, r in recs.items():
        keys = set(r)
        for seen, members in groups:
            if len(keys & seen) * 2 >= len(keys | seen):
                seen |= keys
                members[k] = r
                break
        else:
            groups.append((keys, {k: r}))
    return [m for _, m in groups]


def _rowset(d: Any) -> bool:
    """A dict that is itself a table: most of its children are flat records sharing keys."""
    if not isinstance(d, dict):
        return False
    kids = [k for k, v in d.items() if isinstance(v, dict)]
    rows = {k: d[k] for k in kids if _flat(d[k])}
    if len(rows) < 2:
        return False
    big = max(_groups(rows), key=len)
    return len(big) >= 2 and len(big) * 2 >= len(kids)


def flatten(rec: dict, prefix: str = "") -> dict[str, Any]:
    """A record's figures under dotted keys; per-pass lists and lists of records left out."""
    out: dict[str, Any] = {}
    for k, v in rec.items():
        if k in RAW:
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif not isinstance(v, list) or (scalar_list(v) and (
                len(v) <= SHORT_LIST or not all(isinstance(x, (int, float)) for x in v))):
            out[key] = v
    return out


class Writer:
    """The Markdown lines of one result set."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.last_heading = ""

    def heading(self, level: int, text: str) -> None:
        if text != self.last_heading:  # a section's own heading, already written above it
            self.lines += [f"{'#' * min(level, 4)} {text}", ""]
            self.last_heading = text

    def kv(self, items: dict[str, Any]) -> None:
        flat = flatten(items)
        if flat:
            self.lines += table(["", "value"], [[header(k), v] for k, v in flat.items()],
                                ["", *flat], limit=2000)

    def rows(self, rows: list[tuple[str, dict]], label: str) -> None:
        """One table (or several when there are many columns) with a row per record."""
        flat = [(name, flatten(r)) for name, r in rows]
        cols = list(dict.fromkeys(c for _, f in flat for c in f))
        cols = [c for c in cols if any(f.get(c) not in (None, "", []) for _, f in flat)]
        flat = [(name, f) for name, f in flat if any(f.get(c) not in (None, "", []) for c in cols)]
        if not cols:
            return
        chunks: list[tuple[str, list[str], list[str]]] = []  # (caption, repeated, own columns)
        if len(cols) <= MAX_COLS:
            chunks.append(("", [], cols))
        else:
            base = [c for c in cols if "." not in c]
            nested: dict[str, list[str]] = {}
            for c in cols:
                if "." in c:
                    nested.setdefault(c.split(".", 1)[0], []).append(c)
            keep = base if len(base) <= 2 else []  # repeated beside every nested group
            for i in range(0, len(base) if not keep else 0, MAX_COLS):
                chunks.append(("", [], base[i:i + MAX_COLS]))
            for pre, cs in nested.items():
                for i in range(0, len(cs), MAX_COLS):
                    chunks.append((pre, keep, cs[i:i + MAX_COLS]))
        for caption, keep, own in chunks:
            if caption:
                self.lines += [f"*{caption}:*", ""]
            heads = [label] + [header(c) for c in keep] + [
                header(c.split(".", 1)[1] if caption else c) for c in own]
            body = [[name] + [f.get(c) for c in keep + own] for name, f in flat]
            self.lines += table(heads, body, ["", *keep, *own])

    def section(self, node: Any, title: str, level: int) -> None:
        """Every figure under ``node``, as tables."""
        if isinstance(node, list):
            self._list(node, title, level)
            return
        if not isinstance(node, dict) or not node:
            return
        kids = {k: v for k, v in node.items() if isinstance(v, dict) and k not in RAW}
        scal = {k: v for k, v in node.items() if not isinstance(v, (dict, list))
                or (scalar_list(v) and k not in RAW)}
        if len(kids) >= 2 and all(_rowset(v) for v in kids.values()):
            row_keys = [[k for k, x in v.items() if isinstance(x, dict)] for v in kids.values()]
            union = list(dict.fromkeys(k for ks in row_keys for k in ks))
            common = set.intersection(*(set(ks) for ks in row_keys))
            if len(common) * 2 >= len(union) and len(kids) > len(union):
                self._pivot(kids, union, scal, title, level)
                return
        rows = {k: v for k, v in kids.items() if _leafy(v) and not _rowset(v)}
        if scal or rows:
            self.heading(level, title)
        if scal:
            self.kv(scal)
        alone = set()
        for group in _groups(rows):
            if len(group) >= 2:
                self.rows(list(group.items()), title.rsplit(" › ", 1)[-1])
            else:
                (name, rec), = group.items()
                self.heading(level + 1, f"{title} › {name}")
                self.kv(rec)
                alone.add(name)
        for name, rec in rows.items():
            for k, v in _record_lists(rec).items():
                self._list(v, f"{title} › {name} › {k}", level + 1 + (name in alone))
        for k, v in node.items():
            if k in RAW or k in rows or k in scal:
                continue
            self.section(v, f"{title} › {k}", level + 1)

    def _pivot(self, kids: dict[str, dict], metrics: list[str], scal: dict, title: str,
               level: int) -> None:
        """``kids`` are tables with the same rows (metrics): one table per metric instead, with
        a row per kid, when there are more kids than metrics (easier to compare)."""
        self.heading(level, title)
        if scal:
            self.kv(scal)
        own = {k: {m: x for m, x in v.items() if not isinstance(x, dict)} for k, v in kids.items()}
        self.rows(list(own.items()), title.rsplit(" › ", 1)[-1])
        for m in metrics:
            self.heading(level + 1, f"{title} › {m}")
            self.rows([(k, v[m]) for k, v in kids.items() if isinstance(v.get(m), dict)],
                      title.rsplit(" › ", 1)[-1])

    def _list(self, node: list, title: str, level: int) -> None:
        recs = [x for x in node if isinstance(x, dict)]
        if not recs:
            if node and scalar_list(node):
                self.heading(level, title)
                self.lines += [cell(node), ""]
            return
        self.heading(level, title)
        rows = []
        for i, r in enumerate(recs):
            names = [str(v) for v in r.values() if isinstance(v, str)]
            rows.append((" · ".join(names) or f"#{i + 1}",
                         {k: v for k, v in r.items() if not isinstance(v, str)}))
        self.rows(rows, "")
