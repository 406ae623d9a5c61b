#!/usr/bin/env python3
"""Real models fed by every loader, side by side in one run: images/s of a training loop.

Workload (per model in --models): torchvision ResNet-18 / ResNet-50 (random init), bf16
autocast, channels_last, SGD (lr 0.1, momentum 0.9), cross entropy over 1000 classes, batch
--batch (256). The data set is synthetic and in RAM: --images (16384) uint8 RGB images of
--image-size (128) squared, stored CHW as one array (N, 3, 128, 128), 805 MB, with int64
labels. Every sample is a random --crop-size (112) square crop with a random horizontal flip;
normalisation ((x/255 - mean) / std, ImageNet's mean and std) runs on the GPU for every row.

Rows (--rows), each a way of feeding the same training step:
  dataloader          torch DataLoader over a per-sample Dataset that crops and flips on the
                      CPU (numpy), --workers (8) worker processes, pin_memory=True, persistent
                      workers, prefetch_factor --prefetch-factor (2), shuffle, drop_last;
                      .to(device, non_blocking=True)
  two_stream          the seed write-up's two-stream AsyncGPUDataLoader (_peers.py, the one
                      bench_overlap.py runs) over a second such DataLoader
  pinloader_dl        pinloader.torch.prefetch over a third such DataLoader, pin_memory=False
  arrayloader_host    pinloader.torch.prefetch(pinloader.ArrayLoader((images, labels), batch,
                      gather="host", drop_last=True)): full uint8 128x128 images reach the GPU,
                      which crops and flips each sample (vectorised; see gpu_crop_flip)
  arrayloader_device  the same with gather="device" (a kernel reads the rows straight from the
                      registered host array)
  on_gpu              the whole uint8 data set already on the GPU, shuffled batches indexed
                      there, the same GPU crop and flip: the bound
Every row ends in the same (B, 3, crop, crop) uint8 batch on the GPU, then the same
normalisation and training step.

Method: every feed is built once (DataLoader workers persist) and warmed up with --warmup
steps per row and model (cudnn.benchmark on). Then --rounds rounds; each round runs every row
in turn (interleaved, and rotated so that no row always follows the same one: round r runs
rows r+1, ..., K, 1, ..., r). A row's turn is:
  drain   --drain batches taken from the feed without training (default: workers x
          prefetch_factor + depth + 2), so that the batches its loader buffered while the other
          rows ran do not count as free steps: the DataLoader has workers x prefetch_factor
          batches in flight and they are all ready after a few seconds of idling
  settle  --settle training steps, untimed, so that the pipeline runs at its steady state
  timed   torch.cuda.synchronize(), --steps training steps, torch.cuda.synchronize(): steps/s
          and images/s, and the process's CPU time per step (all of its threads: pin threads
          and pinloader's threads included, DataLoader worker processes excluded)
The table gives per model and row the median images/s over the rounds (min-max), and the
ratio to on_gpu measured in the same round (median, min-max). Epochs are N / batch steps long
for every row, so every feed crosses epoch boundaries in the measured steps.

--models gpt2 adds a language model: a GPT-2 small-sized transformers.GPT2LMHeadModel (12
layers, 12 heads, 768 wide, vocabulary 50304, random init, no download), AdamW, bf16 autocast,
batches of --gpt2-batch (16) windows of 1025 tokens from a uint16 token array in RAM
(--gpt2-tokens, 64 M). Rows: get_batch (nanoGPT's: torch.randint offsets, torch.stack of
torch.from_numpy slices as int64, pin_memory(), .to(non_blocking=True)),
arrayloader_host / arrayloader_device (pinloader.ArrayLoader(tokens, windows=1025): uint16
windows reach the GPU, which widens them to int64 and splits inputs and targets), on_gpu.

--time-limit (default 230 s from the start of the process) is a safety valve: a model whose
share of the time is spent starts no further round; the rounds done are reported.

--smoke runs all of it on the CPU in seconds: a small conv net stands in for torchvision,
tiny images, 2 workers, 2 rounds of 2 steps, device "cpu" (pinloader's host backend, where
gather="device" works too) and no-op stand-ins for the CUDA stream calls of two_stream.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from _peers import AsyncGPUDataLoader  # noqa: E402

torch = None  # imported in main() (a stand-in without CUDA in --smoke)

IMAGE_ROWS = ["dataloader", "two_stream", "pinloader_dl", "arrayloader_host",
              "arrayloader_device", "on_gpu"]
TOKEN_ROWS = ["get_batch", "arrayloader_host", "arrayloader_device", "on_gpu"]
ROWS = IMAGE_ROWS + ["get_batch"]
ROW_LABELS = {
    "dataloader": "DataLoader (CPU crop+flip, workers, `pin_memory`), `.to(non_blocking)`",
    "two_stream": "write-up's two-stream `AsyncGPUDataLoader` over that DataLoader",
    "pinloader_dl": "`pinloader.torch.prefetch` over that DataLoader (`pin_memory=False`)",
    "arrayloader_host": "`ArrayLoader(gather=\"host\")`, GPU crop+flip",
    "arrayloader_device": "`ArrayLoader(gather=\"device\")`, GPU crop+flip",
    "on_gpu": "data set already on the GPU, GPU crop+flip (bound)",
    "get_batch": "nanoGPT `get_batch` (randint, stack, `pin_memory`, `non_blocking`)",
}
TOKEN_LABELS = {
    "arrayloader_host": "`ArrayLoader(windows=1025, gather=\"host\")`",
    "arrayloader_device": "`ArrayLoader(windows=1025, gather=\"device\")`",
    "on_gpu": "tokens already on the GPU, windows sliced there (bound)",
}
MODELS = ["resnet18", "resnet50", "gpt2", "tiny"]
# relative time a model needs, to share --time-limit among the models of a run
MODEL_WEIGHT = {"resnet18": 1.0, "resnet50": 2.5, "gpt2": 2.5, "tiny": 1.0}
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
GPT2_BLOCK = 1024
GPT2_VOCAB = 50304


# --------------------------------------------------------------------------- host stand-ins

class _HostStream:
    def __init__(self, device=None, priority=0):
        pass

    def wait_stream(self, other):
        pass


class _HostCuda:
    """No-op stand-ins for the torch.cuda calls of this script, for --smoke on a CPU: the
    two_stream row's loader runs unchanged, and synchronize() has nothing to wait for."""

    Stream = _HostStream

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return _HostStream()

    @staticmethod
    def synchronize(device=None):
        pass


