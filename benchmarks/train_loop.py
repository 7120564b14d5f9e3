"""The training side of bench_train.py: the models, one training step, the on-device
augmentation of the cached systems, and the measured loop with its figures.

Models: ``resnet50`` (torchvision; bf16 autocast, channels_last, SGD momentum 0.9, as NVIDIA's
and torchvision's ResNet-50 recipes), ``vit_b_16`` (torchvision; bf16 autocast, AdamW, as DeiT and
torchvision's ViT recipes), and ``tiny`` (a four-layer conv net defined here: ``--quick`` on the
CPU, where torchvision may not import). ``torch.compile`` is used where asked and where it works:
a model that fails to compile runs eagerly and the reason is logged and recorded.

A step takes the batch as the system delivered it: ``uint8`` CHW images are normalised on the
device inside the step (every feedpipe path, the synthetic ceiling); float images (torchvision's
recipe normalises on the CPU, DALI's crop_mirror_normalize on the GPU) are used as they are.
The cached systems' batches (decoded once, centre-cropped) get their random-resized crop, flip
and normalisation on the device in the step (:func:`gpu_augment`): step time, not data wait.

The loop (:func:`measure`) times ``steps`` steps after ``warmup`` untimed ones. On CUDA it records
an event before asking the system for the next batch and one after it is handed over; the GPU
time between the two (the stream idle for lack of data, or waiting on the data's copy) summed
over the steps, divided by the GPU time of the whole window, is the data-wait fraction: measured
on the device with CUDA events, read once the window is over, never synchronising inside it.
On the CPU the same two points are wall-clock times and the figure is labelled so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("bench_train")
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class TinyNet(nn.Module):
    """A small conv net for ``--quick``: the loop's shape with little compute."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, 2, 1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(name: str, classes: int, device: torch.device) -> tuple[nn.Module, Any, bool]:
    """``(model, optimizer, channels_last)`` on ``device``."""
    if name == "tiny":
        model: nn.Module = TinyNet(classes)
        channels_last = False
    else:
        import torchvision

        model = getattr(torchvision.models, name)(num_classes=classes)
        channels_last = name.startswith("resnet")
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    fused: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
    opt: torch.optim.Optimizer
    if name == "vit_b_16":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, **fused)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4,
                              **fused)
    return model, opt, channels_last


