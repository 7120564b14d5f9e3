"""Build hook for the optional C extensions; all metadata is in pyproject.toml.

The three live in ``feedpipe/_native/`` (its ``__init__`` says what each does, who calls it and
what runs where it did not build). Each is optional: where one does not build, the install goes
on and feedpipe does the same work in Python (or with simplejpeg, OpenCV and numpy), slower.

- ``feedpipe._native._jpegcrop`` decodes only the crop window of a JPEG with libjpeg-turbo and
  resizes into a batch row; it needs a C compiler and libjpeg-turbo's headers (Debian:
  ``libjpeg-dev``).
- ``feedpipe._native._packrows`` copies ``feedpipe.Packed``'s token pieces out of the shards'
  maps; a C compiler only.
- ``feedpipe._native._stagefiles`` runs the per-file loop of one-pass conversion (``feedpipe
  shard`` of a local tree of small files); a C compiler only.

They build with ``-Wall -Wextra`` and are kept free of warnings under them.
"""

from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra"]

setup(
    ext_modules=[
        Extension(
            "feedpipe._native._jpegcrop",
            sources=["feedpipe/_native/_jpegcrop.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3", *WARNINGS],
            optional=True,
        ),
        Extension(
            "feedpipe._native._packrows",
            sources=["feedpipe/_native/_packrows.c"],
            extra_compile_args=["-O2", *WARNINGS],
            optional=True,
        ),
        Extension(
            "feedpipe._native._stagefiles",
            sources=["feedpipe/_native/_stagefiles.c"],
            extra_compile_args=["-O2", *WARNINGS],
            optional=True,
        ),
    ]
)
