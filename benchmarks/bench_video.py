"""Video clips: ``feedpipe.VideoClips`` against a plain ``torch.utils.data.DataLoader`` over the
video files decoding with PyAV, and with torchcodec where its libraries load.

Corpus: ``--videos`` H.264 MP4s (default 48; seed 0) of 320x240 at 30 frames/s, 90 to 150
frames each, a keyframe every 30 frames, a smooth moving picture with a little noise (what an
encoder sees in real footage, not incompressible noise), written once under ``--root`` as files
in a folder (what the plain loaders read) and as feedpipe shards (``write_samples``; the frame
counts are recorded at shard time).

The clips: ``--clips`` clips of ``--frames`` frames at stride ``--stride`` from each video an
epoch, resized to ``--size`` (square), in batches of ``--batch``. Every system reads the SAME
clips: the plain loaders draw each clip's start with feedpipe's own pure functions of (seed,
epoch, video, clip) (``feedpipe.plan._clips``), from the frame count the container header
states, and the run checks each epoch's ``(video, clip, start)`` set against feedpipe's.

The plain PyAV loader (:class:`PyAVClips`) is what a user would write with care: a map-style
dataset whose ``__getitem__`` opens the file, seeks to the keyframe before the clip's start,
decodes to the clip's last frame and converts the wanted frames with ``frame.to_ndarray(width,
height, format="rgb24")``; a sampler that shuffles every epoch. The torchcodec loader decodes
the same frames with ``VideoDecoder(path).get_frames_at(indices)`` and resizes with
``torch.nn.functional.interpolate`` (bilinear). torch runs one thread a process in every system
(the machine is shared).

feedpipe's clips (:class:`feedpipe.VideoClip`) are the same frames in the same pixels as the
plain PyAV loader's (both convert and resize in one pass of FFmpeg's bilinear scaler, so no
tolerance is needed: ``tests/test_video_decode.py`` and ``tests/test_corpora_videos.py`` compare
exactly). What feedpipe does less of per clip: frames the clip does not keep and no frame refers
to are not decoded (``skip_frame="NONREF"`` packet by packet), each thread reuses one scaler
(``to_ndarray(width=, height=)`` makes a new one per frame), frame numbers are computed in
integers, and the videos come out of mapped shards.

Each (system, workers) runs in a fresh interpreter, ``--epochs`` epochs (the first with the
workers' start), ``--passes`` passes in alternating order. Reported: steady clips/s (median of
epochs 2..N), the first epoch's, peak RSS of the process tree (each process's high-water mark
summed over the processes alive at once, ``peer_memory.PeakMemory``), and whether every epoch
held each (video, clip) exactly once with the same starts as feedpipe's. The figure to read:
feedpipe's steady clips/s over the best other system's at the same workers, median over passes,
with the load average beside it.

Usage::

    python benchmarks/bench_video.py [--videos 48] [--clips 2] [--frames 8] [--stride 4]
        [--size 112] [--batch 8] [--epochs 3] [--passes 3] [--root DIR] [--name bench_video]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import (  # noqa: E402  (beside this script)
    RESULTS,
    alternating,
    default_root,
    emit,
    environment,
    finish,
    fmt,
    load_spec,
    median,
    run_worker,
    spread,
    table,
)

SYSTEMS = ("feedpipe", "pyav", "torchcodec")
WORKERS = (0, 2)
SEED = 0


def _video(n: int, rng: np.random.Generator) -> bytes:
    import av

    w, h = 320, 240
    base = rng.integers(0, 256, size=(h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
    import cv2

    big = cv2.resize(base, (w + 64, h + 64), interpolation=cv2.INTER_CUBIC)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"g": "30", "preset": "veryfast", "crf": "26"}
        for i in range(n):
            dx, dy = i % 64, (i // 2) % 64
            img = big[dy:dy + h, dx:dx + w].copy()
            img[:: 7, :: 5] ^= np.uint8(i & 7)  # a little noise
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def make_corpus(root: str, n: int) -> dict[str, Any]:
    import feedpipe

    folder, shards = os.path.join(root, f"files-{n}"), os.path.join(root, f"shards-{n}")
    if not os.path.exists(os.path.join(shards, "manifest.json")):
        os.makedirs(folder, exist_ok=True)
        rng = np.random.default_rng(SEED)
        samples = []
        for i, frames in enumerate(rng.integers(90, 151, size=n).tolist()):
            data = _video(int(frames), rng)
            with open(os.path.join(folder, f"{i:06d}.mp4"), "wb") as f:
                f.write(data)
            samples.append({"__key__": f"{i:06d}", "mp4": data})
        feedpipe.write_samples(samples, shards, max_samples=16)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return {"folder": folder, "shards": shards, "videos": n, "bytes": size}


# -- the plain loaders ------------------------------------------------------------------------
class EpochSampler:
    """Every (video, clip) once an epoch, shuffled with ``seed + epoch``; yields ``(epoch,
    index)`` so a worker process knows the epoch without ``set_epoch`` reaching it."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        rng = np.random.default_rng(SEED + self.epoch)
        return iter([(self.epoch, int(i)) for i in rng.permutation(self.n)])

    def __len__(self) -> int:
        return self.n