class _HostTorch:
    """torch, with torch.cuda replaced by _HostCuda (the --smoke run only)."""

    def __init__(self, real):
        self._real = real
        self.cuda = _HostCuda

    def __getattr__(self, name):
        return getattr(self._real, name)


# --------------------------------------------------------------------------- image sources

class CropFlipSamples:
    """Per-sample map-style Dataset over the in-RAM uint8 CHW images: a random crop x crop
    window and a random horizontal flip (numpy, in the worker), as a contiguous uint8 tensor,
    and the int64 label. Python's random module is seeded per worker by the DataLoader."""

    def __init__(self, images, labels, crop):
        self.images, self.labels, self.crop = images, labels, crop

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = self.images[i]
        c = self.crop
        top = random.randrange(img.shape[1] - c + 1)
        left = random.randrange(img.shape[2] - c + 1)
        out = img[:, top:top + c, left:left + c]
        if random.random() < 0.5:
            out = out[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(out)), int(self.labels[i])


class GpuCropFlip:
    """The GPU's per-sample random crop + horizontal flip of a (B, 3, H, W) uint8 batch, in one
    advanced-indexing gather: per sample a random (top, left) and a flip mask, which reverses
    the column indices (torch.where), so out[b, :, i, j] = x[b, :, top_b + i, left_b + j'] with
    j' = crop-1-j for a flipped sample. The same distribution as CropFlipSamples."""

    def __init__(self, device, batch, channels, crop):
        self.crop = crop
        self.ar = torch.arange(crop, device=device)
        self.rev = self.ar.flip(0)
        self.bidx = torch.arange(batch, device=device).view(batch, 1, 1, 1)
        self.cidx = torch.arange(channels, device=device).view(1, channels, 1, 1)

    def indices(self, x, top, left, flip):
        rows = top + self.ar                                   # (B, crop)
        cols = left + torch.where(flip, self.rev, self.ar)     # (B, crop)
        b = x.shape[0]
        return x[self.bidx[:b], self.cidx, rows[:, None, :, None], cols[:, None, None, :]]

    def __call__(self, x):
        b, _, h, w = x.shape
        dev = x.device
        top = torch.randint(0, h - self.crop + 1, (b, 1), device=dev)
        left = torch.randint(0, w - self.crop + 1, (b, 1), device=dev)
        flip = torch.rand((b, 1), device=dev) < 0.5
        return self.indices(x, top, left, flip)


