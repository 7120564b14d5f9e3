"""OpenCV, imported on first use and run on the calling thread."""

from __future__ import annotations

from typing import Any

_CV2: Any = None  # the cv2 module once looked up; False when it does not import


def opencv() -> Any:
    """The ``cv2`` module, or ``None`` where it does not import; imported on first use.

    OpenCV is switched to run on the calling thread (``cv2.setNumThreads(0)``, process-wide).
    One image is too little work to split, and a thread pool started in the parent is a known
    hazard for the DataLoader workers forked after it.
    """
    global _CV2
    if _CV2 is None:
        try:
            import cv2
        except ImportError:
            _CV2 = False
        else:
            cv2.setNumThreads(0)
            _CV2 = cv2
    return _CV2 or None
