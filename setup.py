"""Build hook for the one optional C extension; all metadata is in pyproject.toml.

``feedpipe._jpegcrop`` decodes only the crop window of a JPEG with libjpeg-turbo (see its source).
It needs a C compiler and libjpeg-turbo's headers (Debian: ``libjpeg-dev``). It is optional: where
it does not build, the install goes on and feedpipe decodes whole images with simplejpeg.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "feedpipe._jpegcrop",
            sources=["feedpipe/_jpegcrop.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