class Normalize:
    """(x/255 - mean) / std of a uint8 batch, float32 channels_last, on the batch's device."""

    def __init__(self, device):
        self.m = (torch.tensor(MEAN, device=device) * 255).view(1, 3, 1, 1)
        self.s = (1.0 / (torch.tensor(STD, device=device) * 255)).view(1, 3, 1, 1)

    def __call__(self, x):
        return x.to(torch.float32, memory_format=torch.channels_last).sub_(self.m).mul_(self.s)


def endless(loader):
    """Batches of ``loader`` epoch after epoch: iter() once per epoch, then next() until the
    epoch ends (iter() on an ArrayLoader or a prefetcher starts a new epoch)."""
    while True:
        it = iter(loader)
        n = 0
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            n += 1
            yield batch
        if n == 0:
            raise RuntimeError("an epoch yielded no batches")


def moved(loader, device):
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


class Moved:
    """One epoch of a pin_memory DataLoader per iteration, each batch .to(device,
    non_blocking=True)."""

    def __init__(self, loader, device):
        self.loader, self.device = loader, device

    def __iter__(self):
        return moved(self.loader, self.device)


class Row:
    """One feed: ``batches`` is an endless iterator of (x, y) on the device; ``prepare`` turns
    one into the model's inputs (GPU crop and flip where the batch holds full images,
    normalisation); ``closers`` are closed at the end."""

    def __init__(self, name, batches, prepare, closers=(), info=None):
        self.name, self.batches, self.prepare = name, batches, prepare
        self.closers = list(closers)
        self.info = info or {}
        self.error = None

    def close(self):
        errs = []
        with contextlib.suppress(Exception):
            self.batches.close()
        for obj in self.closers:
            err = C.close_quietly(obj)
            if err:
                errs.append(err)
        self.closers = []
        self.batches = None
        return errs


def dataloader(dataset, args, pin):
    kw = dict(batch_size=args.batch, shuffle=True, drop_last=True, num_workers=args.workers,
              pin_memory=pin)
    if args.workers > 0:
        # fork: the workers share the parent's in-RAM images instead of receiving a pickled copy
        kw.update(persistent_workers=True, prefetch_factor=args.prefetch_factor,
                  multiprocessing_context="fork")
    dl = torch.utils.data.DataLoader(dataset, **kw)
    iter(dl)  # start the persistent workers now, before any pinloader thread exists
    return dl


def build_image_rows(args, images, labels, dev, pinloader):
    """Every image row's feed, in --rows order; a row that cannot be built carries its error.
    The DataLoaders (and their worker processes) are made first."""
    import pinloader.torch as pt

    cuda = dev.type == "cuda"
    crop = GpuCropFlip(dev, args.batch, images.shape[1], args.crop_size)
    norm = Normalize(dev)

    def cpu_cropped(b):
        return norm(b[0]), b[1]

    def gpu_cropped(b):
        return norm(crop(b[0])), b[1]

    dataset = CropFlipSamples(images, labels, args.crop_size)

    def make(name):
        if name == "dataloader":
            dl = dataloader(dataset, args, pin=cuda)
            return Row(name, endless(Moved(dl, dev)), cpu_cropped, [], {"pin_memory": cuda})
        if name == "two_stream":
            dl = dataloader(dataset, args, pin=cuda)
            return Row(name, endless(AsyncGPUDataLoader(dl, dev, torch)), cpu_cropped, [],
                       {"pin_memory": cuda})
        if name == "pinloader_dl":
            dl = dataloader(dataset, args, pin=False)
            pf = pt.prefetch(dl, device=str(dev), depth=args.depth)
            return Row(name, endless(pf), cpu_cropped, [pf], {"pin_memory": False})
        if name in ("arrayloader_host", "arrayloader_device") or name.startswith("arrayloader_device_g"):
            mode = name.split("_")[1]
            al = pinloader.ArrayLoader((images, labels), args.batch, gather=mode, drop_last=True,
                                       seed=1, max_registered_bytes=args.registered_budget)
            pf = pt.prefetch(al, device=str(dev))  # ArrayLoader's own depth
            batches = endless(pf)
            next(batches)  # the first batch: registration (device gather), the first epoch
            st = al.stats()
            info = {"gather": st.get("gather"), "registered_bytes": st.get("registered_bytes"),
                    "gather_leaves": st.get("gather_leaves")}
            if st.get("gather") != mode:
                raise RuntimeError(f"asked for gather={mode!r}, the loader uses {st.get('gather')!r}")
            if name.startswith("arrayloader_device_g"):
                info["gather_grid"] = int(name.rsplit("_g", 1)[1])
            return Row(name, batches, gpu_cropped, [pf, al], info)
        if name == "on_gpu":
            gx = torch.from_numpy(images).to(dev)
            gy = torch.from_numpy(labels).to(dev)

            def on_gpu():
                n, b = gx.shape[0], args.batch
                while True:
                    perm = torch.randperm(n, device=dev)
                    for k in range(n // b):
                        idx = perm[k * b:(k + 1) * b]
                        yield gx.index_select(0, idx), gy.index_select(0, idx)
            return Row(name, on_gpu(), gpu_cropped)
        raise ValueError(f"row {name!r} is not an image row")

    order = sorted(args.image_rows, key=lambda r: r not in ("dataloader", "two_stream", "pinloader_dl"))
    built = {}
    for name in order:
        t0 = time.perf_counter()
        row, err = C.guarded(make, name)
        if row is None:
            row = Row(name, None, None)
            row.error = err
            C.log(f"  {name}: build failed: {err['error']}")
        row.info["build_s"] = time.perf_counter() - t0
        built[name] = row
    return [built[n] for n in args.image_rows]


# --------------------------------------------------------------------------- token source

class GetBatch:
    """nanoGPT's get_batch over an in-RAM uint16 token array (nanoGPT maps the file anew per
    call; the tokens here are in RAM, as the ArrayLoader's are)."""

    def __init__(self, data, batch, block, device):
        self.data, self.batch, self.block, self.device = data, batch, block, device
        self.pin = device.type == "cuda"

    def __iter__(self):
        data, block, bs, device = self.data, self.block, self.batch, self.device
        while True:
            ix = torch.randint(len(data) - block, (bs,))
            x = torch.stack([torch.from_numpy((data[i:i + block]).astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block]).astype(np.int64)) for i in ix])
            if self.pin:
                x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
            else:
                x, y = x.to(device), y.to(device)
            yield x, y


