"""Video clips decoded by DALI (``VideoClips(decoder="dali")`` + ``DaliVideoStage``) from the same
plan as PyAV's: on the CPU here (DALI's CPU video decoder reads VP9 WebM), compared clip for clip
with ``decoder="pyav"`` and with decoding each file plainly with PyAV; every clip once over
epochs read by real worker processes, proved by the ledger; mid-epoch resume through the stage;
the errors for a codec the CPU decoder cannot read, a GPU asked for where there is none, and
DALI missing. The GPU tests ("mixed" NVDEC decoding of H.264) run where CUDA is, and are skipped
with the reason elsewhere."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("av")

from _videos import make_video, reference_frames  # noqa: E402

import feedpipe  # noqa: E402
from feedpipe import (  # noqa: E402
    DaliVideoStage,
    DecodeError,
    FeedLoader,
    VideoClip,
    VideoClips,
    check_ledger,
)
from feedpipe._helpers import fork_safety  # noqa: E402
from feedpipe.errors import MissingDependencyError  # noqa: E402
from feedpipe.transforms._dali_video_host import DaliClipPlan, host_plan  # noqa: E402

pytestmark = pytest.mark.dali

SIZE = (24, 32)  # (height, width) the clips are resized to
LENGTHS = [32, 20, 32, 6]  # v3 is shorter than a clip: padded with its last frame
KW: dict[str, Any] = {"frames": 4, "stride": 3, "clips_per_video": 2, "size": SIZE, "seed": 5}
ALL = Counter((v, c) for v in range(len(LENGTHS)) for c in range(2))
# DALI's YUV->RGB conversion and resize against FFmpeg's scaler: the same frames differ by a
# few levels on average (up to ~50 on the sharp edge of the green bar, chroma upsampled
# differently); a frame apart differs by 21 levels of red everywhere
MEAN_DIFF = 3.0
GPU = torch.cuda.is_available()


def _dali_importable() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:
        return False


needs_dali = pytest.mark.skipif(not _dali_importable(), reason="nvidia.dali cannot be imported")
needs_gpu = pytest.mark.skipif(not GPU, reason="no CUDA device: DALI's 'mixed' (NVDEC) video "
                               "decoder needs one")


@pytest.fixture
def dali(monkeypatch: pytest.MonkeyPatch) -> object:
    """DALI, imported (or the test skipped); the process's fork-unsafe mark a built pipeline
    leaves is undone after the test (as in tests/test_dali.py)."""
    monkeypatch.setattr(fork_safety, "_marks", [])
    return pytest.importorskip("nvidia.dali", reason="nvidia.dali cannot be imported")


def _dataset(root: Path, ext: str, width: int = 64, height: int = 48
             ) -> tuple[str, dict[str, bytes]]:
    src = root / "src"
    src.mkdir()
    data = {f"v{i}": make_video(n, ext, width=width, height=height)
            for i, n in enumerate(LENGTHS)}
    for k, b in data.items():
        (src / f"{k}.{ext}").write_bytes(b)
    feedpipe.shard(str(src), str(root / "out"), max_samples=2, workers=1)
    return str(root / "out"), data


@pytest.fixture(scope="module")
def webm(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    """Four VP9 WebM videos (one of 6 frames), 2 per shard: (dataset, bytes by key)."""
    return _dataset(tmp_path_factory.mktemp("webm"), "webm")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    """The same videos as H.264 MP4."""
    return _dataset(tmp_path_factory.mktemp("mp4"), "mp4")


def _clips(batches: Any) -> dict[tuple[int, int], dict[str, Any]]:
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for b in batches:
        for j in range(len(b["video"])):
            c = {k: b[k][j] for k in ("frames", "video", "clip", "start", "padded", "__key__")}
            key = (int(c["video"]), int(c["clip"]))
            assert key not in out, f"clip {key} came twice"
            out[key] = c
    return out


def _check_same_clips(dali_clips: dict, pyav_clips: dict, data: dict[str, bytes]) -> None:
    """The same clips (start, padding, frame numbers) as PyAV's path, pixels close to it and to
    each file decoded plainly with PyAV."""
    assert dali_clips.keys() == pyav_clips.keys() == ALL.keys()
    refs = {k: reference_frames(b, SIZE) for k, b in data.items()}
    for key, d in dali_clips.items():
        p = pyav_clips[key]
        assert (int(d["start"]), int(d["padded"]), d["__key__"]) == (
            int(p["start"]), int(p["padded"]), p["__key__"]), key
        got = d["frames"].cpu()
        assert got.dtype == torch.uint8 and tuple(got.shape) == (4, 3, *SIZE)  # [T, C, H, W]
        ref = refs[d["__key__"]]
        want = [min(int(d["start"]) + 3 * t, len(ref) - 1) for t in range(4)]
        # frame i is red 7 i: DALI decoded the frames the plan names, not merely similar ones
        red = got[:, 0].float().mean(dim=(1, 2)).numpy()
        assert np.allclose(red, [7 * w for w in want], atol=4), (key, red, want)
        for other in (p["frames"].numpy(), ref[want]):
            diff = np.abs(got.numpy().astype(np.int16) - other.astype(np.int16))
            assert diff.mean() <= MEAN_DIFF, (key, float(diff.mean()))


# -- without DALI or without a GPU: the errors ------------------------------------------------
def test_the_decoder_option_is_checked(webm: tuple[str, dict[str, bytes]]) -> None:
    out, _ = webm
    with pytest.raises(ValueError, match="'pyav'.*'dali'"):
        VideoClips(out, frames=2, decoder="torchcodec")
    with pytest.raises(ValueError, match="transform"):
        VideoClips(out, frames=2, decoder="dali", transform=lambda x: x)
    with pytest.raises(ValueError, match="decoded store keeps clips PyAV decoded"):
        host_plan("dali", VideoClip(2), cache=object(), transform=None)
    with pytest.raises(TypeError, match="batch_size"):
        DaliVideoStage([], device_id=None)


def test_a_gpu_asked_for_where_there_is_none_is_named(webm: tuple[str, dict[str, bytes]],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without
    out, _ = webm
    stage = DaliVideoStage(FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3),
                           device_id=0)
    with pytest.raises(MissingDependencyError, match=r"CUDA device 0.*0 CUDA device\(s\).*"
                       r"device_id=None.*decoder='pyav'"):
        next(iter(stage))


def test_h264_on_dalis_cpu_decoder_is_refused_naming_the_video(
        mp4: tuple[str, dict[str, bytes]]) -> None:
    out, _ = mp4
    stage = DaliVideoStage(FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3),
                           device_id=None)
    with pytest.raises(DecodeError, match=r"sample 'v\d' in '.*\.tar' is h264, which DALI's CPU "
                       r"video decoder cannot read \(it reads mjpeg, vp8, vp9\)"):
        next(iter(stage))


def test_missing_dali_raises_with_the_pip_line(webm: tuple[str, dict[str, bytes]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "nvidia.dali" or m.startswith("nvidia.dali.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali -> ImportError
    out, _ = webm
    stage = DaliVideoStage(FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3),
                           device_id=None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'feedpipe\[dali\]'"):
        next(iter(stage))


@pytest.mark.slow  # a fresh interpreter importing torch
def test_import_feedpipe_and_the_stage_import_no_dali() -> None:
    code = ("import sys, feedpipe; feedpipe.VideoClips; feedpipe.DaliVideoStage; "
            "assert not [m for m in sys.modules if m.startswith('nvidia')], 'DALI imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.integers(1, 6), stride=st.integers(1, 7), clips=st.integers(1, 3),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 50), video=st.integers(0, 3))
def test_the_host_plan_names_the_frames_pyav_decodes(
        webm: tuple[str, dict[str, bytes]], frames: int, stride: int, clips: int, seed: int,
        epoch: int, video: int) -> None:
    """What decoder="dali" feeds DALI (start, frame numbers, padding) is, for any clip of the
    plan, what decoder="pyav" decodes: frame i of these videos is red 7 i."""
    _, data = webm
    key = f"v{video}"
    clip = VideoClip(frames, stride=stride, clips=clips, size=SIZE)
    for c in range(clips):
        sample = {"webm": data[key], "__key__": key, "__video__": video, "__clip__": c,
                  "__seed__": seed, "__epoch__": epoch}
        planned, decoded = DaliClipPlan(clip)(dict(sample)), clip(dict(sample))
        assert (planned["start"], planned["padded"]) == (decoded["start"], decoded["padded"])
        ids = planned["__frame_ids__"]
        assert ids.tolist() == np.minimum(clip.wanted(decoded["start"], 8.0),
                                          LENGTHS[video] - 1).tolist()
        red = decoded["frames"][:, 0].float().mean(dim=(1, 2)).numpy()
        assert np.allclose(red, 7 * ids, atol=4)


# -- DALI on the CPU --------------------------------------------------------------------------
@needs_dali
def test_cpu_clips_are_pyavs_clips(dali: object, webm: tuple[str, dict[str, bytes]]) -> None:
    out, data = webm
    pyav = _clips(FeedLoader(VideoClips(out, **KW), batch_size=3))
    loader = FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3)
    stage = DaliVideoStage(loader, device_id=None)
    batches = list(stage)
    assert len(batches) == len(stage) == 3  # 8 clips, 3 a batch: the last of 2
    assert set(batches[0]) == {"frames", "start", "video", "clip", "padded", "__key__"}
    assert tuple(batches[0]["frames"].shape) == (3, 4, 3, *SIZE)
    assert batches[0]["frames"].device.type == "cpu"
    got = _clips(batches)
    assert [int(got[k]["padded"]) for k in ((3, 0), (3, 1))] == [2, 2]  # 6 frames: 6, 9 past
    _check_same_clips(got, pyav, data)


@needs_dali
@pytest.mark.parametrize("how", ["fps", "all"])
def test_cpu_clips_at_a_frame_rate_or_all_that_fit_are_pyavs(
        dali: object, webm: tuple[str, dict[str, bytes]], how: str) -> None:
    out, _ = webm
    if how == "fps":
        kw = {**KW, "stride": 1, "fps": 4.0}  # 8 frames/s at 4: every other frame
    else:  # each video's own count of clips, from the frame counts recorded at shard time
        kw = {**KW, "clips_per_video": "all"}
    pyav = _clips(FeedLoader(VideoClips(out, **kw), batch_size=4))
    got = _clips(DaliVideoStage(FeedLoader(VideoClips(out, decoder="dali", **kw),
                                           batch_size=4), device_id=None))
    assert got.keys() == pyav.keys()
    if how == "all":  # 32 frames: 3 clips of 10; 20: 2; 6: 1
        assert len(got) == 3 + 2 + 3 + 1
    for key, d in got.items():
        assert int(d["start"]) == int(pyav[key]["start"])
        red = d["frames"][:, 0].float().mean(dim=(1, 2))
        assert torch.allclose(red, pyav[key]["frames"][:, 0].float().mean(dim=(1, 2)), atol=4)


@needs_dali
@pytest.mark.slow
def test_every_clip_once_per_epoch_from_worker_processes_with_the_ledger(
        dali: object, webm: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    out, _ = webm
    # DALI's threads run in this process: the workers start from a forkserver
    loader = FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3, num_workers=2,
                        multiprocessing_context="forkserver", ledger=tmp_path / "l")
    stage = DaliVideoStage(loader, device_id=None)
    got = []
    for e in range(2):
        stage.set_epoch(e)
        got.append(Counter((int(v), int(c)) for b in stage for v, c in zip(b["video"], b["clip"])))
    pids = loader.stats()["worker_pids"]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert got == [ALL, ALL]
    r = check_ledger(tmp_path / "l")
    assert r["ok"] and [e["exactly_once"] for e in r["epochs"]] == [True, True]


@needs_dali
def test_resume_mid_epoch_through_the_stage_gives_exactly_the_rest(
        dali: object, webm: tuple[str, dict[str, bytes]]) -> None:
    out, _ = webm

    def make() -> DaliVideoStage:
        return DaliVideoStage(FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3),
                              device_id=None)

    def starts(batches: Any) -> list[tuple[int, int, int]]:
        return [(int(v), int(c), int(s)) for b in batches
                for v, c, s in zip(b["video"], b["clip"], b["start"])]

    full = starts(make())
    stage = make()
    it = iter(stage)
    first = [next(it)]
    state = stage.state_dict()
    it.close()
    assert state["kind"] == "video-clips" and state["position"] == 3
    again = make()
    again.load_state_dict(state)
    assert starts(first) + starts(again) == full


@needs_dali
def test_a_video_that_cannot_be_read_is_named_or_skipped_as_pyav_does(
        dali: object, tmp_path: Path) -> None:
    good = make_video(16, "webm")
    with feedpipe.ShardWriter(str(tmp_path / "bad")) as w:
        w.write({"__key__": "good", "webm": good})
        w.write({"__key__": "junk", "webm": good[:200] + bytes(len(good) - 200)})

    def stage(on_error: str) -> DaliVideoStage:
        clips = VideoClips(str(tmp_path / "bad"), frames=2, size=(12, 16), on_error=on_error,
                           decoder="dali")
        return DaliVideoStage(FeedLoader(clips, batch_size=1), device_id=None)

    with pytest.raises(DecodeError, match=r"sample 'junk' in '.*\.tar' cannot be read"):
        list(stage("raise"))
    skipping = stage("skip")
    assert [k for b in skipping for k in b["__key__"]] == ["good"]
    assert skipping.batches.stats()["skipped"] == 1  # type: ignore[attr-defined]


def _planned(data: bytes, ids: list[int], key: str = "k") -> dict[str, Any]:
    """A batch of one clip as VideoClips(decoder="dali") plans it."""
    return {"__key__": [key], "__shard__": ["s.tar"], "__encoded__": [data],
            "__codec__": ["vp9"], "__size__": torch.tensor([[12, 16]]),
            "__frame_ids__": torch.tensor([ids]), "start": torch.tensor([ids[0]])}


def _red(batch: dict[str, Any]) -> list[int]:
    return [round(float(r)) for r in batch["frames"][0, :, 0].float().mean(dim=(1, 2))]


@needs_dali
def test_a_video_dali_fails_on_is_named_and_the_next_batch_decodes(dali: object) -> None:
    """DALI stops its pipeline on a video it cannot decode: the stage names the batch's videos
    and builds a new pipeline for the next batch."""
    good = make_video(16, "webm")
    stage = DaliVideoStage([], batch_size=2, device_id=None)
    with pytest.raises(DecodeError, match=r"DALI could not decode .*\('cut', 's.tar'\)"):
        stage.decode(_planned(good[: len(good) // 3], [1, 2], key="cut"))
    assert _red(stage.decode(_planned(good, [1, 2]))) == [7, 14]
    # a frame past those the video holds (a header that says more): its last frame, as PyAV
    assert _red(stage.decode(_planned(good, [14, 40]))) == [98, 105]


# -- DALI on a GPU ("mixed": NVDEC) -----------------------------------------------------------
@needs_dali
@needs_gpu
@pytest.mark.parametrize("ext", ["mp4", "webm"])
def test_gpu_clips_are_pyavs_clips(dali: object, ext: str, tmp_path: Path) -> None:
    # 160x128: above NVDEC's smallest frame (128x128 for VP9)
    out, data = _dataset(tmp_path, ext, width=160, height=128)
    pyav = _clips(FeedLoader(VideoClips(out, **KW), batch_size=3))
    stage = DaliVideoStage(FeedLoader(VideoClips(out, decoder="dali", **KW), batch_size=3),
                           device_id=0)
    batches = list(stage)
    assert batches[0]["frames"].device == torch.device("cuda", 0)
    _check_same_clips(_clips(batches), pyav, data)
