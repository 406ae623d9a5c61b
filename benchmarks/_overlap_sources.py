"""The sample sources of bench_overlap.py: the seed workload's images and labels held in RAM,
served per sample through torch DataLoaders (``dataset``: float32 images; ``crops``: uint8
images cropped and flipped in the workers) or as a ring of pre-collated batches
(``collated``). Every source gives the script's rows the same batches four ways: pageable
(``pageable()``), through a pin_memory DataLoader (``pinned()``), as numpy views of
PinnedBuffers (``pinned_buffers()``, collated only) and already on the GPU (``gpu_ring()``).

Nothing here imports torch: the sources take the torch module that the script imports once
its arguments are parsed.
"""

from __future__ import annotations

import gc

import numpy as np

import _common as common

IMAGE_SHAPE = (3, 224, 224)
CROP_SOURCE_HW = (256, 256)

SOURCES = ("dataset", "crops", "collated")
SOURCE_LABELS = {
    "dataset": "per-sample in-RAM Dataset through torch DataLoader worker processes",
    "crops": "per-sample uint8 random crops + flips through torch DataLoader worker processes",
    "collated": "pre-collated numpy batches in RAM",
}
# why the per-sample sources have no pinned_buffers()
WORKER_COLLATED = ("batches are collated in worker processes, which cannot write into this "
                   "process's PinnedBuffers")


class InRamPairs:
    """Map-style dataset of (x, y) pairs held in RAM; index i reads pair i mod n. The pairs are
    single samples (the per-sample sources) or whole batches (the collated source's
    DataLoader, batch_size=None)."""

    def __init__(self, xs, ys, length):
        self.xs = xs
        self.ys = ys
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        j = index % len(self.xs)
        return self.xs[j], self.ys[j]


class RandomCrops:
    """Map-style dataset of uint8 HWC images held in RAM; each item is a random crop of
    IMAGE_SHAPE[1:] with a random horizontal flip, as a contiguous CHW uint8 tensor. The crops
    are drawn from torch's global generator, which the DataLoader seeds in each worker."""

    def __init__(self, torch, images, labels, length):
        self.torch = torch
        self.images = images
        self.labels = labels
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        torch = self.torch
        j = index % len(self.images)
        img = self.images[j]
        h, w = IMAGE_SHAPE[1:]
        top = int(torch.randint(0, img.shape[0] - h + 1, ()))
        left = int(torch.randint(0, img.shape[1] - w + 1, ()))
        crop = img[top:top + h, left:left + w]
        if bool(torch.randint(0, 2, ())):
            crop = crop.flip(1)
        return crop.permute(2, 0, 1).contiguous(), self.labels[j]


class Epochs:
    """A re-iterable epoch: every iteration yields ``n`` items of ``items`` (cycled)."""

    def __init__(self, items, n):
        self.items = items
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        items, n = self.items, self.n
        for i in range(n):
            yield items[i % len(items)]


def _loader_kwargs(workers, prefetch_factor, pin):
    kw = dict(num_workers=workers, pin_memory=pin)
    if workers > 0:
        kw.update(persistent_workers=True, prefetch_factor=prefetch_factor,
                  multiprocessing_context="fork")
    return kw


class DatasetSource:
    """Per-sample dataset read through DataLoaders with worker processes.

    One DataLoader per pin_memory setting, created on first use and kept (persistent workers)
    for all runs. An epoch holds exactly the batches one run consumes plus a small slack, so
    that workers go quiet soon after a run ends."""

    name = "dataset"

    def __init__(self, torch, args, epoch_batches):
        self.torch = torch
        self.args = args
        gen = torch.Generator().manual_seed(1)
        images = torch.rand((args.dataset_samples, *IMAGE_SHAPE), generator=gen)
        labels = torch.randint(0, 1000, (args.dataset_samples,), generator=gen)
        self.dataset = InRamPairs(images, labels, epoch_batches * args.batch_size)
        self._loaders = {}

    def _loader(self, pin):
        if pin not in self._loaders:
            self._loaders[pin] = self.torch.utils.data.DataLoader(
                self.dataset, batch_size=self.args.batch_size, shuffle=True, drop_last=True,
                **_loader_kwargs(self.args.workers, self.args.prefetch_factor, pin))
        return self._loaders[pin]

    def pageable(self):
        return self._loader(False)

    def pinned(self):
        return self._loader(True)

    def pinned_buffers(self):
        raise RuntimeError(WORKER_COLLATED)

    def gpu_ring(self, device):
        torch = self.torch
        return [(torch.rand((self.args.batch_size, *IMAGE_SHAPE), device=device),
                 torch.randint(0, 1000, (self.args.batch_size,), device=device))
                for _ in range(2)]

    def describe(self):
        a = self.args
        return (f"{a.dataset_samples} distinct samples in RAM, batch {a.batch_size}, "
                f"{a.workers} workers, prefetch_factor {a.prefetch_factor}, persistent workers, "
                f"shuffle, {len(self.dataset) // a.batch_size} batches per epoch")

    def close(self):
        self._loaders.clear()
        gc.collect()