def build_token_rows(args, tokens, dev, pinloader):
    import pinloader.torch as pt

    block = args.gpt2_block

    def split(b):
        w = b.to(torch.int64)
        return w[:, :-1], w[:, 1:]

    def make(name):
        if name == "get_batch":
            return Row(name, iter(GetBatch(tokens, args.gpt2_batch, block, dev)), lambda b: b)
        if name in ("arrayloader_host", "arrayloader_device"):
            mode = name.split("_")[1]
            al = pinloader.ArrayLoader(tokens, args.gpt2_batch, windows=block + 1, gather=mode,
                                       drop_last=True, seed=1,
                                       max_registered_bytes=args.registered_budget)
            pf = pt.prefetch(al, device=str(dev))  # ArrayLoader's own depth
            batches = endless(pf)
            next(batches)
            st = al.stats()
            if st.get("gather") != mode:
                raise RuntimeError(f"asked for gather={mode!r}, the loader uses {st.get('gather')!r}")
            return Row(name, batches, split, [pf, al], {"gather": st.get("gather"),
                                                        "registered_bytes": st.get("registered_bytes")})
        if name == "on_gpu":
            g = torch.from_numpy(tokens.view(np.int16)).to(dev)  # uint16 bits, widened below
            n, w, bs = g.shape[0], block + 1, args.gpt2_batch
            offs = torch.arange(w, device=dev)

            def on_gpu():
                while True:
                    ix = torch.randint(n - w + 1, (bs, 1), device=dev)
                    yield (g[ix + offs].to(torch.int64) & 0xFFFF),

            return Row(name, on_gpu(), lambda b: split(b[0]))
        raise ValueError(f"row {name!r} is not a token row")

    rows = []
    for name in args.token_rows:
        t0 = time.perf_counter()
        row, err = C.guarded(make, name)
        if row is None:
            row = Row(name, None, None)
            row.error = err
            C.log(f"  {name}: build failed: {err['error']}")
        row.info["build_s"] = time.perf_counter() - t0
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- models

def tiny_net(classes=1000):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))


class TinyLM:
    """--smoke's stand-in for GPT2LMHeadModel: embedding, linear head, ``.logits`` output."""

    def __new__(cls):
        nn = torch.nn

        class _TinyLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(GPT2_VOCAB, 16)
                self.head = nn.Linear(16, GPT2_VOCAB)

            def forward(self, x):
                return type("Out", (), {"logits": self.head(self.emb(x))})()

        return _TinyLM()


