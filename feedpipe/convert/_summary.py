"""What a conversion reports when it ends (``feedpipe shard``'s summary, ``--json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ShardSummary:
    """The outcome of :func:`feedpipe.shard` (and :func:`feedpipe.shard_from`).

    Attributes:
        out: the output directory.
        shards: shards in the dataset (or the part).
        samples: samples written.
        files: source files read (for a table source: its rows).
        bytes: bytes of the shards.
        skipped: inputs left out under ``on_error="skip"``.
        reused_shards: shards kept from an interrupted run (``resume``).
        seconds: the run's wall time.
        files_per_s: ``files`` over ``seconds``.
        mb_per_s: ``bytes`` over ``seconds``, in MB/s.
        skipped_inputs: ``{"path", "reason"}`` of each input left out.
        part: ``"I/N"`` of a ``part`` run.
        merged: this part found all parts finished and wrote the manifest.
        method: the conversion method taken: ``general``, ``one-pass`` or ``table`` (see
            :class:`ShardOptions`' ``method``).
        executor: what wrote the shards, in words.
        why: why not one pass, where it was tried, in words.
        columns: a table source's column-to-field mapping, one line per column.
        several_images: every sample of a tree that holds two or more images (files that
            share a stem: ``cat/x.jpg``, ``cat/x.png``), as ``{"key", "images", "taken"}``:
            ``taken`` is the image ImagePipeline takes by default, the others are never
            trained (an ImageFolder counts each as a sample). The manifest's
            ``created_by.several_images`` lists the same.
        tokens: a token conversion's (``feedpipe shard --tokenizer``) tokens in the dataset.
        tokens_per_s: the tokens this run wrote over ``seconds``.
        bad_records: a token conversion's bad records left out, by kind.

    Example:
        >>> import tempfile, pathlib
        >>> from feedpipe import shard
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "src").mkdir(), (d / "src" / "a.txt").write_text("hi")
        >>> s = shard(str(d / "src"), str(d / "out"), workers=1)
        >>> s.shards, s.samples, s.method, s.executor
        (1, 1, 'general', 'in this process, one worker')
        >>> print(s.why)  # doctest: +ELLIPSIS
        one pass gave the tree back: files at the top of the tree ...
        >>> sorted(s.to_dict())[:3]
        ['bad_records', 'bytes', 'columns']
    """

    out: str
    shards: int
    samples: int
    files: int
    bytes: int
    skipped: int
    reused_shards: int
    seconds: float
    files_per_s: float
    mb_per_s: float
    skipped_inputs: list[dict[str, str]] = field(default_factory=list)
    part: str | None = None
    merged: bool = False
    method: str = "general"
    executor: str = ""
    why: str = ""
    columns: list[str] = field(default_factory=list)
    several_images: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    tokens_per_s: float = 0.0
    bad_records: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (``feedpipe shard --json``)."""
        return asdict(self)