class PyAVClips:
    """A map-style dataset: ``(epoch, video * clips + clip)`` -> ``(frames [T, 3, H, W] uint8,
    video, clip, start)``, decoded with PyAV."""

    def __init__(self, files: list[str], spec: dict[str, Any]) -> None:
        self.files, self.k, self.s = files, spec["frames"], spec["stride"]
        self.clips, self.size = spec["clips"], spec["size"]

    def __len__(self) -> int:
        return len(self.files) * self.clips

    def _start(self, epoch: int, v: int, c: int, total: int) -> int:
        from feedpipe.plan._clips import clip_draw, clip_start

        return clip_start(total, (self.k - 1) * self.s + 1, self.clips, c,
                          clip_draw(SEED, epoch, v, c))

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, int, int, int]:
        import av
        import torch

        epoch, g = key
        v, c = divmod(g, self.clips)
        with av.open(self.files[v]) as box:
            st = box.streams.video[0]
            start = self._start(epoch, v, c, int(st.frames))
            want = [start + t * self.s for t in range(self.k)]
            rate, tb, t0 = st.average_rate, st.time_base, st.start_time or 0
            if start:
                box.seek(t0 + int(start / rate / tb), stream=st, backward=True)
            got: dict[int, np.ndarray] = {}
            for f in box.decode(st):
                i = int(round((f.pts - t0) * tb * rate))
                if i in want:
                    got[i] = f.to_ndarray(width=self.size, height=self.size, format="rgb24")
                if i >= want[-1]:
                    break
        last = max(got)
        rows = [got.get(i, got[last]) for i in want]
        return torch.from_numpy(np.stack(rows).transpose(0, 3, 1, 2).copy()), v, c, start


class TorchCodecClips(PyAVClips):
    """The same clips decoded by torchcodec's ``VideoDecoder`` and resized by torch."""

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, int, int, int]:
        import torch
        from torchcodec.decoders import VideoDecoder

        epoch, g = key
        v, c = divmod(g, self.clips)
        dec = VideoDecoder(self.files[v], num_ffmpeg_threads=1)
        total = int(dec.metadata.num_frames)
        start = self._start(epoch, v, c, total)
        want = [min(start + t * self.s, total - 1) for t in range(self.k)]
        frames = dec.get_frames_at(indices=want).data  # [T, 3, H, W] uint8
        out = torch.nn.functional.interpolate(frames.float(), size=(self.size, self.size),
                                              mode="bilinear", antialias=True)
        return out.round().clamp(0, 255).to(torch.uint8), v, c, start


def plain(spec: dict[str, Any]) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader

    folder = spec["folder"]
    files = [os.path.join(folder, f) for f in sorted(os.listdir(folder))]
    cls = TorchCodecClips if spec["system"] == "torchcodec" else PyAVClips
    ds = cls(files, spec)
    if spec["system"] == "torchcodec":
        ds[(0, 0)]  # loads torchcodec's libraries here: a failure is this system's error
    sampler = EpochSampler(len(ds))
    kw: dict[str, Any] = {"persistent_workers": True} if spec["workers"] else {}
    return DataLoader(ds, batch_size=spec["batch"], sampler=sampler,
                      num_workers=spec["workers"], **kw), sampler


