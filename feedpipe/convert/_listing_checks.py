"""What a conversion says about its listing before it plans: a source with nothing to convert
refused (naming what was found instead), the first bad input raised under ``on_error="raise"``,
extensions that differ only in case refused, and warnings for output directories skipped, files
of class folders left out and samples of several images (:func:`feedpipe.shard`,
:mod:`~feedpipe.convert._shard_run`).
"""

from __future__ import annotations

import os
from typing import Any

from .._helpers.storage import is_local, local_path
from .._redact import logger
from ..errors import InputError, KeyClashError
from ..format._image_fields import IMAGE_FIELDS, image_extension, image_field_of
from ._options import ShardOptions
from ._sources import Listing, SampleSpec, printable, several_images

log = logger("feedpipe.convert")


def check_not_empty(src: str, opts: ShardOptions, listing: Any, total: int) -> None:
    """Refuse a source with nothing to convert (a dataset of 0 samples is a mistake), saying
    what was found instead; a bad input under ``on_error="raise"`` is reported first."""
    if total:
        return
    drop_problems(listing, opts.on_error)
    if opts.manifest is not None:
        raise InputError(f"{opts.manifest}: the manifest names no samples; add rows with a "
                         "'path' or '<ext>_path' column")
    found = []
    if listing.problems:
        found.append(f"{len(listing.problems)} bad input(s) skipped, e.g. "
                     f"{listing.problems[0][0]}: {listing.problems[0][1]}")
    if listing.ignored:
        found.append(f"{listing.ignored} hidden file(s) ignored")
    if listing.left_out:
        found.append(f"{len(listing.left_out)} file(s) of class folders left out as not "
                     f"images, e.g. {listing.left_out[0][0]}")
    if listing.outputs:
        found.append(f"feedpipe output skipped: {', '.join(listing.outputs)}")
    tail = f" ({'; '.join(found)})" if found else ""
    raise InputError(f"{printable(src)}: the source directory has no files to convert{tail}; "
                     "point SRC at the directory that holds the data")


def report_outputs(src: str, out: str, listing: Any) -> None:
    """Say which directories the listing skipped as output (see
    :mod:`~feedpipe.convert._source_tree`)."""
    if is_local(src) and is_local(out):
        real_src, real_out = os.path.realpath(local_path(src)), os.path.realpath(local_path(out))
        if real_out != real_src and os.path.commonpath([real_src, real_out]) == real_src:
            log.warning("feedpipe shard: the output directory %s is inside the source %s: the "
                        "listing skips it (and any later conversion of the source does too)",
                        printable(out), printable(src))
    for rel in listing.outputs:
        log.warning("feedpipe shard: skipped %s/%s: it holds feedpipe output (shards, a "
                    "manifest or a conversion under way), not source data", printable(src), rel)


def several_images_named(samples: list[SampleSpec]) -> list[dict[str, Any]]:
    """Every sample of two or more images (files that share a stem), by key: its ``key``, its
    image files (``images``) and the one :class:`~feedpipe.ImagePipeline` takes by default
    (``taken``, the first of its ``image_field`` list): an ImageFolder counts each file as an
    image, and the others are never trained."""
    multi = [s for s in samples if len(s.files) > 1]
    if not multi:  # a sample of one file holds one image at most
        return []
    out: list[tuple[str, list[str], str]] = []
    for spec in several_images(multi, IMAGE_FIELDS):
        taken = image_field_of(dict.fromkeys((f.ext for f in spec.files), True), IMAGE_FIELDS)
        out.append((spec.key, sorted(printable(f.path) for f in spec.files
                                     if image_extension(f.ext) is not None),
                    next(printable(f.path) for f in spec.files if f.ext == taken)))
    out.sort()  # (by key: a part's samples come shuffled)
    return [{"key": key, "images": images, "taken": path} for key, images, path in out]


def report_several_images(several: list[dict[str, Any]]) -> None:
    """Say, once a run, that files sharing a stem made samples of two or more images, naming
    some (the manifest and the summary name all)."""
    if not several:
        return
    n = len(several)
    shown = "; ".join(f"{' + '.join(e['images'])} (trains with {e['taken']})"
                      for e in several[:5]) + ("; ..." if n > 5 else "")
    log.warning("feedpipe shard: %d sample%s hold%s two or more images (files that share a stem "
                "are one sample), where an ImageFolder counts each file as an image, and "
                "ImagePipeline takes the first of its image_field list: %s. Every one is named "
                "in the manifest's created_by.several_images (and the summary's "
                "several_images); give each image its own stem if each is a sample",
                n, "s" * (n > 1), "" if n > 1 else "s", shown)


def refuse_case_clashes(src: str, samples: list[SampleSpec]) -> None:
    """Refuse a sample of two files whose extensions differ only in case (``x.jpg`` and
    ``x.JPG``): WebDataset readers take extensions in lower case and cannot read it."""
    for spec in samples:
        files, extras = spec.files, spec.extras
        # the common shapes checked cheaply: one file and the class field, or two files
        if len(files) < 2:
            if not files or not extras or (len(extras) == 1 and
                                           files[0].ext.lower() != extras[0][0].lower()):
                continue
        elif len(files) == 2 and not extras and files[0].ext.lower() != files[1].ext.lower():
            continue
        exts = [f.ext for f in files] + [e for e, _ in extras]
        if len({e.lower() for e in exts}) == len(exts):
            continue
        seen: dict[str, str] = {}
        for ext, path in [(f.ext, printable(f.path)) for f in files] + [
                (e, f"the {e!r} field of --labels-from-dirs") for e, _ in extras]:
            first = seen.setdefault(ext.lower(), path)
            if first != path:
                raise KeyClashError(
                    f"{printable(src)}: {first} and {path} make one sample "
                    f"whose fields differ only in case; WebDataset readers take extensions in "
                    "lower case and cannot read it: rename one of the files (or move it out)")


def listing_skipped(listing: Listing, on_error: str) -> list[tuple[str, str]]:
    """The listing's inputs the manifest counts as skipped: the files ``--labels-from-dirs``
    left out (not images), the hidden files (a hidden directory once), and the bad inputs
    ``on_error="skip"`` left out."""
    return listing.left_out + listing.hidden + (listing.problems if on_error == "skip" else [])


def report_left_out(listing: Listing) -> None:
    """Say which files of class folders were left out as not images (they are counted in the
    manifest's ``skipped`` and listed in the summary's ``skipped_inputs``)."""
    if listing.left_out:
        n = len(listing.left_out)
        shown = ", ".join(p for p, _ in listing.left_out[:5]) + (", ..." if n > 5 else "")
        log.warning("feedpipe shard: left out %d file%s of the class folders that %s not an "
                    "image (--labels-from-dirs takes image files, as torchvision's ImageFolder "
                    "does; the manifest's 'skipped' lists them): %s",
                    n, "s" * (n > 1), "are" if n > 1 else "is", shown)


def drop_problems(listing: Listing, on_error: str) -> list[SampleSpec]:
    if listing.problems and on_error == "raise":
        path, reason = listing.problems[0]
        more = len(listing.problems) - 1
        tail = f" (and {more} more bad input(s))" if more else ""
        raise InputError(f"{path}: {reason}{tail}; use --on-error skip to leave bad inputs out")
    return listing.samples