class Trainer:
    """One training step on a batch as delivered; compiles the forward/backward where it can."""

    def __init__(self, name: str, classes: int, device: torch.device, compile_mode: str) -> None:
        self.device = device
        self.model, self.opt, self.channels_last = build(name, classes, device)
        self.model.train()
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.amp = device.type == "cuda"
        if self.amp:  # fixed input shapes: let cuDNN pick its fastest kernels (the recipes do)
            torch.backends.cudnn.benchmark = True
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.compiled: str = "off"
        self.compile_error: str | None = None
        self._fwd: Callable[[torch.Tensor], torch.Tensor] = self.model
        want = compile_mode == "on" or (compile_mode == "auto" and device.type == "cuda")
        if want:
            self._fwd = torch.compile(self.model)
            self.compiled = "on"
        elif compile_mode == "auto":
            self.compiled = "off (auto: compiled on CUDA only)"

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = (x.float() - self.mean) / self.std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.prepare(x)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = F.cross_entropy(self._fwd(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def warm(self, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> float:
        """Run ``steps`` steps on a fixed batch (compiling on the first); falls back to eager
        with the reason logged when compiling fails. Returns the seconds it took."""
        t0 = time.perf_counter()
        try:
            for _ in range(steps):
                self.step(x, y)
            self.sync()
        except Exception as e:
            if self.compiled != "on":
                raise
            self.compile_error = f"{type(e).__name__}: {str(e)[:500]}"
            log.warning("torch.compile failed, running eagerly: %s", self.compile_error)
            self._fwd, self.compiled = self.model, "fell back to eager"
            self.opt.zero_grad(set_to_none=True)
            for _ in range(steps):
                self.step(x, y)
            self.sync()
        return time.perf_counter() - t0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def gpu_augment(x: torch.Tensor, size: int, gen: torch.Generator, mean: torch.Tensor,
                std: torch.Tensor, scale: tuple[float, float] = (0.25, 1.0)) -> torch.Tensor:
    """Random-resized crop and horizontal flip of a ``uint8`` batch on its device, one
    ``grid_sample`` for the batch (per-sample crops drawn on the device: no host sync), then
    normalised with ``mean``/``std`` (0-255 scale). Returns float images, ``size`` square."""
    n = x.shape[0]
    dev = x.device
    area = torch.empty(n, device=dev).uniform_(*scale, generator=gen)
    logr = torch.empty(n, device=dev).uniform_(-0.2877, 0.2877, generator=gen)  # ratio 3/4..4/3
    ratio = torch.exp(logr)
    sw = torch.sqrt(area * ratio).clamp(max=1.0)
    sh = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = (torch.rand(n, device=dev, generator=gen) * 2 - 1) * (1 - sw)
    cy = (torch.rand(n, device=dev, generator=gen) * 2 - 1) * (1 - sh)
    flip = torch.where(torch.rand(n, device=dev, generator=gen) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3, device=dev)
    theta[:, 0, 0] = sw * flip
    theta[:, 0, 2] = cx
    theta[:, 1, 1] = sh
    theta[:, 1, 2] = cy
    grid = F.affine_grid(theta, [n, 3, size, size], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="reflection",
                        align_corners=False)
    return (out - mean) / std


class TreeSampler:
    """Peak RSS summed over this process and its children (psutil), CPU time of the tree, and
    peak device memory in use (``cudaMemGetInfo``: DALI's and cuDNN's memory too), sampled on a
    thread every ``interval`` seconds."""

    def __init__(self, device: torch.device, interval: float = 0.2) -> None:
        import psutil

        self.proc = psutil.Process()
        self.cuda = device.type == "cuda"
        self.device = device
        self.interval = interval
        self.peak_rss = 0
        self.peak_gpu_used = 0
        self.peak_procs = 0
        self._dead_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tree(self) -> list[Any]:
        try:
            return [self.proc, *self.proc.children(recursive=True)]
        except Exception:  # noqa: BLE001 - a child may vanish while listed
            return [self.proc]

    def sample(self) -> None:
        procs = self.tree()
        rss = 0
        for p in procs:
            with contextlib.suppress(Exception):  # a child may exit while we read it
                rss += p.memory_info().rss
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_procs = max(self.peak_procs, len(procs))
        if self.cuda:
            try:
                free, total = torch.cuda.mem_get_info(self.device)
            except RuntimeError:  # the device going away at exit
                return
            self.peak_gpu_used = max(self.peak_gpu_used, total - free)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process tree alive now."""
        total = 0.0
        for p in self.tree():
            with contextlib.suppress(Exception):  # a child may exit while we read it
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeSampler:  # noqa: PYI034 - Python 3.10 has no typing.Self
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def measure(batches: Iterator[Any], unpack: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
            trainer: Trainer, warmup: int, steps: int, sampler: TreeSampler,
            augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
            labels: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """Train on ``warmup`` then up to ``steps`` batches of ``batches``; the figures of the
    ``steps`` (fewer when the iterator ends first: ``steps_done`` says how many). ``labels``,
    when given, collects every batch's labels (on the CPU: for the delivery check of --quick)."""
    cuda = trainer.device.type == "cuda"
    seen = 0
    done = 0
    for _ in range(warmup):
        b = next(batches, None)
        if b is None:
            break
        x, y = unpack(b)
        seen += len(y)
        if labels is not None:
            labels.append(y.cpu())
        trainer.step(augment(x) if augment else x, y)
    trainer.sync()
    cpu0, t0 = sampler.cpu_seconds(), time.perf_counter()
    marks: list[tuple[Any, Any]] = []
    wall_wait = 0.0
    start = end = None
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    images = 0
    for _ in range(steps):
        if cuda:
            a = torch.cuda.Event(enable_timing=True)
            a.record()
        w0 = time.perf_counter()
        b = next(batches, None)
        if b is None:
            break
        x, y = unpack(b)
        w1 = time.perf_counter()
        wall_wait += w1 - w0
        if cuda:
            z = torch.cuda.Event(enable_timing=True)
            z.record()
            marks.append((a, z))
        trainer.step(augment(x) if augment else x, y)
        images += len(y)
        if labels is not None:
            labels.append(y.cpu())
        done += 1
    if cuda:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
    t1 = time.perf_counter()
    cpu1 = sampler.cpu_seconds()
    wall = t1 - t0
    out: dict[str, Any] = {"steps_done": done, "images_measured": images,
                           "samples_seen_warmup": seen, "wall_s": wall,
                           "cores_busy": (cpu1 - cpu0) / wall if wall > 0 else None}
    if cuda and done:
        gpu_s = start.elapsed_time(end) / 1e3  # type: ignore[union-attr,arg-type]
        waited = sum(a.elapsed_time(z) for a, z in marks) / 1e3
        out.update(gpu_s=gpu_s, wait_s=waited, wait_fraction=waited / gpu_s,
                   wait_measure="cuda events", images_per_s=images / gpu_s,
                   wall_wait_fraction=wall_wait / wall)
    else:
        out.update(wait_s=wall_wait, wait_fraction=wall_wait / wall if wall > 0 else None,
                   wait_measure="wall clock (CPU)", images_per_s=images / wall if wall else None)
    out["ms_per_step"] = (out.get("gpu_s") or wall) / done * 1e3 if done else None
    return out
