"""Per-sample transforms: image decoding for every common format, the crops and resizes of
:class:`feedpipe.ImagePipeline`, and the DALI stage.
"""