class CropsSource(DatasetSource):
    """uint8 images (CROP_SOURCE_HW), random crops and flips in the DataLoader's workers."""

    name = "crops"

    def __init__(self, torch, args, epoch_batches):
        self.torch = torch
        self.args = args
        gen = torch.Generator().manual_seed(3)
        images = torch.randint(0, 256, (args.dataset_samples, *CROP_SOURCE_HW, IMAGE_SHAPE[0]),
                               dtype=torch.uint8, generator=gen)
        labels = torch.randint(0, 1000, (args.dataset_samples,), generator=gen)
        self.dataset = RandomCrops(torch, images, labels, epoch_batches * args.batch_size)
        self._loaders = {}

    def gpu_ring(self, device):
        torch = self.torch
        return [(torch.randint(0, 256, (self.args.batch_size, *IMAGE_SHAPE), dtype=torch.uint8,
                               device=device),
                 torch.randint(0, 1000, (self.args.batch_size,), device=device))
                for _ in range(2)]

    def describe(self):
        return (f"uint8 {CROP_SOURCE_HW[0]}x{CROP_SOURCE_HW[1]} images, random "
                f"{IMAGE_SHAPE[1]}x{IMAGE_SHAPE[2]} crop + flip per sample; " + super().describe())


class CollatedSource:
    """A ring of pre-collated batches: numpy arrays (pageable), a pin_memory DataLoader over
    them (over shared-memory copies when it has workers), and PinnedBuffer views for pinloader."""

    name = "collated"

    def __init__(self, torch, args, epoch_batches):
        self.torch = torch
        self.args = args
        self.epoch_batches = epoch_batches
        rng = np.random.default_rng(2)
        shape = (args.batch_size, *IMAGE_SHAPE)
        self.xs = [rng.random(shape, dtype=np.float32) for _ in range(args.ring)]
        self.ys = [rng.integers(0, 1000, size=args.batch_size, dtype=np.int64)
                   for _ in range(args.ring)]
        self._loader = None
        self._pool = None
        self._buffers = []
        self._pinned_views = None

    def pageable(self):
        return Epochs(list(zip(self.xs, self.ys)), self.epoch_batches)

    def gpu_ring(self, device):
        torch = self.torch
        return [(torch.rand((self.args.batch_size, *IMAGE_SHAPE), device=device),
                 torch.randint(0, 1000, (self.args.batch_size,), device=device))
                for _ in range(2)]

    def pinned(self):
        torch = self.torch
        if self._loader is None:
            xs = [torch.from_numpy(x) for x in self.xs]
            ys = [torch.from_numpy(y) for y in self.ys]
            if self.args.collated_workers:
                xs = [t.clone().share_memory_() for t in xs]
                ys = [t.clone().share_memory_() for t in ys]
            dataset = InRamPairs(xs, ys, self.epoch_batches)
            self._loader = torch.utils.data.DataLoader(
                dataset, batch_size=None, shuffle=False,
                **_loader_kwargs(self.args.collated_workers, self.args.prefetch_factor, True))
        return self._loader

    def pinned_buffers(self):
        if self._pinned_views is None:
            pinloader = common.require_pinloader_cuda()
            total = sum(x.nbytes + y.nbytes for x, y in zip(self.xs, self.ys))
            self._pool = pinloader.PinnedPool(max_bytes=2 * total + 256 * common.MiB)
            views = []
            for x, y in zip(self.xs, self.ys):
                pair = []
                for arr in (x, y):
                    buf = self._pool.alloc(arr.nbytes)
                    self._buffers.append(buf)
                    view = np.frombuffer(buf, dtype=arr.dtype, count=arr.size).reshape(arr.shape)
                    np.copyto(view, arr)
                    pair.append(view)
                views.append(tuple(pair))
            self._pinned_views = views
        return Epochs(self._pinned_views, self.epoch_batches)

    def describe(self):
        a = self.args
        how = (f"{a.collated_workers} worker process(es) reading them from shared memory, "
               f"prefetch_factor {a.prefetch_factor}, and its pin thread"
               if a.collated_workers else "no worker processes (it pins in the main thread)")
        return (f"ring of {a.ring} distinct batches of {a.batch_size}; the pin_memory DataLoader "
                f"(batch_size=None) has {how}")

    def close(self):
        self._loader = None
        self._pinned_views = None
        gc.collect()
        for buf in self._buffers:
            try:
                buf.release()
            except Exception as exc:
                common.log(f"  PinnedBuffer.release() failed: {type(exc).__name__}: {exc}")
        self._buffers.clear()
        self._pool = None
        gc.collect()


SOURCE_KINDS = {"dataset": DatasetSource, "crops": CropsSource, "collated": CollatedSource}
