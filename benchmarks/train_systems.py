"""The data systems bench_train.py trains with, each in its documented best setup for N cores,
all reading the same JPEGs (train_data.py) and delivering batches of ``batch`` images of
``size`` x ``size`` with their labels to the training device.

    synthetic        (a) one random uint8 batch made on the device once and handed out again:
                     the ceiling, no data work at all
    torchvision      (b) torchvision's ImageFolder + DataLoader(shuffle, num_workers=N,
                     pin_memory=True, persistent_workers=True), RandomResizedCrop + flip +
                     ToTensor + Normalize in the workers (torchvision's reference recipe), copied
                     with .to(device, non_blocking=True). Where torchvision does not import
                     (the CPU machine), the same DataLoader over the same files with a Pillow
                     decode and the same crop, flip and normalise (peer_systems.PILTrainTransform)
                     runs instead, named "files-pil"
    dali             (c) DALI's own ResNet-50 training pipeline (its examples/use_cases/pytorch/
                     resnet50): fn.readers.file(random_shuffle) over the image folder,
                     fn.decoders.image_random_crop on "mixed" (nvJPEG), fn.resize,
                     fn.crop_mirror_normalize (float, CHW, mirror coin flip), num_threads=N,
                     DALIClassificationIterator. DALI's CPU backend where there is no GPU
    feedpipe         (d) FeedDataset(shuffle, ImagePipeline(train, uint8)) +
                     FeedLoader(num_workers=N, BatchCollator, device=..., persistent_workers):
                     decode in worker processes into shared batch rows, pinned side-stream copy by
                     DeviceLoader
    feedpipe-dali    (e) FeedLoader of raw JPEG bytes (4 workers, persistent) feeding
                     feedpipe.DaliStage(ImageSpec(train, uint8), num_threads=N): nvJPEG decode of
                     feedpipe's planned batches
    feedpipe-store   (f) FeedDataset(decoded_cache=...) with the deterministic ImagePipeline
                     (decode + centre crop + resize, uint8): epoch 0 fills the store (not
                     trained on), epoch 1 is measured; random-resized crop + flip on the device
    feedpipe-cache   (f) DeviceCache.warmup(FeedDataset, the same deterministic transform,
                     num_workers=N), then DeviceCache.batches(FeedDataset(shuffle)) by on-device
                     gather; random-resized crop + flip on the device

Only feedpipe's public names are used (``feedpipe.FeedDataset``, ``FeedLoader``, ``DeviceCache``,
``ImagePipeline``, ``ImageSpec``, ``BatchCollator``, ``DaliStage``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

SYSTEMS = ("synthetic", "torchvision", "dali", "feedpipe", "feedpipe-dali", "feedpipe-store",
           "feedpipe-cache")
QUICK_SYSTEMS = ("synthetic", "torchvision", "feedpipe", "feedpipe-store", "feedpipe-cache")
FEEDPIPE = ("feedpipe", "feedpipe-dali", "feedpipe-store", "feedpipe-cache")


class Context:
    """What every system is built from (one worker's spec)."""

    def __init__(self, spec: dict[str, Any], device: torch.device) -> None:
        self.images: str = spec["images"]
        self.shards: str = spec["shards"]
        self.samples: int = spec["samples"]
        self.batch: int = spec["batch"]
        self.size: int = spec["size"]
        self.classes: int = spec["classes"]
        self.workers: int = spec["workers"]
        self.device = device
        self.cuda = device.type == "cuda"
        self.scratch: str = spec["scratch"]


class System:
    """A data system: ``epoch(e)`` iterates epoch ``e``'s batches, ``unpack`` gives the images
    and int64 labels on the device. ``prepare()`` runs once before epoch 0 (counted in the time
    to the first batch); ``fill_epochs`` epochs run untrained before the measured one."""

    name = ""
    setup = ""
    fill_epochs = 0
    augment = False  # random-resized crop + flip on the device, in the step

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    @staticmethod
    def check() -> None:
        """Raise if the system cannot run here (a missing package), before any model is built."""

    def prepare(self) -> dict[str, Any]:
        return {}

    def epoch(self, e: int) -> Iterator[Any]:
        raise NotImplementedError

    def unpack(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = b[0], b[1]
        return x, y

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class Synthetic(System):
    setup = "one random uint8 batch on the device, handed out again (no data work)"

    def __init__(self, ctx: Context) -> None:
        self.name, self.ctx = "synthetic", ctx
        g = torch.Generator().manual_seed(0)
        shape = (ctx.batch, 3, ctx.size, ctx.size)
        self.x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(ctx.device)
        self.y = torch.randint(0, ctx.classes, (ctx.batch,), generator=g).to(ctx.device)

    def epoch(self, e: int) -> Iterator[Any]:
        for a in range(0, self.ctx.samples, self.ctx.batch):
            n = min(self.ctx.batch, self.ctx.samples - a)
            yield self.x[:n], self.y[:n]


class _Normalised:
    """Pillow decode + torchvision's RandomResizedCrop/flip (peer_systems.PILTrainTransform) +
    ToTensor + Normalize: torchvision's training recipe without torchvision."""

    def __init__(self, size: int) -> None:
        from peer_systems import PILTrainTransform

        self.crop = PILTrainTransform(size)
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __call__(self, path: str) -> torch.Tensor:
        from PIL import Image

        with Image.open(path) as im:
            x = self.crop(im.convert("RGB"))
        return (x.float() / 255 - self.mean) / self.std


class _Files(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, root: str, size: int) -> None:
        classes = sorted(d for d in os.listdir(root) if not d.startswith("."))
        self.items = [(os.path.join(root, c, f), i) for i, c in enumerate(classes)
                      for f in sorted(os.listdir(os.path.join(root, c)))]
        self.tf = _Normalised(size)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        return self.tf(path), label


class TorchVision(System):
    def __init__(self, ctx: Context) -> None:
        from torch.utils.data import DataLoader

        self.ctx = ctx
        try:
            import torchvision
            from torchvision import transforms as T

            tf = T.Compose([T.RandomResizedCrop(ctx.size), T.RandomHorizontalFlip(), T.ToTensor(),
                            T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
            ds: Any = torchvision.datasets.ImageFolder(ctx.images, tf)
            self.name = "torchvision"
            self.setup = ("torchvision.datasets.ImageFolder + RandomResizedCrop, "
                          "RandomHorizontalFlip, ToTensor, Normalize; ")
        except (ImportError, RuntimeError) as e:
            ds = _Files(ctx.images, ctx.size)
            self.name = "files-pil"
            self.setup = (f"torchvision does not import ({type(e).__name__}: {e}): a map-style "
                          "Dataset over the same files, Pillow decode + the same crop, flip, "
                          "ToTensor and Normalize; ")
        nw = ctx.workers
        self.loader = DataLoader(ds, batch_size=ctx.batch, shuffle=True, num_workers=nw,
                                 pin_memory=ctx.cuda, persistent_workers=nw > 0)
        self.setup += (f"DataLoader(batch_size={ctx.batch}, shuffle=True, num_workers={nw}, "
                       f"pin_memory={ctx.cuda}, persistent_workers={nw > 0}); "
                       ".to(device, non_blocking=True)")

    def epoch(self, e: int) -> Iterator[Any]:
        return iter(self.loader)

    def unpack(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.ctx.device
        return b[0].to(dev, non_blocking=True), b[1].to(dev, non_blocking=True)


def _check_dali() -> None:
    import nvidia.dali
    import nvidia.dali.plugin.pytorch  # noqa: F401


class Dali(System):
    name = "dali"
    check = staticmethod(_check_dali)

    def __init__(self, ctx: Context) -> None:
        import nvidia.dali
        from nvidia.dali.plugin.pytorch import (
            DALIClassificationIterator,
            LastBatchPolicy,
        )

        self.ctx = ctx
        fn: Any = nvidia.dali.fn
        types: Any = nvidia.dali.types
        pipeline_def: Any = nvidia.dali.pipeline_def
        dev = "mixed" if ctx.cuda else "cpu"
        pad = {"device_memory_padding": 211025920, "host_memory_padding": 140544512} \
            if ctx.cuda else {}
        size = ctx.size

        @pipeline_def(batch_size=ctx.batch, num_threads=max(1, ctx.workers),
                      device_id=(ctx.device.index or 0) if ctx.cuda else None, seed=0,
                      prefetch_queue_depth=2)
        def pipe() -> Any:
            jpegs, labels = fn.readers.file(file_root=ctx.images, random_shuffle=True,
                                            name="Reader")
            img = fn.decoders.image_random_crop(jpegs, device=dev, output_type=types.RGB,
                                                random_area=[0.08, 1.0],
                                                random_aspect_ratio=[0.75, 4 / 3],
                                                num_attempts=100, **pad)
            img = fn.resize(img, resize_x=size, resize_y=size,
                            interp_type=types.INTERP_TRIANGULAR)
            img = fn.crop_mirror_normalize(img, dtype=types.FLOAT, output_layout="CHW",
                                           crop=(size, size),
                                           mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                           std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
                                           mirror=fn.random.coin_flip(probability=0.5))
            return img, (labels.gpu() if ctx.cuda else labels)

        p = pipe()
        p.build()
        self.it = DALIClassificationIterator(p, reader_name="Reader", auto_reset=True,
                                             last_batch_policy=LastBatchPolicy.PARTIAL)
        self.setup = (f"fn.readers.file(random_shuffle=True) + decoders.image_random_crop("
                      f"device={dev!r}) + resize + crop_mirror_normalize(FLOAT, CHW, mirror), "
                      f"num_threads={max(1, ctx.workers)}, prefetch_queue_depth=2, "
                      "DALIClassificationIterator(PARTIAL)")

    def epoch(self, e: int) -> Iterator[Any]:
        return iter(self.it)

    def unpack(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = b[0]["data"]
        y = b[0]["label"].reshape(-1).to(self.ctx.device, torch.int64, non_blocking=True)
        return x.to(self.ctx.device, non_blocking=True), y


def _collator(ctx: Context) -> Any:
    from feedpipe import BatchCollator

    return BatchCollator(ctx.batch, (3, ctx.size, ctx.size))


class _Loader(System):
    """Epochs of a FeedLoader (``set_epoch`` each)."""

    loader: Any

    def epoch(self, e: int) -> Iterator[Any]:
        self.loader.set_epoch(e)
        return iter(self.loader)

    def stats(self) -> dict[str, Any]:
        st = getattr(self.loader, "stats", None)
        return {"loader": st()} if callable(st) else {}


class Feedpipe(_Loader):
    name = "feedpipe"

    def __init__(self, ctx: Context) -> None:
        import feedpipe
        from feedpipe import ImagePipeline

        self.ctx = ctx
        nw = ctx.workers
        ds = feedpipe.FeedDataset(ctx.shards, shuffle=True, seed=0,
                                  transform=ImagePipeline(ctx.size, train=True, mean=None))
        self.loader = feedpipe.FeedLoader(ds, batch_size=ctx.batch, num_workers=nw,
                                          collate_fn=_collator(ctx), device=ctx.device,
                                          persistent_workers=nw > 0)
        self.setup = (f"FeedDataset(shuffle=True, ImagePipeline({ctx.size}, train=True, "
                      f"mean=None)) + FeedLoader(num_workers={nw}, BatchCollator, "
                      f"device={str(ctx.device)!r}, persistent_workers={nw > 0}); uint8 to the "
                      "device, normalised there")


class FeedpipeDali(_Loader):
    name = "feedpipe-dali"
    check = staticmethod(_check_dali)

    def __init__(self, ctx: Context) -> None:
        import feedpipe
        from feedpipe import DaliStage, ImageSpec

        self.ctx = ctx
        nw = min(4, ctx.workers)
        # workers beside DALI's threads must not fork (FeedLoader refuses it): a forkserver
        raw = feedpipe.FeedLoader(feedpipe.FeedDataset(ctx.shards, shuffle=True, seed=0),
                                  batch_size=ctx.batch, num_workers=nw,
                                  persistent_workers=nw > 0,
                                  **({"multiprocessing_context": "forkserver"} if nw else {}))
        self.loader = DaliStage(raw, spec=ImageSpec(size=ctx.size, train=True, mean=None),
                                device_id=(ctx.device.index or 0) if ctx.cuda else None,
                                num_threads=max(1, ctx.workers))
        self.raw = raw
        self.setup = (f"FeedLoader(FeedDataset(shuffle=True), num_workers={nw}, "
                      f"persistent_workers={nw > 0}, forkserver) of JPEG bytes -> "
                      f"DaliStage(ImageSpec({ctx.size}, train=True, mean=None), "
                      f"num_threads={max(1, ctx.workers)}, "
                      f"{'nvJPEG mixed' if ctx.cuda else 'DALI CPU'})")

    def unpack(self, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return b.images, b.labels


class FeedpipeStore(_Loader):
    name = "feedpipe-store"
    fill_epochs = 1
    augment = True

    def __init__(self, ctx: Context) -> None:
        import feedpipe
        from feedpipe import ImagePipeline

        self.ctx = ctx
        nw = ctx.workers
        self.store = tempfile.mkdtemp(prefix="store-", dir=ctx.scratch)
        ds = feedpipe.FeedDataset(ctx.shards, shuffle=True, seed=0, decoded_cache=self.store,
                                  transform=ImagePipeline(ctx.size, train=False, mean=None))
        self.loader = feedpipe.FeedLoader(ds, batch_size=ctx.batch, num_workers=nw,
                                          collate_fn=_collator(ctx), device=ctx.device,
                                          persistent_workers=nw > 0)
        self.setup = (f"FeedDataset(shuffle=True, decoded_cache=DIR, ImagePipeline({ctx.size}, "
                      f"train=False, mean=None)) + FeedLoader(num_workers={nw}, BatchCollator, "
                      f"device={str(ctx.device)!r}); epoch 0 fills the store, epoch 1 measured;"
                      " random-resized crop + flip on the device")

    def close(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)


class FeedpipeCache(System):
    name = "feedpipe-cache"
    augment = True

    def __init__(self, ctx: Context) -> None:
        import feedpipe

        self.ctx = ctx
        per = 3 * ctx.size * ctx.size + 8
        self.cache = feedpipe.DeviceCache(ctx.samples * per, device=ctx.device)
        self.ds = feedpipe.FeedDataset(ctx.shards, shuffle=True, seed=0)
        self.setup = (f"DeviceCache(whole dataset, {str(ctx.device)!r}).warmup(FeedDataset, "
                      f"ImagePipeline({ctx.size}, train=False, mean=None), "
                      f"num_workers={ctx.workers}) then DeviceCache.batches(FeedDataset("
                      "shuffle=True)); random-resized crop + flip on the device")

    def prepare(self) -> dict[str, Any]:
        import time

        import feedpipe
        from feedpipe import ImagePipeline

        t0 = time.perf_counter()
        st = self.cache.warmup(feedpipe.FeedDataset(self.ctx.shards),
                               transform=ImagePipeline(self.ctx.size, train=False, mean=None),
                               num_workers=self.ctx.workers, batch_size=self.ctx.batch,
                               show_progress=False)
        return {"warmup_s": time.perf_counter() - t0, "resident": st["resident"],
                "cache_bytes": st["bytes_used"]}

    def epoch(self, e: int) -> Iterator[Any]:
        self.ds.set_epoch(e)
        return iter(self.cache.batches(self.ds, self.ctx.batch))

    def stats(self) -> dict[str, Any]:
        return {"cache": self.cache.stats()}


CLASSES: dict[str, type[System]] = {
    "synthetic": Synthetic, "torchvision": TorchVision, "dali": Dali, "feedpipe": Feedpipe,
    "feedpipe-dali": FeedpipeDali, "feedpipe-store": FeedpipeStore,
    "feedpipe-cache": FeedpipeCache,
}


def check_system(name: str) -> None:
    CLASSES[name].check()


def open_system(name: str, ctx: Context) -> System:
    return CLASSES[name](ctx)