def ours(spec: dict[str, Any]) -> tuple[Any, Any]:
    import feedpipe

    src = feedpipe.VideoClips(spec["shards"], frames=spec["frames"], stride=spec["stride"],
                              clips_per_video=spec["clips"], size=(spec["size"], spec["size"]),
                              seed=SEED)
    kw: dict[str, Any] = {"persistent_workers": True} if spec["workers"] else {}
    loader = feedpipe.FeedLoader(src, batch_size=spec["batch"], num_workers=spec["workers"],
                                 **kw)
    return loader, loader


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and its live children (the workers)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child that ended between the listing and the reading
            pass
    return total


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from peer_memory import PeakMemory

    torch.set_num_threads(1)
    with PeakMemory() as mem:
        loader, epochs_of = (ours if spec["system"] == "feedpipe" else plain)(spec)
        epochs = []
        for e in range(spec["epochs"]):
            epochs_of.set_epoch(e)
            c0 = _tree_cpu_s()
            t0 = time.perf_counter()
            seen: list[list[int]] = []
            shape = None
            for b in loader:
                if isinstance(b, dict):
                    fr, v, c, s = b["frames"], b["video"], b["clip"], b["start"]
                else:
                    fr, v, c, s = b
                shape = list(fr.shape[1:])
                seen += [[int(x), int(y), int(z)] for x, y, z in zip(v, c, s)]
            wall = time.perf_counter() - t0
            cpu = _tree_cpu_s() - c0  # workers that live on (persistent) are counted
            pairs = {(v, c) for v, c, _ in seen}
            epochs.append({"clips": len(seen), "wall_s": wall, "clips_per_s": len(seen) / wall,
                           "cpu_s": cpu, "cpu_ms_per_clip": 1e3 * cpu / max(1, len(seen)),
                           "exactly_once": len(pairs) == len(seen)
                           == spec["videos"] * spec["clips"],
                           "clip_shape": shape, "starts": sorted(seen)})
    return {"epochs": epochs, "memory": mem.result()}


