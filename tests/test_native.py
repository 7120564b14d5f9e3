"""The three C extensions of feedpipe/_native/ share one convention for what they raise: the
message names the function that refused the call, as the interpreter's own argument errors do
(``decode_crop(): ...``); and each is imported from feedpipe/_native/, beside its source."""

from __future__ import annotations

import os

import numpy as np
import pytest
import simplejpeg

from feedpipe.convert import _stage_dir
from feedpipe.stream import _packed
from feedpipe.transforms import _jpeg

NATIVE = os.path.join(os.path.dirname(_jpeg.__file__), os.pardir, "_native")


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


@pytest.mark.skipif(_jpeg._jpegcrop is None, reason="feedpipe._native._jpegcrop did not build "
                    "(no libjpeg headers)")
def test_jpegcrop_errors_name_the_function() -> None:
    ext = _jpeg._jpegcrop
    jpg = simplejpeg.encode_jpeg(np.zeros((16, 16, 3), np.uint8))
    out = np.zeros((3, 8, 8), np.uint8)
    refused = [
        (lambda: ext.decode_crop(jpg, 0, 0, 4, 4, 0), "decode_crop(): scale_num"),
        (lambda: ext.decode_crop(jpg, 0, 0, 0, 4), "decode_crop(): an empty window"),
        (lambda: ext.decode_crop(jpg, 10, 0, 10, 4), "decode_crop(): window"),
        (lambda: ext.decode_crop(b"\xff\xd8 not a jpeg", 0, 0, 4, 4), "decode_crop(): libjpeg:"),
        (lambda: ext.decode_crop_into(jpg, 0, 0, 4, 4, out, 8, 9, False),
         "decode_crop_into(): out must hold"),
        (lambda: ext.decode_crop_into(jpg, 0, 0, 40, 4, out, 8, 8, False),
         "decode_crop_into(): window"),
        (lambda: ext.resize_into(np.zeros((4, 4, 2), np.uint8), out, False),
         "resize_into(): src"),
        (lambda: ext.resize_into(np.zeros((4, 4, 3), np.uint8), np.zeros((2, 8, 8), np.uint8),
                                 False), "resize_into(): out"),
    ]
    for call, start in refused:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(start), str(e.value)


@pytest.mark.skipif(_packed._packrows is None, reason="feedpipe._native._packrows did not build "
                    "(no C compiler at install)")
def test_packrows_errors_name_the_function() -> None:
    gather = _packed._packrows.gather
    m = np.arange(4, dtype=np.int32).view(np.uint8)
    out = np.zeros(16, np.uint8)
    for call, kind, start in [
        (lambda: gather(out, (m,), _i64(0), _i64(0), _i64(1), 9), ValueError,
         "gather(): itemsize"),
        (lambda: gather(out, (m,), _i64(0), _i64(12), _i64(2), 4), ValueError,
         "gather(): piece 0"),
        (lambda: gather(out, (m,), _i64(0, 0), _i64(0), _i64(1), 4), ValueError,
         "gather(): which, start and count"),
        (lambda: gather(np.zeros(2, np.uint8), (m,), _i64(0), _i64(0), _i64(2), 4), ValueError,
         "gather(): the pieces do not fit"),
        (lambda: gather(out, (m,), np.zeros(1, np.int32), _i64(0), _i64(1), 4), TypeError,
         "gather(): which must be"),
    ]:
        with pytest.raises(kind) as e:
            call()
        assert str(e.value).startswith(start), str(e.value)


@pytest.mark.skipif(_stage_dir._C is None, reason="feedpipe._native._stagefiles did not build "
                    "(no C compiler at install)")
def test_stagefiles_errors_name_the_function(tmp_path: os.PathLike[str]) -> None:
    with open(os.path.join(tmp_path, "out"), "wb") as f:
        with pytest.raises(ValueError) as e:  # first holds one entry for two keys
            _stage_dir._C.stage(-1, f.fileno(), ["a", "b"], [0], ["bin"], ["a.bin"], b"",
                                _stage_dir._TEMPLATE, 0, 0, 1 << 16, os.O_RDONLY, [], [], [],
                                [], [])
    assert str(e.value).startswith("stage(): "), str(e.value)


def test_the_extensions_are_imported_from_native_beside_their_sources() -> None:
    for ext, name in ((_jpeg._jpegcrop, "_jpegcrop"), (_packed._packrows, "_packrows"),
                      (_stage_dir._C, "_stagefiles")):
        assert os.path.exists(os.path.join(NATIVE, f"{name}.c"))
        if ext is not None:
            assert ext.__name__ == f"feedpipe._native.{name}"
            assert os.path.samefile(os.path.dirname(ext.__file__), NATIVE)