class Trainer:
    """One model and its optimiser; ``step(inputs, targets)`` is one training step."""

    def __init__(self, name, dev, args):
        self.name, self.dev = name, dev
        self.amp_device = dev.type
        if name in ("resnet18", "resnet50", "tiny"):
            if name == "tiny":
                model = tiny_net()
            else:
                import torchvision
                model = getattr(torchvision.models, name)(weights=None)
            model = model.to(dev).to(memory_format=torch.channels_last)
            self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            self.kind = "image"
            self.batch = args.batch
        elif name == "gpt2":
            if args.smoke:
                model = TinyLM().to(dev)
            else:
                import transformers
                cfg = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=args.gpt2_block,
                                              n_embd=768, n_layer=12, n_head=12)
                model = transformers.GPT2LMHeadModel(cfg).to(dev)
            fused = dev.type == "cuda"
            self.opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95),
                                         weight_decay=0.1, fused=fused)
            self.kind = "token"
            self.batch = args.gpt2_batch
        else:
            raise ValueError(f"unknown model {name!r}")
        model.train()
        self.model = model
        self.params = sum(p.numel() for p in model.parameters())
        self.loss = None

    def step(self, x, y):
        with torch.autocast(self.amp_device, dtype=torch.bfloat16):
            out = self.model(x)
            if self.kind == "token":
                out = out.logits
                loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
            else:
                loss = torch.nn.functional.cross_entropy(out, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.loss = loss.detach()

    def close(self):
        self.model = self.opt = self.loss = None


# --------------------------------------------------------------------------- runs

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def take(row, n, trainer=None):
    it, prepare = row.batches, row.prepare
    for _ in range(n):
        b = next(it)
        if trainer is not None:
            trainer.step(*prepare(b))


def run_turn(row, trainer, args, dev):
    """One row's turn in a round: drain, settle, timed steps. A --device-grids row sets the
    gather kernel's grid for its turn; the drained batches were launched with the previous
    turn's."""
    grid = row.info.get("gather_grid")
    if grid is not None:
        from pinloader import _C
        _C._testing.gather_grid(grid)
    try:
        take(row, args.drain)
        take(row, args.settle, trainer)
        sync(dev)
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        take(row, args.steps, trainer)
        sync(dev)
        dt, cpu, main = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0
    finally:
        if grid is not None:
            _C._testing.gather_grid(0)
    return {"seconds": dt, "steps": args.steps, "steps_per_s": args.steps / dt,
            "images_per_s": args.steps * trainer.batch / dt, "cpu_ms_per_step": 1e3 * cpu / args.steps,
            "main_cpu_ms_per_step": 1e3 * main / args.steps}


def run_model(name, rows, args, dev, deadline):
    """Warm-up, then interleaved rounds until --rounds or ``deadline`` (perf_counter)."""
    t_start = time.perf_counter()
    rec = {"rows": {r.name: {"runs": []} for r in rows}, "rounds_requested": args.rounds}
    trainer, err = C.guarded(Trainer, name, dev, args)
    if trainer is None:
        rec["error"] = err
        C.log(f"{name}: model failed: {err['error']}")
        return rec
    rec["params"] = trainer.params
    rec["batch"] = trainer.batch
    C.log(f"{name}: {trainer.params / 1e6:.1f} M parameters, batch {trainer.batch}; warm-up")
    for row in rows:
        if row.error:
            rec["rows"][row.name]["error"] = row.error
            continue
        t0 = time.perf_counter()
        _, err = C.guarded(lambda: (take(row, args.warmup, trainer), sync(dev)))
        if err:
            row.error = err
            rec["rows"][row.name]["error"] = err
            C.log(f"  {row.name}: warm-up failed: {err['error']}")
        else:
            rec["rows"][row.name]["warmup_s"] = time.perf_counter() - t0
    rec["warmup_s"] = time.perf_counter() - t_start
    C.log(f"{name}: warm-up {rec['warmup_s']:.1f} s")
    done = 0
    last_round = 0.0
    for rnd in range(args.rounds):
        now = time.perf_counter()
        if done and now + last_round > deadline:
            rec["stopped_early"] = (f"time limit: {done} of {args.rounds} rounds done, the next "
                                    f"would end {now + last_round - deadline:.0f} s past this "
                                    "model's share of --time-limit")
            C.log(f"{name}: {rec['stopped_early']}")
            break
        t_round = time.perf_counter()
        cells = []
        for row in rows[rnd % len(rows):] + rows[:rnd % len(rows)]:
            if row.error:
                continue
            r, err = C.guarded(run_turn, row, trainer, args, dev)
            if err:
                row.error = err
                rec["rows"][row.name]["error"] = err
                C.log(f"  {row.name}: failed: {err['error']}")
                continue
            r["round"] = rnd
            rec["rows"][row.name]["runs"].append(r)
            cells.append(f"{row.name} {r['images_per_s']:,.0f}")
        last_round = time.perf_counter() - t_round
        done += 1
        C.log(f"{name} round {rnd} ({last_round:.1f} s): images/s " + ", ".join(cells))
    rec["rounds_done"] = done
    if trainer.loss is not None:
        rec["final_loss"] = float(trainer.loss.float().item())
    rec["seconds"] = time.perf_counter() - t_start
    summarize_model(rec)
    trainer.close()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def summarize_model(rec):
    rows = rec["rows"]
    ref = {r["round"]: r["images_per_s"] for r in rows.get("on_gpu", {}).get("runs", [])}
    for data in rows.values():
        runs = data["runs"]
        data["images_per_s"] = C.summarize(r["images_per_s"] for r in runs)
        data["steps_per_s"] = C.summarize(r["steps_per_s"] for r in runs)
        data["cpu_ms_per_step"] = C.summarize(r["cpu_ms_per_step"] for r in runs)
        data["main_cpu_ms_per_step"] = C.summarize(r.get("main_cpu_ms_per_step") for r in runs
                                                   if r.get("main_cpu_ms_per_step") is not None)
        ratios = [r["images_per_s"] / ref[r["round"]] for r in runs if ref.get(r["round"])]
        data["ratio_to_on_gpu"] = C.summarize(ratios)
        data["ratio_to_on_gpu_by_round"] = ratios


# --------------------------------------------------------------------------- report

def render(payload):
    a = payload["args"]
    lines = [f"# Real models, every feed side by side ({'smoke run on the CPU' if a['smoke'] else 'GPU'})", ""]
    lines += C.machine_summary_lines(payload["machine"]) + [""]
    lines.append(payload["workload"])
    lines.append("")
    for model, rec in payload["models"].items():
        lines.append(f"## {model}")
        lines.append("")
        if rec.get("error"):
            lines += [f"error: {rec['error']['error']}", ""]
            continue
        meta = (f"{rec.get('params', 0) / 1e6:.1f} M parameters, batch {rec.get('batch')}, "
                f"{rec.get('rounds_done')} rounds of {a['steps']} timed steps per row "
                f"(after {a['drain']} drained batches and {a['settle']} untimed steps), "
                f"warm-up {rec.get('warmup_s', 0):.0f} s, final loss {C.fmt_num(rec.get('final_loss'))}")
        lines += [meta, ""]
        if rec.get("stopped_early"):
            lines += [f"**Stopped early**: {rec['stopped_early']}", ""]
        labels = dict(ROW_LABELS, **(TOKEN_LABELS if model == "gpt2" else {}))
        for name in rec["rows"]:
            if name.startswith("arrayloader_device_g"):
                labels[name] = (f"`ArrayLoader(gather=\"device\")`, GPU crop+flip, the gather kernel's "
                                f"grid at most {name.rsplit('_g', 1)[1]} blocks")
        table = []
        for name, data in rec["rows"].items():
            if data.get("error") and not data["runs"]:
                table.append([f"`{name}`", labels.get(name, ""), f"error: {data['error']['error'][:120]}",
                              "", "", "", ""])
                continue
            main_cpu = data.get("main_cpu_ms_per_step")
            table.append([f"`{name}`", labels.get(name, ""), C.fmt_summary(data["images_per_s"], 0),
                          C.fmt_summary(data["steps_per_s"], 1), C.fmt_summary(data["ratio_to_on_gpu"], 3),
                          C.fmt_summary(data["cpu_ms_per_step"], 1),
                          C.fmt_summary(main_cpu, 2) if main_cpu and main_cpu.get("n") else ""])
        lines.append(C.md_table(["row", "feed", "images/s" if model != "gpt2" else "sequences/s",
                                 "steps/s", "ratio to on_gpu (same round)", "host CPU ms/step",
                                 "training thread CPU ms/step"], table, "llrrrrr"))
        lines.append("")
    lines.append("Median over rounds (min–max). Ratio: the row's images/s over on_gpu's in the same "
                 "round. Host CPU: the process's CPU time (all threads) per timed step; DataLoader "
                 "worker processes are not in it. Training thread: the CPU time of the thread that "
                 "takes the batches and launches the steps.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    C.add_output_args(ap, "models")
    ap.add_argument("--models", type=C.choice_list(MODELS), default=["resnet18", "resnet50"],
                    help="resnet18, resnet50, gpt2, tiny (default: resnet18,resnet50)")
    ap.add_argument("--rows", type=C.choice_list(ROWS), default=ROWS,
                    help="rows to run (default: all; image models use " + ",".join(IMAGE_ROWS)
                    + ", gpt2 uses " + ",".join(TOKEN_ROWS) + ")")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50, help="timed steps per row and round")
    ap.add_argument("--settle", type=int, default=4, help="untimed steps before the timed ones")
    ap.add_argument("--drain", type=int, default=None,
                    help="batches taken without training at the start of each turn "
                         "(default: workers x prefetch_factor + depth + 2)")
    ap.add_argument("--warmup", type=int, default=3, help="steps per row and model before the rounds")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--images", type=int, default=16384, help="images in the data set")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--crop-size", type=int, default=112)
    ap.add_argument("--workers", type=int, default=8, help="DataLoader worker processes per DataLoader")
    ap.add_argument("--prefetch-factor", type=int, default=2)
    ap.add_argument("--depth", type=int, default=2, help="pinloader prefetch depth over the DataLoader (ArrayLoader rows use its own default)")
    ap.add_argument("--device-grids", type=C.csv_list(int), default=[],
                    help="extra arrayloader_device rows, arrayloader_device_gN, whose gather "
                         "kernel launches use at most N blocks (pinloader._C._testing.gather_grid)")
    ap.add_argument("--gpt2-batch", type=int, default=16)
    ap.add_argument("--gpt2-block", type=int, default=GPT2_BLOCK)
    ap.add_argument("--gpt2-tokens", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--time-limit", type=float, default=230.0,
                    help="seconds from the start after which no model starts another round")
    ap.add_argument("--smoke", action="store_true",
                    help="the whole run on the CPU in seconds (tiny net, tiny images)")
    return ap