def _same_clips(run: dict[str, Any], w: int) -> None:
    """Mark each system's epochs whose (video, clip, start) set differs from feedpipe's."""
    ref = run["results"].get(f"feedpipe, {w} workers")
    for name, res in run["results"].items():
        if name.endswith(f", {w} workers"):
            res["same_clips_as_feedpipe"] = None if ref is None else all(
                a["starts"] == b["starts"] for a, b in zip(res["epochs"], ref["epochs"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--videos", type=int, default=48)
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)),
                    help="the worker counts to run, comma-separated")
    ap.add_argument("--root", default=default_root("video"))
    ap.add_argument("--name", default="bench_video")
    a = ap.parse_args()
    if a.worker:
        emit(worker(load_spec(a.worker)))
        return 0
    t_start = time.perf_counter()
    os.makedirs(a.root, exist_ok=True)
    corpus = make_corpus(a.root, a.videos)
    clip = {k: getattr(a, k) for k in ("clips", "frames", "stride", "size", "batch", "epochs")}
    doc: dict[str, Any] = {"benchmark": a.name, "environment": environment(a.root),
                           "args": {k: v for k, v in vars(a).items() if k != "worker"},
                           "corpus": corpus, "passes": [], "errors": []}
    systems = a.systems.split(",")
    workers = [int(w) for w in a.workers.split(",")]
    configs = [f"{s}, {w} workers" for w in workers for s in systems]
    failed = False
    unavailable: dict[str, str] = {}
    for p in range(a.passes):
        run: dict[str, Any] = {"order": alternating(configs, p), "results": {}}
        for name in run["order"]:
            system, w = name.split(", ")[0], int(name.split(", ")[1].split()[0])
            if system in unavailable:
                continue
            res = run_worker(__file__, {**corpus, **clip, "system": system, "workers": w})
            if "error" in res:
                why = res.get("stderr_tail", "").strip().splitlines()
                if system == "torchcodec":  # said once, never counted as a loss of feedpipe's
                    unavailable[system] = why[-1] if why else res["error"]
                    print(f"torchcodec does not run here: {unavailable[system]}")
                    continue
                failed = True
                doc["errors"].append({"pass": p, "config": name, **res})
                print(f"pass {p} {name}: FAILED {res['error']}\n{res.get('stderr_tail', '')}")
                continue
            ep = res["epochs"]
            res["steady_clips_per_s"] = median(e["clips_per_s"] for e in ep[1:])
            res["steady_cpu_ms_per_clip"] = median(e["cpu_ms_per_clip"] for e in ep[1:])
            res["all_exactly_once"] = all(e["exactly_once"] for e in ep)
            run["results"][name] = res
            print(f"pass {p} {name}: steady {fmt(res['steady_clips_per_s'], 1)} clips/s "
                  f"({fmt(res['steady_cpu_ms_per_clip'], 2)} CPU ms a clip), first "
                  f"epoch {fmt(ep[0]['clips_per_s'], 1)}, peak RSS "
                  f"{res['memory']['peak_rss_bytes'] / 2**20:.0f} MiB, exactly once: "
                  f"{res['all_exactly_once']}")
        run["loadavg"] = list(os.getloadavg())
        run["ratio"] = {}
        for w in workers:
            _same_clips(run, w)
            f = run["results"].get(f"feedpipe, {w} workers")
            others = [run["results"][f"{s}, {w} workers"]["steady_clips_per_s"]
                      for s in systems if s != "feedpipe"
                      and f"{s}, {w} workers" in run["results"]]
            if f and others:
                run["ratio"][f"{w} workers"] = f["steady_clips_per_s"] / max(others)
        for res in run["results"].values():
            for e in res["epochs"]:
                e["starts"] = len(e["starts"])  # checked; the JSON keeps the count
        doc["passes"].append(run)
    doc["unavailable"] = unavailable
    rows, summary = [], {}
    for name in configs:
        got = [r["results"][name] for r in doc["passes"] if name in r["results"]]
        if not got:
            continue
        key = name.split(", ")[1]
        ratios = [r["ratio"][key] for r in doc["passes"] if key in r["ratio"]]
        ours_ = name.startswith("feedpipe")
        s = summary[name] = {
            "steady_clips_per_s": median(g["steady_clips_per_s"] for g in got),
            "steady_cpu_ms_per_clip": median(g["steady_cpu_ms_per_clip"] for g in got),
            "feedpipe_over_best_other_per_pass": ratios if ours_ else None,
            "first_epoch_clips_per_s": median(g["epochs"][0]["clips_per_s"] for g in got),
            "peak_rss_mib": median(g["memory"]["peak_rss_bytes"] / 2**20 for g in got),
            "exactly_once_every_epoch": all(g["all_exactly_once"] for g in got),
            "same_clips_as_feedpipe": all(g.get("same_clips_as_feedpipe") for g in got),
            "feedpipe_over_best_other": median(ratios) if ours_ else None,
            "feedpipe_over_best_other_spread": spread(ratios) if ours_ else None}
        rows.append([name, fmt(s["steady_clips_per_s"], 1), fmt(s["steady_cpu_ms_per_clip"], 2),
                     fmt(s["first_epoch_clips_per_s"], 1),
                     f"{s['peak_rss_mib']:.0f}", str(s["exactly_once_every_epoch"]),
                     str(s["same_clips_as_feedpipe"]), fmt(s["feedpipe_over_best_other"], 2)])
    doc["summary"] = summary
    loads = [r["loadavg"][0] for r in doc["passes"]]
    per_pass = "; ".join(
        f"{k}: " + ", ".join(fmt(r["ratio"][k], 2) if k in r["ratio"] else "-"
                             for r in doc["passes"])
        for k in [f"{w} workers" for w in workers])
    text = [table(rows, ["configuration", "steady clips/s", "CPU ms/clip", "first epoch clips/s",
                         "peak RSS MiB", "exactly once", "same clips", "feedpipe / best other"]),
            f"\n\nload average (1 min) after each pass: {', '.join(f'{x:.1f}' for x in loads)}"
            f"; {corpus['videos']} H.264 videos 320x240 ({corpus['bytes'] / 2**20:.1f} MiB), "
            f"{a.clips} clips of {a.frames} frames at stride {a.stride} each, {a.size}x{a.size},"
            f" batch {a.batch}\nfeedpipe / best other per pass (steady clips/s, passes in "
            f"alternating order): {per_pass}\n"]
    for s, why in unavailable.items():
        text.append(f"{s}: not measured, it does not load here: {why}\n")
    print("".join(text))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{a.name}.md"), "w", encoding="utf-8") as f:
        f.write(f"# {a.name}\n\n{__doc__.split(chr(10) + chr(10))[0]}\n\n```\n{''.join(text)}"
                "```\n")
    return finish(a.name, doc, text, [], failed, t_start)


if __name__ == "__main__":
    sys.exit(main())
