"""Which fields hold images: the one rule, by extension, that every part applies.

A field's name is the source file's extension as the shard stores it, case kept (the WebDataset
rule): an ILSVRC tree's ``n01440764_18.JPEG`` is a sample with a field ``JPEG``. Whether a field
is an image is decided here, case-insensitively, for every consumer: the image-folder listing of
``feedpipe shard --labels-from-dirs`` (which files are samples), ``feedpipe verify``,
:class:`~feedpipe.ImagePipeline`, :class:`~feedpipe.DaliStage` and the probe. The extensions
are torchvision ``ImageFolder``'s (whose layout ``--labels-from-dirs`` reads) and the formats
feedpipe's decoders add (AVIF, HEIC/HEIF).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IMAGE_EXTENSIONS: dict[str, str] = {
    "jpg": "jpeg", "jpeg": "jpeg", "png": "png", "webp": "webp", "avif": "avif",
    "heic": "heic", "heif": "heic",
    "bmp": "other", "tif": "other", "tiff": "other", "ppm": "other", "pgm": "other",
}
"""An image extension (lower case) -> its format, as
:func:`~feedpipe.transforms._decode.image_decoders` names them (``"other"``: what OpenCV
reads besides). The order is the order in which a sample's image is looked for."""

IMAGE_FIELDS: tuple[str, ...] = tuple(IMAGE_EXTENSIONS)
"""The fields :class:`~feedpipe.ImagePipeline` and :class:`~feedpipe.DaliStage` look in by
default, in this order (each also in any other case: ``JPEG``, ``Png``): the first one a sample
has is its image."""


def image_extension(name: str) -> str | None:
    """The image format a field name or file extension stands for, ``None`` for another field.

    Case-insensitive; a compound name (``left.png``) counts by its last extension.

    Example:
        >>> image_extension("JPEG"), image_extension("left.Png"), image_extension("json")
        ('jpeg', 'png', None)
    """
    return IMAGE_EXTENSIONS.get(name.rsplit(".", 1)[-1].lower())


def image_field_of(sample: Mapping[str, Any], fields: Sequence[str]) -> str | None:
    """The first of ``fields`` that ``sample`` holds, matching a field in any case (``JPEG``
    for ``jpeg``) where none matches exactly; ``None`` when it holds none of them (a ``None``
    value counts as absent).

    Example:
        >>> image_field_of({"JPEG": b"...", "cls": b"3"}, ("jpg", "jpeg", "png"))
        'JPEG'
    """
    for f in fields:
        if sample.get(f) is not None:
            return f
    return _any_case(((k, v is not None) for k, v in sample.items()), fields)


def fields_present(columns: Iterable[str], fields: Sequence[str]) -> list[str]:
    """The names among ``columns`` (a batch's fields, a manifest's) that match ``fields``, in
    ``fields``' order, each in any case; for one of ``fields`` an exact match comes first.

    Example:
        >>> fields_present(["cls", "JPEG", "png"], ("jpg", "jpeg", "png"))
        ['JPEG', 'png']
    """
    names = list(columns)
    by_lower: dict[str, list[str]] = {}
    for n in names:
        by_lower.setdefault(n.lower(), []).append(n)
    out: list[str] = []
    for f in fields:
        same = by_lower.get(f.lower(), [])
        for n in sorted(same, key=lambda n: n != f):
            if n not in out:
                out.append(n)
    return out


def _any_case(items: Iterable[tuple[str, bool]], fields: Sequence[str]) -> str | None:
    rank: dict[str, int] = {}
    for i, f in enumerate(fields):
        rank.setdefault(f.lower(), i)
    best: tuple[int, str] | None = None
    for key, present in items:
        if not present or key.startswith("__"):
            continue
        i = rank.get(key.lower(), -1)
        if i >= 0 and (best is None or (i, key) < best):
            best = (i, key)
    return None if best is None else best[1]