def apply_smoke(args):
    args.models = ["tiny"] if args.models == ["resnet18", "resnet50"] else args.models
    args.device = "cpu"
    args.rounds, args.steps, args.settle, args.warmup = 2, 2, 1, 1
    # 2048 images: the labels (8 bytes a row) span whole pages, which the device gather needs
    args.batch, args.images, args.image_size, args.crop_size = 16, 2048, 20, 16
    args.workers = min(args.workers, 2)
    args.gpt2_batch, args.gpt2_block, args.gpt2_tokens = 2, 32, 1 << 16


def main(argv=None):
    global torch
    t_process = time.perf_counter()
    args = build_parser().parse_args(argv)
    if args.smoke:
        C.smoke_out(args)
        apply_smoke(args)
    if args.drain is None:
        args.drain = args.workers * args.prefetch_factor + args.depth + 2
        if args.smoke:
            args.drain = 2
    if min(args.rounds, args.steps, args.batch, args.images) < 1 or args.crop_size > args.image_size:
        C.fail("--rounds, --steps, --batch and --images must be >= 1 and --crop-size <= --image-size", 1)
    if args.smoke:
        try:
            import torch as real_torch
        except Exception as exc:
            C.fail(f"--smoke needs PyTorch; importing torch failed: {exc}")
        torch = _HostTorch(real_torch)
    else:
        real_torch = torch = C.require_cuda(args.device)
    if any(m.startswith("resnet") for m in args.models):
        try:
            import torchvision  # noqa: F401
        except Exception as exc:
            C.fail(f"--models {','.join(args.models)} needs torchvision; importing it failed: {exc}")
    if "gpt2" in args.models and not args.smoke:
        try:
            import transformers  # noqa: F401
        except Exception as exc:
            C.fail(f"--models gpt2 needs transformers; importing it failed: {exc}")
    pinloader, err = C.import_pinloader()
    if pinloader is None:
        C.fail(f"pinloader is not importable: {err}")
    dev = real_torch.device(args.device)
    if dev.type == "cuda":
        if pinloader.backend() != "cuda":
            C.fail(f"pinloader's backend is {pinloader.backend()!r}, not 'cuda'")
        dev = real_torch.device("cuda", real_torch.cuda.current_device())
        real_torch.backends.cudnn.benchmark = True
    image_models = [m for m in args.models if m != "gpt2"]
    # The device gather registers (page-locks) its sources, within a budget that defaults to a
    # share of RAM and of RLIMIT_MEMLOCK. Here the budget is every source this run may register,
    # so that a small default does not refuse the device rows on a machine with RAM to spare.
    args.registered_budget = 64 * C.MiB
    if image_models:
        args.registered_budget += args.images * (3 * args.image_size ** 2 + 8)
    if "gpt2" in args.models:
        args.registered_budget += 2 * args.gpt2_tokens
    args.image_rows = [r for r in ROWS if r in args.rows and r in IMAGE_ROWS]
    if args.device_grids:
        at = args.image_rows.index("on_gpu") if "on_gpu" in args.image_rows else len(args.image_rows)
        args.image_rows[at:at] = [f"arrayloader_device_g{g}" for g in args.device_grids]
    args.token_rows = [r for r in TOKEN_ROWS if r in args.rows]
    if image_models and "on_gpu" not in args.image_rows:
        C.log("note: without the on_gpu row there are no ratios")

    machine = C.machine_info(None if args.smoke else real_torch, args.device)
    with contextlib.suppress(OSError):
        machine["dev_shm_free_gib"] = round(shutil.disk_usage("/dev/shm").free / C.GiB, 2)
    payload = {"benchmark": "models", "machine": machine, "args": {k: v for k, v in vars(args).items()},
               "row_labels": ROW_LABELS, "models": {}, "rows_built": {}}
    hw = args.image_size
    payload["workload"] = (
        f"Images: {args.images} synthetic uint8 RGB {hw}x{hw} images in RAM, one (N, 3, {hw}, {hw}) "
        f"CHW array ({args.images * 3 * hw * hw / 1e6:.0f} MB) and int64 labels (1000 classes); per sample a "
        f"random {args.crop_size}x{args.crop_size} crop and a random horizontal flip (on the CPU in the "
        f"DataLoader rows' workers, on the GPU for the others); normalisation on the GPU; bf16 autocast, "
        f"channels_last, SGD lr 0.1 momentum 0.9, batch {args.batch}. DataLoaders: {args.workers} workers, "
        f"prefetch_factor {args.prefetch_factor}, persistent workers, fork; pinloader depth {args.depth}.")
    if "gpt2" in args.models:
        payload["workload"] += (
            f" Tokens: {args.gpt2_tokens} uint16 tokens in RAM, {args.gpt2_batch} windows of "
            f"{args.gpt2_block + 1} per batch; GPT-2 small-sized GPT2LMHeadModel, AdamW.")

    rows_all = []
    try:
        sets = []
        if image_models and args.image_rows:
            t0 = time.perf_counter()
            rng = np.random.default_rng(0)
            images = rng.integers(0, 256, (args.images, 3, hw, hw), dtype=np.uint8)
            labels = rng.integers(0, 1000, args.images, dtype=np.int64)
            C.log(f"data set: {images.nbytes / 1e6:.0f} MB of images in {time.perf_counter() - t0:.1f} s; "
                  f"building {len(args.image_rows)} feeds")
            rows = build_image_rows(args, images, labels, dev, pinloader)
            rows_all += rows
            sets.append((image_models, rows))
            for r in rows:
                payload["rows_built"][r.name] = dict(r.info, error=r.error)
        if "gpt2" in args.models and args.token_rows:
            rng = np.random.default_rng(1)
            tokens = rng.integers(0, 50257, args.gpt2_tokens, dtype=np.uint16)
            C.log(f"tokens: {tokens.nbytes / 1e6:.0f} MB; building {len(args.token_rows)} feeds")
            rows = build_token_rows(args, tokens, dev, pinloader)
            rows_all += rows
            sets.append((["gpt2"], rows))
            for r in rows:
                payload["rows_built"][f"gpt2.{r.name}"] = dict(r.info, error=r.error)
        C.log(f"feeds built at {time.perf_counter() - t_process:.1f} s")

        order = [(m, rows) for models, rows in sets for m in models]
        order.sort(key=lambda mr: args.models.index(mr[0]))
        for i, (model, rows) in enumerate(order):
            now = time.perf_counter()
            left = t_process + args.time_limit - now
            weights = [MODEL_WEIGHT[m] for m, _ in order[i:]]
            deadline = now + max(0.0, left) * weights[0] / sum(weights)
            payload["models"][model] = run_model(model, rows, args, dev, deadline)
            text = render(payload)
            C.write_json(args.out, args.name, payload)
            C.write_markdown(args.out, args.name, text)
    finally:
        for r in rows_all:
            if r.batches is not None:
                r.close()
        gc.collect()

    text = render(payload)
    print(text)
    payload["seconds"] = time.perf_counter() - t_process
    jpath = C.write_json(args.out, args.name, payload)
    C.write_markdown(args.out, args.name, text)
    errors = [f"{m}.{n}: {d['error']['error']}" for m, rec in payload["models"].items()
              for n, d in rec.get("rows", {}).items() if d.get("error")]
    errors += [f"{m}: {rec['error']['error']}" for m, rec in payload["models"].items() if rec.get("error")]
    C.log(f"done in {payload['seconds']:.0f} s; results in {jpath} and {jpath.with_suffix('.md')}")
    if errors:
        C.log("errors:\n  " + "\n  ".join(errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
