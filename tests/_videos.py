"""Small real videos made with PyAV for the video tests: frame ``i`` is filled with red
``7 * i`` (so a decoded frame says its number) and a green bar ``2 * (i + 1)`` pixels long."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

# (codec, container format) per extension; PyAV's wheels carry these encoders
CODECS = {"mp4": ("libx264", "mp4"), "webm": ("libvpx-vp9", "webm"),
          "mkv": ("libx264", "matroska")}


def frame_pixels(i: int, width: int = 64, height: int = 48) -> np.ndarray:
    a = np.zeros((height, width, 3), np.uint8)
    a[:, :, 0] = (7 * i) % 256
    a[: height // 6, : min(width, 2 * (i + 1)), 1] = 255
    return a


def make_video(frames: int = 32, ext: str = "mp4", *, rate: int = 8, gop: int = 8,
               width: int = 64, height: int = 48, bframes: int = 0) -> bytes:
    """A video of ``frames`` frames at ``rate`` frames/s with a keyframe every ``gop`` (H.264:
    ``bframes`` B-frames between references, some of them referred to by none)."""
    import av

    codec, fmt = CODECS[ext]
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"g": str(gop), "bf": str(bframes)} if codec == "libx264" else {"g": str(gop)}
        for i in range(frames):
            f = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def reference_frames(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    """Every frame of ``data`` decoded plainly with PyAV, one after the other, as
    ``[N, 3, H, W]`` uint8 (resized to ``(height, width)`` by the same FFmpeg scaler)."""
    import av

    h, w = size if size is not None else (None, None)
    # one scaler thread, as feedpipe's: a frame keeps its scaler, and one with slice threads
    # left for the collector hangs a worker process forked later in this process when the child
    # frees it (FFmpeg joins threads the fork did not copy; the suite hung in
    # test_worker_rows.py after this module's reference decodes)
    with av.open(io.BytesIO(data)) as c:
        out: list[Any] = [f.reformat(width=w, height=h, format="rgb24", threads=1).to_ndarray()
                          for f in c.decode(video=0)]
    return np.stack(out).transpose(0, 3, 1, 2)
