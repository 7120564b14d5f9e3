"""Which sample field each column of a table becomes (Parquet files, a Hugging Face dataset).

The default, column by column (printed by ``feedpipe shard`` and kept in the manifest):

=====================================  =========================================================
column                                 field
=====================================  =========================================================
named ``__key__`` or ``key``           the sample key (default: the row number, per file)
categorical (Parquet dictionary,       ``cls``: the category's index; the categories become the
``datasets.ClassLabel``)               manifest's class names
integer named label, labels, cls,      ``cls`` (the first such column)
class, target or category
binary, or an image (``{bytes,         the bytes; the field is each row's own image format,
path}``: ``datasets.Image``)           by its magic number (``jpg``, ``png``, ``webp``, ``gif``,
                                       ``tiff``, ``bmp``, ``avif``, ``heic``), else the column
                                       name
string, integer, float, bool           text under the column name (bool as 0/1)
list or struct                         JSON text under ``NAME.json``
=====================================  =========================================================

A column name that cannot be a field name gets ``_`` for each character that cannot be in one;
one between double underscores (``__meta__``), which WebDataset keeps for a sample's metadata
(``__key__``, ``__url__``) and no writer stores, loses them (``meta``). An index pandas stored as
columns (``__index_level_N__``, where it is not a range) becomes the field of its name, where
pandas recorded one that no column has, else ``index`` (``index_N`` for level N of several;
``index_level_N`` where a column has that name): see :func:`index_fields`.
``--columns img=jpg,label=cls,id=__key__,junk=`` overrides the default per column (an empty
field drops the column); two columns may not make one field. Everything here is pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InputError
from ..format._keys import valid_extension

LABEL_NAMES = ("label", "labels", "cls", "class", "target", "category")
KEY = "__key__"
_BAD_CHARS = re.compile(r"[\s/%\\\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Column:
    """What a column holds: ``kind`` is one of binary, image, string, int, float, bool, category,
    nested, other; ``categories`` the names of a categorical column; ``sample`` its first
    non-null value (binary: the first bytes, for the format)."""

    name: str
    kind: str
    categories: tuple[str, ...] | None = None
    sample: Any = None
    index: str | None = None  # a pandas index stored as this column: its field and what it is
    index_note: str = ""


@dataclass(frozen=True)
class Target:
    """Where one column goes: ``field`` (``None``: dropped; :data:`KEY`: the key) and how its
    values are encoded (``bytes``, ``text``, ``cls``, ``json``, ``key``, ``drop``)."""

    column: str
    field: str | None
    encoding: str
    note: str = ""
    by_content: bool = False  # bytes: each row's field is its own image format (else ``field``)
    other: str | None = None  # by_content: the field of bytes of no known image format


@dataclass
class ColumnMap:
    """The fields of a table's samples: one :class:`Target` per column, and the class names."""

    targets: list[Target]
    classes: list[str] | None = None
    classes_from: str | None = None
    _index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {c: i for i, c in enumerate(self.classes or ())}

    @property
    def key_column(self) -> str | None:
        return next((t.column for t in self.targets if t.encoding == "key"), None)

    def lines(self) -> list[str]:
        """The mapping as text, one line per column (what ``feedpipe shard`` prints)."""
        out = []
        for t in self.targets:
            dest = "(dropped)" if t.field is None else t.field
            out.append(f"column   {t.column} -> {dest}" + (f"   ({t.note})" if t.note else ""))
        if self.classes is not None:
            out.append(f"classes  {len(self.classes)} from {self.classes_from}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {t.column: t.field for t in self.targets}

    def sample(self, row: Mapping[str, Any], key: str) -> dict[str, Any]:
        """The sample of one row (``key``: the default key; a key column wins)."""
        out: dict[str, Any] = {KEY: key}
        for t in self.targets:
            value = row.get(t.column)
            if t.field is None or value is None:
                continue
            if t.encoding == "key":
                out[KEY] = str(value)
            elif t.encoding == "cls":
                out[t.field] = self._cls(t.column, value)
            elif t.encoding == "json":
                out[t.field] = json.dumps(value, sort_keys=True, ensure_ascii=False,
                                          default=str)
            elif t.encoding == "bytes":
                data = value.get("bytes") if isinstance(value, dict) else value
                name = (image_ext(value) or t.other or t.field) if t.by_content else t.field
                if name in out:
                    raise InputError(f"column {t.column!r} holds {name.upper()} bytes, whose "
                                     f"field {name!r} another column fills too; send one "
                                     "elsewhere with --columns")
                out[name] = data
            elif isinstance(value, bool):
                out[t.field] = str(int(value))
            elif isinstance(value, (bytes, bytearray, memoryview)):
                out[t.field] = value
            else:
                out[t.field] = str(value)
        return out

    def _cls(self, column: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InputError(f"column {column!r}: class label {value!r} is neither an integer "
                             "nor a class name")
        if isinstance(value, str):
            if value not in self._index:
                raise InputError(f"column {column!r}: class {value!r} is not one of the "
                                 f"{len(self._index)} class names; give --classes with it")
            return self._index[value]
        if self.classes is not None and not 0 <= value < len(self.classes):
            raise InputError(f"column {column!r}: class index {value} is outside the "
                             f"{len(self.classes)} class names")
        return value


def image_ext(data: Any) -> str | None:
    """The image format of ``data`` (bytes, or an image dict's bytes/path), or ``None``.

    Example:
        >>> image_ext(b"\\xff\\xd8\\xff\\xe0..."), image_ext({"bytes": None, "path": "a/b.PNG"})
        ('jpg', 'png')
    """
    if isinstance(data, dict):
        path = data.get("path")
        data = data.get("bytes")
        if not data and isinstance(path, str) and "." in path.rsplit("/", 1)[-1]:
            ext = path.rsplit(".", 1)[1].lower()
            return "jpg" if ext == "jpeg" else ext if valid_extension(ext) else None
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    head = bytes(data[:16])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"avif", b"avis"):
            return "avif"
        if brand in (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"):
            return "heic"
    if head[:2] == b"BM" and len(head) >= 14:
        return "bmp"
    return None


def field_name(column: str) -> str:
    """A valid field name for ``column`` (see the module docstring).

    Example:
        >>> field_name("image path"), field_name("caption"), field_name("__meta__")
        ('image_path', 'caption', 'meta')
    """
    name = _BAD_CHARS.sub("_", column).lstrip(".")
    while is_metadata(name):  # (metadata to WebDataset: never stored)
        name = name[2:-2]
    return name or "field"


def is_metadata(name: str) -> bool:
    """Whether a sample field ``name`` is WebDataset metadata (``__key__``, ``__url__``: between
    double underscores), which no writer stores."""
    return name.startswith("__") and name.endswith("__")


_INDEX_LEVEL = re.compile(r"__index_level_(\d+)__")


def _pandas_index(metadata: Mapping[bytes, bytes] | None
                  ) -> tuple[list[str], dict[Any, Any]]:
    """The index columns the schema's ``pandas`` metadata lists, and the name it recorded for
    each column's field; none where it has none (or of another shape: the names say it)."""
    raw = (metadata or {}).get(b"pandas")
    try:
        doc = json.loads(raw) if raw else {}
        levels = [c for c in doc.get("index_columns", []) if isinstance(c, str)] \
            if isinstance(doc, dict) else []
        recorded = {c.get("field_name"): c.get("name") for c in doc.get("columns", [])
                    if isinstance(c, dict)} if levels else {}
    except (ValueError, AttributeError, TypeError):
        levels, recorded = [], {}
    return levels, recorded


def index_fields(names: Sequence[str], metadata: Mapping[bytes, bytes] | None
                 ) -> dict[str, tuple[str, str]]:
    """The columns among ``names`` that hold a pandas index pandas could only name
    ``__index_level_N__`` (the schema's ``pandas`` metadata says which; without it, by that
    name), each with its field and what it is (pure): the level's name, where pandas recorded
    one that no column has, else ``index`` for a one-level index, ``index_N`` for level N of
    several, else (a column has that name too) ``index_level_N``.

    Example:
        >>> meta = {b"pandas": b'{"index_columns": ["k", "__index_level_1__"], '
        ...                    b'"columns": [{"name": null, "field_name": "__index_level_1__"}]}'}
        >>> index_fields(["v", "k", "__index_level_1__"], meta)
        {'__index_level_1__': ('index_1', 'pandas index, level 1')}
        >>> index_fields(["v", "__index_level_0__"], None)
        {'__index_level_0__': ('index', 'pandas index')}
    """
    levels, recorded = _pandas_index(metadata)
    if not levels:
        levels = sorted((n for n in names if _INDEX_LEVEL.fullmatch(n)),
                        key=lambda n: int(n[len("__index_level_"):-2]))
    columns = set(names)
    taken = {field_name(n).lower() for n in names}  # (fields are told apart in any case)
    out = {}
    for i, column in enumerate(levels):
        if column not in columns or not _INDEX_LEVEL.fullmatch(column):
            continue  # (a named level is a column of its name already)
        what = "pandas index" if len(levels) == 1 else f"pandas index, level {i}"
        name = recorded.get(column)
        choices = [name] if isinstance(name, str) and field_name(name) == name else []
        choices += ["index" if len(levels) == 1 else f"index_{i}", field_name(column)]
        field = next((c for c in choices if c.lower() not in taken), field_name(column))
        taken.add(field.lower())
        out[column] = (field, what)
    return out


def default_map(columns: Sequence[Column], classes: Sequence[str] | None = None,
                classes_from: str = "--classes", *, check: bool = True) -> ColumnMap:
    """The default mapping of ``columns`` (see the module docstring); ``check``: refuse two
    columns of one field now (false when overrides follow, which may part them)."""
    targets: list[Target] = []
    have_key = have_cls = False
    names = list(classes) if classes is not None else None
    source = classes_from if classes is not None else None
    for c in columns:
        if c.name in (KEY, "key") and not have_key and c.kind in ("string", "int"):
            targets.append(Target(c.name, KEY, "key", "the sample key"))
            have_key = True
        elif c.kind == "category" and not have_cls:
            targets.append(Target(c.name, "cls", "cls", "categories as class names"))
            have_cls = True
            if names is None:
                names, source = list(c.categories or ()), f"column {c.name!r}"
        elif c.kind == "int" and c.name.lower() in LABEL_NAMES and not have_cls:
            targets.append(Target(c.name, "cls", "cls", "integer label"))
            have_cls = True
        else:
            t = _by_kind(c, c.index or field_name(c.name))
            if c.index is not None:
                t = replace(t, note=f"{c.index_note}; {t.note}" if t.note else c.index_note)
            targets.append(t)
    m = ColumnMap(targets, names, source)
    if check:
        _check_fields(m)
    return m


def _by_kind(c: Column, name: str) -> Target:
    if c.kind in ("binary", "image"):
        # each row's field is the format of its own bytes (a column may mix JPEG and PNG); the
        # first row's is shown
        ext = image_ext(c.sample)
        what = "image" if c.kind == "image" else "bytes"
        note = (f"{what}, field by each row's format: {ext.upper()} in the first row" if ext
                else f"{what}, field by each row's format (else {name!r})")
        return Target(c.name, ext or name, "bytes", note, by_content=True, other=name)
    if c.kind == "nested":
        return Target(c.name, f"{name}.json", "json", "JSON text")
    if c.kind == "category":
        return Target(c.name, name, "text", "category name as text")
    note = {"string": "text", "int": "number as text", "float": "number as text",
            "bool": "0/1"}.get(c.kind, "as text")
    return Target(c.name, name, "text", note)


def parse_columns(spec: str | Mapping[str, str | None]) -> dict[str, str | None]:
    """``"img=jpg,label=cls,junk="`` (or a dict) -> ``{column: field or None}``.

    Example:
        >>> parse_columns("img=jpg, label=cls,junk=")
        {'img': 'jpg', 'label': 'cls', 'junk': None}
    """
    if not isinstance(spec, str):
        return {str(k): (v or None) for k, v in spec.items()}
    out: dict[str, str | None] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        col, eq, ext = item.partition("=")
        if not eq or not col.strip():
            raise InputError(f"--columns: {item.strip()!r} is not COLUMN=FIELD (e.g. "
                             "img=jpg,label=cls; an empty FIELD drops the column)")
        out[col.strip()] = ext.strip() or None
    return out


def override(m: ColumnMap, columns: Sequence[Column],
             spec: str | Mapping[str, str | None]) -> ColumnMap:
    """``m`` with the columns named in ``spec`` sent where it says (see :func:`parse_columns`)."""
    wanted = parse_columns(spec)
    by_name = {c.name: c for c in columns}
    unknown = [c for c in wanted if c not in by_name]
    if unknown:
        raise InputError(f"--columns: no column {unknown[0]!r}; the columns are "
                         f"{', '.join(repr(c.name) for c in columns)}")
    targets = [t if t.column not in wanted else _sent(by_name[t.column], wanted[t.column])
               for t in m.targets]
    out = _one_class_field(targets, by_name, m.classes, m.classes_from)
    _check_fields(out)
    return out


def _sent(c: Column, dest: str | None) -> Target:
    """Column ``c`` sent where ``--columns`` says: dropped, the key, the class or a field."""
    if dest is None:
        return Target(c.name, None, "drop", "--columns")
    if dest == KEY:
        return Target(c.name, KEY, "key", "--columns")
    if dest == "cls":
        if c.kind not in ("int", "category", "string"):
            raise InputError(f"--columns: column {c.name!r} holds {c.kind} values, not "
                             "class labels (integers or category names)")
        return Target(c.name, "cls", "cls", "--columns")
    if not valid_extension(dest) or dest.startswith("."):
        raise InputError(f"--columns: {dest!r} cannot be a field name (no spaces, '/', "
                         "'%' or leading '.')")
    if is_metadata(dest):
        raise InputError(f"--columns: {dest!r} cannot be a field name: a name between "
                         "double underscores is a sample's metadata to WebDataset "
                         f"(like {KEY}), never stored; name the field "
                         f"{field_name(dest)!r} instead")
    return Target(c.name, dest, _by_kind(c, dest).encoding, "--columns")


def _one_class_field(targets: list[Target], by_name: dict[str, Column],
                     names: list[str] | None, source: str | None) -> ColumnMap:
    """The map of ``targets``: the column the default sent to ``cls`` goes to text when
    ``--columns`` names another one, whose categories then name the classes."""
    chosen = [t for t in targets if t.encoding == "cls" and t.note == "--columns"]
    if len(chosen) > 1:
        raise InputError(f"--columns: {chosen[0].column!r} and {chosen[1].column!r} both go "
                         "to 'cls'; a sample has one class field")
    for i, t in enumerate(targets):
        if chosen and t.encoding == "cls" and t.note != "--columns":
            targets[i] = _by_kind(by_name[t.column], field_name(t.column))
            if source == f"column {t.column!r}":
                names, source = None, None
    if chosen and names is None and by_name[chosen[0].column].categories:
        names = list(by_name[chosen[0].column].categories or ())
        source = f"column {chosen[0].column!r}"
    return ColumnMap(targets, names, source)


def _check_fields(m: ColumnMap) -> None:
    seen: dict[str, Target] = {}
    for t in m.targets:
        if t.field is None:
            continue
        first = seen.get(t.field.lower())  # (WebDataset readers take fields in lower case)
        if first is not None:
            what = (f"field {t.field!r}" if first.field == t.field else
                    f"fields {first.field!r} and {t.field!r}, which differ only in case "
                    "(WebDataset readers take them in lower case and cannot read the shard)")
            raise InputError(f"columns {first.column!r} and {t.column!r} would both become "
                             f"{what}; send one elsewhere with --columns "
                             f"(e.g. {t.column}={t.field}2, or {t.column}= to drop it)")
        seen[t.field.lower()] = t
    if not any(t.field not in (None, KEY) for t in m.targets):
        raise InputError("no column becomes a field (all dropped or the key); keep one with "
                         "--columns")
