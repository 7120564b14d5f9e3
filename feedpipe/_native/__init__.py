"""feedpipe's optional C extensions, each beside this note (setup.py builds them in place here).

- ``_jpegcrop`` (``_jpegcrop.c``, linked with libjpeg-turbo): decodes only the window of a JPEG
  that a random-resized crop keeps, and resizes RGB pixels into the three planes of a CHW batch
  row (OpenCV's fixed-point bilinear for an enlargement, torch's antialiased bilinear for a
  reduction). Called by :mod:`feedpipe.transforms._jpeg` (``decode_crop``,
  ``decode_crop_into``), :mod:`feedpipe.transforms._resize` (``resize_into``) and
  :mod:`feedpipe.diagnostics._env` (its libjpeg-turbo version). Without it simplejpeg decodes
  whole images and OpenCV or torch resize them.
- ``_packrows`` (``_packrows.c``): copies :class:`feedpipe.Packed`'s token pieces out of the
  shards' maps (``gather``). Called by :mod:`feedpipe.stream._packed`; without it numpy copies
  them.
- ``_stagefiles`` (``_stagefiles.c``): the per-file loop of one-pass conversion (``stage``:
  open, read, close, tar header, in large writes), and the header parse of the image sizes
  recorded at shard time (``image_sizes``: JPEG, PNG, WebP, GIF, BMP). Called by
  :mod:`feedpipe.convert._stage_dir` and :mod:`feedpipe.format._image_sizes`; without it the same
  loop, and the same parse, run in Python.

Each caller imports its extension in a ``try`` and keeps a Python path that gives the same
output, and says once a process, in a log record, when the extension was not built
(:func:`feedpipe._helpers.dependency.say_unbuilt`). The tests compare each entry point with
that path (``tests/test_native_fuzz.py``), and ``tools/sanitize_extensions.sh`` runs them under
AddressSanitizer and UBSan.

Conventions the three share: the GIL is released around the work; every argument is checked
before a byte moves; an error raised in C says which function refused what, in the form the
interpreter uses for argument errors (``decode_crop(): scale_num must be in 1..16, not 0``), as
``ValueError`` for a value, ``TypeError`` for a type, ``OSError`` from ``errno`` and
``MemoryError``; they build with ``-Wall -Wextra`` without a warning.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type checkers see the compiled modules (no stubs: Any), built or not
    import feedpipe._native._jpegcrop
    import feedpipe._native._packrows
    import feedpipe._native._stagefiles  # noqa: F401
