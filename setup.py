"""Build hook for the optional C extensions; all metadata is in pyproject.toml.

``feedpipe._jpegcrop`` decodes only the crop window of a JPEG with libjpeg-turbo (see its source).
It needs a C compiler and libjpeg-turbo's headers (Debian: ``libjpeg-dev``). It is optional: where
it does not build, the install goes on and feedpipe decodes whole images with simplejpeg.

``feedpipe._packrows`` copies ``feedpipe.Packed``'s token pieces out of the shards' maps (see its
source). It needs a C compiler only. It is optional too: without it, numpy copies them, slower.

``feedpipe._stagefiles`` runs the per-file loop of one-pass conversion (``feedpipe shard`` of a
local tree of small files: open, read, close, tar header; see its source). It needs a C compiler
only. It is optional too: without it, the same loop runs in Python, slower.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "feedpipe._jpegcrop",
            sources=["feedpipe/_jpegcrop.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "feedpipe._packrows",
            sources=["feedpipe/_packrows.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "feedpipe._stagefiles",
            sources=["feedpipe/_stagefiles.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
