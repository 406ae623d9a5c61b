"""Images from JPEG files to a training step: pinloader.ImageLoader against the DataLoader,
torchvision's GPU decode, NVIDIA DALI and the GPU decoder alone.

Images are made from real photographs (scikit-image's sample photos; synthetic textured images
when scikit-image is missing), rescaled to ImageNet-like sizes (short side 333-500 px) or high
resolution (1.2-1.5k px), given sensor noise and saved as JPEG at quality 90, then written as an
ImageFolder tree, WebDataset tar shards and a packed dataset (``python -m pinloader pack``).

Loader-bound rows (rows interleaved over --rounds rounds; in each round, and in its warm-up, a
row runs epochs of --images images back to back until it has returned at least --skip-batches +
--min-batches batches). images/s: the batches after the first --skip-batches over the time from
the return of the last skipped one to the end of the run (the current stream waited for), so that
no row is credited with batches it decoded before its run began (DALI's pipeline runs its prefetch
queue on into the next epoch while the next row is timed); after each run the bench waits
--settle-s untimed, so that such work ends before the next row starts. CPU-seconds per 1,000
images: the process and its worker processes over the whole run and its wait, over every image
the run returned:

  imageloader_packed / _tar / _folder   ImageLoader(train=True, size=224, bf16, NHWC) through
                                        pinloader.torch.prefetch
  dataloader             torch DataLoader, --workers workers, PIL + torchvision v2
                         RandomResizedCrop(224) + RandomHorizontalFlip + normalize, pinned, copied
  torchvision_gpu        torchvision.io.decode_jpeg(list, device="cuda") + the same v2 transforms
                         on the GPU, image by image
  dali_default / dali_best   DALI fn.decoders.image_random_crop(device="mixed") + resize + crop,
                         mirror, normalize (hw_decoder_load 0.65 and 0.9, 8 threads), if importable;
                         --dali-sweep LOAD:THREADS,... adds one such row per configuration
  decoder_alone          _C.JpegDecoder.decode over the packed bytes, no loader: the engines'
                         ceiling with the same crops

--models resnet50,resnet18,efficientnet_b0,vit_b_16: a training step (bf16 autocast,
channels_last, SGD) fed by each way against pre-decoded 224-px crops already on the GPU (the
bound), rows interleaved over the rounds (before each timed row, --drain batches are taken
without training and --settle steps run untimed, as bench_models.py does); ViT-B/16 on the high-res images, the others on the
ImageNet-like ones. The table gives each row's images/s and its ratio to the bound (median and
range over rounds).

--smoke runs the ImageLoader rows on the host backend with small images (no GPU needed; the CI
test tests/test_bench_images.py runs it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LOADER_ROWS = ["imageloader_packed", "imageloader_tar", "imageloader_folder", "dataloader",
               "torchvision_gpu", "dali_default", "dali_best", "decoder_alone"]
MODEL_ROWS = ["bound", "imageloader_packed", "dataloader", "dali_best"]
MODELS = {"resnet50": "imagenet", "resnet18": "imagenet", "efficientnet_b0": "imagenet",
          "vit_b_16": "highres", "tiny": "imagenet"}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLASSES = 10


# ---- images ----

def _photos() -> list[np.ndarray]:
    try:
        from skimage import data
    except ImportError:
        return []
    out = []
    for n in ["astronaut", "coffee", "chelsea", "rocket", "motorcycle_left", "retina", "cat",
              "immunohistochemistry", "hubble_deep_field", "colorwheel"]:
        f = getattr(data, n, None)
        try:
            a = f() if f is not None else None
        except Exception:  # noqa: BLE001 -- a sample that needs a download
            a = None
        if isinstance(a, tuple):
            a = a[0]
        if a is not None and a.ndim == 3 and a.shape[2] >= 3:
            out.append(np.ascontiguousarray(a[..., :3]))
    return out


def _textured(rng: np.random.Generator, h: int = 512, w: int = 512) -> np.ndarray:
    """A synthetic photo stand-in: smooth colour fields, edges and fine texture."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    f = rng.uniform(3, 40, size=(3, 2))
    img = np.stack([128 + 90 * np.sin(x / f[c, 0] + y / f[c, 1] + c) for c in range(3)], -1)
    img += 30 * (((x // rng.integers(8, 64)) + (y // rng.integers(8, 64))) % 2)[..., None]
    return np.clip(img, 0, 255).astype(np.uint8)


def make_jpegs(n: int, size_class: str, seed: int = 0, small: bool = False) -> list[bytes]:
    from PIL import Image
    rng = np.random.default_rng(seed)
    base = _photos() or [_textured(rng) for _ in range(6)]
    distinct = min(n, 256)
    blobs = []
    for i in range(distinct):
        if i and i % 32 == 0:
            C.log(f"  {i} of {distinct} distinct images made")  # progress, for --stall-s
        src = Image.fromarray(base[i % len(base)])
        if small:
            short = int(rng.integers(40, 90))
        elif size_class == "imagenet":
            short = int(rng.integers(333, 501))
        else:
            short = int(rng.integers(1200, 1501))
        aspect = float(rng.uniform(0.75, 1.5))
        w, h = (int(short * aspect), short) if rng.random() < 0.6 else (short, int(short * aspect))
        im = np.asarray(src.resize((w, h), Image.BILINEAR), np.float32)
        im = np.clip(im + rng.normal(0, 4, im.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="JPEG", quality=90)
        blobs.append(buf.getvalue())
    return [blobs[i % distinct] for i in range(n)]


@contextlib.contextmanager
def data_root(data_dir: Path | None, prefix: str) -> Iterator[Path]:
    """The folder the datasets are kept in: --data-dir, or a temporary one removed afterwards."""
    if data_dir is not None:
        yield Path(data_dir)
        return
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dataset(root: Path, size_class: str, images: int, smoke: bool = False) -> dict[str, Any]:
    """The datasets of one size class under root/size_class, made if missing or of another number
    of images (kept between runs with --data-dir): the folder, the tar shards and the packed
    file."""
    d = root / size_class
    kept = 0
    if (d / "packed" / "meta.json").exists():
        kept = len(np.load(d / "packed" / "labels.npy", mmap_mode="r"))
    if kept != images:  # none kept, or a --data-dir made for another --images: made anew
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        C.log(f"making {images} {size_class} images in {d}")
        return write_dataset(d, make_jpegs(images, size_class, small=smoke), shard_size=max(8, images // 8))
    tars = sorted(str(p) for p in d.glob("shard-*.tar"))
    return {"folder": str(d / "folder"), "tars": tars, "packed": str(d / "packed"), "n": images}


def write_dataset(root: Path, blobs: list[bytes], shard_size: int = 1000) -> dict[str, Any]:
    """The images as a folder tree, tar shards and a packed dataset under root."""
    from pinloader._image_pack import pack
    folder = root / "folder"
    items = []
    for i, b in enumerate(blobs):
        c = i % CLASSES
        d = folder / f"class{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"img{i:07d}.jpg"
        p.write_bytes(b)
        items.append((p, c))
    C.log(f"  {len(blobs)} files written; the tar shards and the packed file next")
    tars = []
    for s in range(0, len(items), shard_size):
        t = root / f"shard-{s // shard_size:05d}.tar"
        with tarfile.open(t, "w") as tf:
            for p, c in items[s:s + shard_size]:
                tf.add(p, arcname=p.stem + ".jpg")
                lab = str(c).encode()
                info = tarfile.TarInfo(p.stem + ".cls")
                info.size = len(lab)
                tf.addfile(info, io.BytesIO(lab))
        tars.append(str(t))
    pack(str(folder), str(root / "packed"), quiet=True)
    return {"folder": str(folder), "tars": tars, "packed": str(root / "packed"), "n": len(blobs)}


# ---- CPU time of the process and its children (DataLoader workers) ----

def _ticks(pid: int | str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return int(parts[11]) + int(parts[12])
    except (OSError, IndexError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and its live child processes."""
    hz = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    return (_ticks(me) + sum(_ticks(c) for c in _children(me))) / hz


# ---- rows: each a factory returning (run, holder); run(epoch) yields the images of each batch as
# the batch is returned and at the end waits for the current stream, where the loaders hand their
# batches over (the decoder alone, with no loader, for the device); holder: what to close (or
# None) ----

Runner = Callable[[int], Iterator[int]]


def row_imageloader(ds: dict, key: str, args: Any, torch: Any) -> tuple[Runner, Any]:
    import pinloader
    import pinloader.torch as pt
    src = {"packed": ds["packed"], "tar": ds["tars"], "folder": ds["folder"]}[key]
    loader = pinloader.ImageLoader(src, args.batch, size=224, dtype=args.dtype, layout="NHWC",
                                   device=args.device, drop_last=True, on_error="raise")
    door = pt.prefetch(loader, device=args.device)

    def run(epoch: int) -> Iterator[int]:
        loader.set_epoch(epoch)
        last = None
        for b in door:
            last = b["image"]
            yield last.shape[0]
        if last is not None and last.is_cuda:
            torch.cuda.current_stream().synchronize()
    return run, loader


# The decoder's measurement switches a --variant row may set (each read by the loader as it makes
# or runs its GPU decoders: Note [interpolated chroma] in src/core/nvjpeg_load.c, Note [region
# decode] and Note [the engines' order] in src/core/jpeg_cuda.c, Note [decoder threads] in
# pinloader/_image_epochs.py)
VARIANT_VARS = ("PINLOADER_JPEG_INTERPOLATE", "PINLOADER_JPEG_REGION", "PINLOADER_JPEG_DECODERS",
                "PINLOADER_JPEG_SORT")


def _variant_parts(spec: str) -> list[tuple[str, str, str]]:
    """--variant NAME:VAR=VALUE[+VAR=VALUE...]'s (VAR, "=", VALUE) parts ("" for a missing "=")."""
    return [p.partition("=") for p in spec.partition(":")[2].split("+")]


def _variant_vars(spec: str) -> list[tuple[str, str]]:
    """--variant NAME:VAR=VALUE[+VAR=VALUE...]'s (VAR, VALUE) pairs."""
    return [(var, value) for var, _, value in _variant_parts(spec)]


def row_imageloader_variant(ds: dict, spec: str, args: Any, torch: Any) -> tuple[Runner, Any]:
    """imageloader_packed with environment variables set whenever the row is made or run (the
    loader reads its decoder switches then, some at every epoch): --variant
    NAME:VAR=VALUE[+VAR=VALUE...]."""
    pairs = _variant_vars(spec)

    @contextlib.contextmanager
    def var_set() -> Iterator[None]:
        old = {var: os.environ.get(var) for var, _ in pairs}
        os.environ.update(pairs)
        try:
            yield
        finally:
            for var, was in old.items():
                if was is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = was

    with var_set():
        run, loader = row_imageloader(ds, "packed", args, torch)

    def run_with_var(epoch: int) -> Iterator[int]:
        # set from the epoch's first batch asked for to its end (or the generator's closing): not
        # changed between batches, while the loader's threads may read the environment
        with var_set():
            yield from run(epoch)
    return run_with_var, loader


def _dali_config(text: str) -> list[tuple[float, int]]:
    """--dali-sweep's LOAD:THREADS,...: (hw_decoder_load, num_threads) pairs."""
    out = []
    for part in text.split(","):
        load, sep, threads = part.strip().partition(":")
        try:
            pair = (float(load), int(threads))
        except ValueError:
            pair = (-1.0, 0)
        if not sep or not 0.0 <= pair[0] <= 1.0 or pair[1] < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected LOAD:THREADS, LOAD in [0, 1] and "
                                             "THREADS >= 1 (e.g. 0.9:8)")
        out.append(pair)
    return out


def dali_row_name(load: float, threads: int) -> str:
    """The loader-bound row of one --dali-sweep configuration."""
    return f"dali_{load:g}_{threads}t"


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {least}")
        return n
    return parse


def _variant(text: str) -> str:
    name, sep, _ = text.partition(":")
    pairs = _variant_parts(text)
    names = [var for var, _, _ in pairs]
    if (not sep or not name.isidentifier() or any(not eq or var not in VARIANT_VARS for var, eq, _ in pairs)
            or len(set(names)) != len(names)):
        raise argparse.ArgumentTypeError(f"--variant wants NAME:VAR=VALUE[+VAR=VALUE...] with each VAR once, one of "
                                         f"{', '.join(VARIANT_VARS)}, got {text!r}")
    return text


def _v2_train(torch: Any) -> Any:
    from torchvision.transforms import v2
    # crop and flip the PIL image (Pillow's resize, the classic recipe), then to a tensor
    return v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def row_dataloader(ds: dict, args: Any, torch: Any) -> tuple[Runner, Any]:
    import torchvision
    tf = _v2_train(torch)
    data = torchvision.datasets.ImageFolder(ds["folder"], transform=tf)
    dl = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                                     num_workers=args.workers, pin_memory=args.device != "cpu",
                                     persistent_workers=args.workers > 0, prefetch_factor=4 if args.workers else None)
    dev = torch.device(args.device)
    dt = getattr(torch, args.dtype)

    def run(epoch: int) -> Iterator[int]:
        for x, _ in dl:
            x = x.to(dev, non_blocking=True).to(dt).contiguous(memory_format=torch.channels_last)
            yield x.shape[0]
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
    return run, None


def row_torchvision_gpu(ds: dict, args: Any, torch: Any) -> tuple[Runner, Any]:
    import torchvision
    from torchvision.transforms import v2
    files = sorted(str(p) for p in Path(ds["folder"]).rglob("*.jpg"))
    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    dt = getattr(torch, args.dtype)

    def run(epoch: int) -> Iterator[int]:
        order = np.random.default_rng(epoch).permutation(len(files))
        B = args.batch
        for k in range(len(files) // B):
            datas = [torchvision.io.read_file(files[i]) for i in order[k * B:(k + 1) * B]]
            imgs = torchvision.io.decode_jpeg(datas, device=args.device)
            x = torch.stack([tf(im) for im in imgs]).to(dt).contiguous(memory_format=torch.channels_last)
            yield x.shape[0]
        torch.cuda.current_stream().synchronize()
    return run, None


def dali_iter(ds: dict, args: Any, torch: Any, hw_load: float, threads: int | None = None,
              auto_reset: bool = True) -> Any:
    """DALI's pipeline over the folder: decode a random crop on the GPU (mixed), resize to 224,
    mirror at random, normalize, HWC; its PyTorch iterator (``threads``: its CPU threads,
    --dali-threads when None; ``auto_reset``: the next epoch begun as soon as one ends, as a
    training feed wants it)."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    dev = torch.device(args.device)

    @pipeline_def(batch_size=args.batch, num_threads=threads or args.dali_threads, device_id=dev.index or 0)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=ds["folder"], random_shuffle=True, name="r")
        imgs = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                             hw_decoder_load=hw_load)
        imgs = fn.resize(imgs, resize_x=224, resize_y=224)
        imgs = fn.crop_mirror_normalize(imgs, dtype=types.FLOAT16 if args.dtype != "float32" else types.FLOAT,
                                        output_layout="HWC", mean=[m * 255 for m in MEAN],
                                        std=[s * 255 for s in STD], mirror=fn.random.coin_flip())
        return imgs, labels

    p = pipe()
    p.build()
    return DALIGenericIterator([p], ["image", "label"], reader_name="r",
                               last_batch_policy=LastBatchPolicy.DROP, auto_reset=auto_reset)


def row_dali(ds: dict, args: Any, torch: Any, hw_load: float,
             threads: int | None = None) -> tuple[Runner, Any]:
    # reset by hand at the start of each epoch but the first. Either way the pipeline keeps its
    # prefetch queue full across the end of an epoch: the next epoch's first batches decode after
    # the run has ended (loader_bound's --settle-s and --skip-batches keep them out of other rows'
    # time and out of this row's images/s). After a failed run loader_bound runs the row no more:
    # the iterator may be mid-epoch, and DALI ignores a reset there
    it = dali_iter(ds, args, torch, hw_load, threads, auto_reset=False)
    ended = False

    def run(epoch: int) -> Iterator[int]:
        nonlocal ended
        if ended:
            it.reset()
        ended = True
        for b in it:
            yield b[0]["image"].shape[0]
        # the batches it returned are ready on the current stream (the iterator makes it wait for
        # them as it hands them over); not the whole device, which would also wait for the next
        # epoch's batches already begun
        torch.cuda.current_stream().synchronize()
    return run, None


class PackedDecode:
    """The GPU decoder alone over a packed dataset, with ImageLoader's training crops (seed 0):
    ``batch(idx, epoch)`` decodes samples ``idx`` to 224 px, NHWC, ``dtype``."""

    def __init__(self, root: str, device: str, dtype: str) -> None:
        from pinloader import _C, _cudart
        from pinloader import _image_ops as ops
        self.ops, self.dtype = ops, dtype
        self.dec = _C.JpegDecoder(device, libraries=_cudart.nvjpeg_candidates())
        bounds = np.load(os.path.join(root, "offsets.npy"))
        self.sizes = np.load(os.path.join(root, "sizes.npy"))
        self.data = np.memmap(os.path.join(root, "data.bin"), np.uint8, mode="r")
        self.offsets, self.lengths = bounds[:-1].copy(), np.diff(bounds)
        self.scale, self.bias = ops.norm_constants(MEAN, STD, dtype)

    def batch(self, idx: np.ndarray, epoch: int) -> Any:
        ops = self.ops
        u = ops.draws(0, epoch, idx)
        p = ops.train_params(self.sizes[idx, :2], u, (224, 224), (0.08, 1.0), (3 / 4, 4 / 3), True)
        arr, _ = self.dec.decode(self.data, self.offsets[idx], self.lengths[idx], p, (224, 224), self.scale,
                                 self.bias, self.dtype, True)
        return arr


def row_decoder_alone(ds: dict, args: Any, torch: Any) -> tuple[Runner, Any]:
    pd = PackedDecode(ds["packed"], args.device, args.dtype)

    def run(epoch: int) -> Iterator[int]:
        order = np.random.default_rng(epoch).permutation(len(pd.offsets))
        B = args.batch
        for k in range(len(order) // B):
            arr = pd.batch(order[k * B:(k + 1) * B], epoch)
            del arr
            yield B
        torch.cuda.synchronize()
    return run, pd.dec


# ---- loader-bound table ----

def epochs_per_run(images: int, batch: int, skip: int, min_batches: int) -> int:
    """The epochs a row runs back to back in one round (and in its warm-up): enough for ``skip``
    + ``min_batches`` batches (drop_last) of ``images`` images."""
    per_epoch = images // batch
    if per_epoch < 1:
        raise SystemExit(f"--images {images} is less than one batch of {batch}")
    return max(1, -(-(skip + min_batches) // per_epoch))


def timed_run(run: Runner, first_epoch: int, epochs: int, skip: int, settle_s: float) -> dict[str, float]:
    """One row's run in one round: ``epochs`` epochs back to back from ``first_epoch``.

    images/s counts the batches after the first ``skip`` over the time from the return of the
    last skipped batch to the end of the run (the runner's wait included), so that batches a loader
    prepared before the run began (a prefetch queue filled while other rows ran) are not credited
    to it, and its own start-up is left out alike for every row; epoch ends inside the run are
    timed, as training meets them. CPU per image: over the run and ``settle_s`` of untimed wait
    after it (work the loader goes on with is charged to it), per image returned. fill_ms: the
    time to the last skipped batch."""
    stamps: list[tuple[float, int]] = []
    c0, t0 = cpu_seconds(), time.perf_counter()
    try:
        for e in range(epochs):
            for n in run(first_epoch + e):
                stamps.append((time.perf_counter(), n))
        t1 = time.perf_counter()
    finally:
        # after a failure too: what the loader still has in flight ends before the next row
        if settle_s > 0:
            time.sleep(settle_s)
    c1 = cpu_seconds()
    if len(stamps) <= skip:
        raise RuntimeError(f"{len(stamps)} batches in {epochs} epochs: --skip-batches {skip} leaves none to time")
    start = stamps[skip - 1][0] if skip else t0
    timed = sum(n for _, n in stamps[skip:])
    total = sum(n for _, n in stamps)
    return {"ips": timed / max(t1 - start, 1e-9), "cpu_per_1000": (c1 - c0) / max(total, 1) * 1000,
            "fill_ms": (start - t0) * 1000}


def loader_bound(ds: dict, args: Any, torch: Any, size_class: str) -> dict[str, Any]:
    factories: dict[str, Callable[[], tuple[Runner, Any]]] = {
        "imageloader_packed": lambda: row_imageloader(ds, "packed", args, torch),
        "imageloader_tar": lambda: row_imageloader(ds, "tar", args, torch),
        "imageloader_folder": lambda: row_imageloader(ds, "folder", args, torch),
        "dataloader": lambda: row_dataloader(ds, args, torch),
        "torchvision_gpu": lambda: row_torchvision_gpu(ds, args, torch),
        "dali_default": lambda: row_dali(ds, args, torch, 0.65),
        "dali_best": lambda: row_dali(ds, args, torch, 0.9),
        "decoder_alone": lambda: row_decoder_alone(ds, args, torch),
    }
    names = list(args.rows)
    for spec in args.variant:
        name = "imageloader_packed_" + spec.partition(":")[0]
        if name in factories:
            raise SystemExit(f"--variant {spec!r}: a row named {name} is already measured")
        factories[name] = lambda spec=spec: row_imageloader_variant(ds, spec, args, torch)
        names.append(name)
    for load, threads in args.dali_sweep:
        name = dali_row_name(load, threads)
        if name in factories:
            raise SystemExit(f"--dali-sweep: {load}:{threads} is given twice")
        factories[name] = lambda load=load, threads=threads: row_dali(ds, args, torch, load, threads)
        names.append(name)
    rows: dict[str, Any] = {}
    runners: dict[str, Runner] = {}
    epochs = epochs_per_run(args.images, args.batch, args.skip_batches, args.min_batches)
    holders = []
    holder_of: dict[str, Any] = {}
    for name in names:
        made, err = C.guarded(factories[name])
        if err is not None:
            rows[name] = {"skipped": err["error"]}
            C.log(f"[{size_class}] {name}: not run ({err['error']})")
            continue
        run, holder = made
        holders.append(holder)
        holder_of[name] = holder
        # warm-up: a run like the timed ones (a shorter one left the first round slower)
        _, err = C.guarded(timed_run, run, 10_000, epochs, args.skip_batches, args.settle_s)
        if err is not None:
            rows[name] = err
            C.log(f"[{size_class}] {name}: failed ({err['error']})")
            continue
        runners[name] = run
        rows[name] = {"ips": [], "cpu_per_1000": [], "fill_ms": [], "rounds": [], "epochs_per_run": epochs}
    stopped: set[str] = set()
    for r in range(args.rounds):
        names = list(runners) if r % 2 == 0 else list(runners)[::-1]
        for name in names:
            if name in stopped:
                continue
            got, err = C.guarded(timed_run, runners[name], r * epochs, epochs, args.skip_batches, args.settle_s)
            if err is not None:
                # a loader's state after a failed run is unknown (one may be mid-epoch): its
                # rounds so far stand, and the row runs no more
                rows[name].update(err)
                rows[name]["stopped_in_round"] = r
                stopped.add(name)
                C.log(f"[{size_class}] round {r} {name}: failed ({err['error']}); not run again")
                continue
            for k in ("ips", "cpu_per_1000", "fill_ms"):
                rows[name][k].append(got[k])
            rows[name]["rounds"].append(r)
            C.log(f"[{size_class}] round {r} {name}: {got['ips']:,.0f} img/s")
    for name, h in holder_of.items():  # the GPU decoders' own counts, for the record
        st, _ = C.guarded(h.stats) if hasattr(h, "stats") and name in runners else (None, None)
        gd = (st or {}).get("gpu_decoder") or {}
        if gd:
            kept = ("hardware", "cuda", "roi", "chroma_interpolated", "decoders")
            rows[name]["gpu_decoder"] = {k: gd[k] for k in kept if k in gd}
    for h in holders:
        C.close_quietly(h)
    for v in rows.values():
        if "ips" in v:
            v["ips_summary"] = C.summarize(v["ips"])
            v["cpu_summary"] = C.summarize(v["cpu_per_1000"])
            v["fill_summary"] = C.summarize(v["fill_ms"])
    return rows


# ---- models ----

def _model(name: str, torch: Any, device: str) -> Any:
    if name == "tiny":
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, stride=4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, CLASSES))
    else:
        import torchvision
        m = getattr(torchvision.models, name)(num_classes=1000)
    return m.to(device).to(memory_format=torch.channels_last)


# the decode call's steps, as JpegDecoder.info() names them with "_ns" (src/core/jpeg_cuda.h)
DECODE_STEPS = ("headers", "engines_wait", "engines", "cuda", "block", "kernels")


def _decode_calls(loader: Any) -> tuple[float, int, dict[str, int]] | None:
    """An ImageLoader's seconds in GPU decode calls, its decoders' batches so far, and their
    calls' host time by step (JpegDecoder.info())."""
    if loader is None:
        return None
    st = loader.stats()
    gd = st.get("gpu_decoder") or {}
    return (float(st.get("decode_call_s", 0.0)), int(gd.get("batches") or 0),
            {k: int(gd.get(f"{k}_ns") or 0) for k in DECODE_STEPS})


def training_batches(loader: Any, door: Any) -> Iterator[Any]:
    """(images NCHW in channels_last memory, labels) from an ImageLoader's torch door, epoch
    after epoch, as a training loop takes them."""
    e = 0
    while True:
        loader.set_epoch(e)
        for b in door:
            yield b["image"].permute(0, 3, 1, 2), b["label"]
        e += 1


def models_table(datasets: dict[str, dict], args: Any, torch: Any) -> dict[str, Any]:
    import pinloader
    import pinloader.torch as pt
    out: dict[str, Any] = {}
    dev = torch.device(args.device)
    if args.model_stream == "side" and dev.type == "cuda":
        # everything of the table (models, the bound's tensors, the doors' waits) on one
        # non-blocking stream: set, not entered, so the feeds' generators run on it too
        torch.cuda.synchronize(dev)
        torch.cuda.set_stream(torch.cuda.Stream(dev))
    for mname in args.models:
        ds = datasets[MODELS[mname] if not args.smoke else "imagenet"]
        rec: dict[str, Any] = {"size_class": MODELS[mname], "rows": {}}
        out[mname] = rec
        model, err = C.guarded(_model, mname, torch, args.device)
        if err is not None:
            rec["error"] = err["error"]
            continue
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        steps = args.steps

        def step(x: Any, y: Any) -> None:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        bound_x = torch.randn(args.batch * 4, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        bound_y = torch.randint(0, CLASSES, (args.batch * 4,), device=dev)

        def feed_bound() -> Any:
            k = 0
            while True:  # the four pre-made batches in turn: no host work, no copy
                i = k % 4
                yield bound_x[i * args.batch:(i + 1) * args.batch], bound_y[i * args.batch:(i + 1) * args.batch]
                k += 1

        def feed_imageloader() -> Any:
            loader = pinloader.ImageLoader(ds["packed"], args.batch, size=224, dtype="float32" if dev.type != "cuda" else args.dtype,
                                           layout="NHWC", device=args.device, drop_last=True)
            door = pt.prefetch(loader, device=args.device)
            loaders["imageloader_packed"] = loader
            st = loader.stats()  # the CUDA driver's work queues the process got (the images guide)
            if "cuda_connections" in st:
                rec["cuda_connections"] = [st["cuda_connections"], st["cuda_connections_reason"]]
            yield from training_batches(loader, door)

        def feed_dataloader() -> Any:
            import torchvision
            data = torchvision.datasets.ImageFolder(ds["folder"], transform=_v2_train(torch))
            dl = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True,
                                             num_workers=args.workers, pin_memory=dev.type == "cuda",
                                             persistent_workers=args.workers > 0)
            while True:
                for x, y in dl:
                    yield (x.to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last),
                           y.to(dev, non_blocking=True))

        def feed_dali() -> Any:
            it = dali_iter(ds, args, torch, 0.9)
            while True:
                for b in it:
                    # the reader's labels stay on the host: the step wants them on the device
                    yield b[0]["image"].permute(0, 3, 1, 2), b[0]["label"].reshape(-1).long().to(dev, non_blocking=True)

        loaders: dict[str, Any] = {}  # the ImageLoader, for its decoder's counts after each row

        feeds = {"bound": feed_bound, "imageloader_packed": feed_imageloader, "dataloader": feed_dataloader,
                 "dali_best": feed_dali}
        gens: dict[str, Any] = {}
        for name in args.model_rows:
            if args.smoke and name in ("dataloader", "dali_best"):
                continue
            g, err = C.guarded(lambda f=feeds[name]: f())
            if err is None:
                _, err = C.guarded(lambda g=g: [step(*next(g)) for _ in range(3)])
            if err is not None:
                rec["rows"][name] = {"skipped": err["error"]}
                continue
            gens[name] = g
            rec["rows"][name] = {"ips": [], "ratio": []}
            C.log(f"[{mname}] {name} started")
        for r in range(args.rounds):
            names = list(gens) if r % 2 == 0 else list(gens)[::-1]
            got: dict[str, float] = {}
            for name in names:
                # batches buffered while the other rows ran would be free steps: take them
                # without training, then a few untimed steps
                t_drain = time.perf_counter()
                for _ in range(args.drain):
                    next(gens[name])
                t_drain = time.perf_counter() - t_drain
                for _ in range(args.settle):
                    step(*next(gens[name]))
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                before = _decode_calls(loaders.get(name))
                t0 = time.perf_counter()
                in_next = 0.0  # the training thread's time getting its batches: waits for the loader
                batch = None
                for _ in range(steps):
                    tn = time.perf_counter()
                    batch = next(gens[name])
                    in_next += time.perf_counter() - tn
                    step(*batch)
                del batch
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                got[name] = steps * args.batch / (time.perf_counter() - t0)
                rec["rows"][name]["ips"].append(got[name])
                rec["rows"][name].setdefault("next_ms", []).append(1000 * in_next / max(steps, 1))
                after = _decode_calls(loaders.get(name))
                if before and after and after[1] > before[1]:
                    # the GPU decoder's call per batch while the model trains (its host side and
                    # its waits for the previous batch's kernels), against the loader-bound rows'
                    nb = after[1] - before[1]
                    rec["rows"][name].setdefault("decode_call_ms", []).append(1000 * (after[0] - before[0]) / nb)
                    for k in DECODE_STEPS:  # the call by step (in the C decoder), ms per batch
                        rec["rows"][name].setdefault(f"decode_{k}_ms", []).append(
                            (after[2][k] - before[2][k]) / 1e6 / nb)
                C.log(f"[{mname}] round {r} {name}: {got[name]:,.0f} img/s")
                if name in loaders:
                    # where a slow or stopped row spent its time: the decoders' counts (a hardware
                    # call that failed falls back to one CUDA decode per image) and the memory
                    st = loaders[name].stats()
                    gd = st.get("gpu_decoder") or {}
                    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
                    C.log(f"[{mname}]   {name}: drain of {args.drain} took {t_drain:.2f} s; decode calls "
                          f"{st.get('decode_call_s', 0):.1f} s in all; decoder counts "
                          f"{ {k: gd.get(k) for k in ('batches', 'hardware', 'cuda', 'raw', 'failed', 'workspace_bytes')} }; "
                          f"host-decoded {st.get('host_decoded')}; GPU memory free {free / 2**30:.1f} GiB, "
                          f"torch reserved {torch.cuda.memory_reserved(dev) / 2**30 if dev.type == 'cuda' else 0:.1f} GiB")
            for name in gens:
                rec["rows"][name]["ratio"].append(C.ratio(got[name], got.get("bound")))
        for name, g in gens.items():
            g.close()
        for v in rec["rows"].values():
            if "ips" in v:
                v["ips_summary"] = C.summarize(v["ips"])
                v["ratio_summary"] = C.summarize(v["ratio"])
            for key in [k for k in v if k.endswith("_ms") and v[k]]:  # next(), the decode calls
                v[f"{key}_summary"] = C.summarize(v[key])
        rec["rounds_done"] = args.rounds
    return out


# ---- main ----

def _by_round(v: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """A loader-bound row's (images/s, CPU per 1,000) keyed by the round it was measured in (a
    failed round has no entry; rows recorded without their rounds count theirs in order)."""
    rounds = v.get("rounds", range(len(v.get("ips", []))))
    return {int(r): (a, c) for r, a, c in zip(rounds, v.get("ips", []), v.get("cpu_per_1000", []))}


def ratio_lines(rows: dict[str, Any], first: str = "imageloader_packed") -> list[str]:
    """The first ImageLoader row against each other row, round by round (the rows of a round
    ran one after the other; a round one of the two lost is left out): images/s and CPU per
    image, median (range) over the rounds."""
    ran = [n for n in rows if rows[n].get("ips")]
    name = first if first in ran else next((n for n in ran if n.startswith("imageloader")), None)
    if name is None:
        return []
    mine = _by_round(rows[name])
    table = []

    def add(label: str, pairs: list[tuple[tuple[float, float], tuple[float, float]]]) -> None:
        speed = C.summarize([a[0] / b[0] for a, b in pairs if b[0] > 0])
        cpu = C.summarize([a[1] / b[1] for a, b in pairs if b[1] > 0])
        table.append([label, C.fmt_summary(speed, 2), C.fmt_summary(cpu, 2)])

    for other, v in rows.items():
        theirs = _by_round(v) if other != name else {}
        pairs = [(mine[r], theirs[r]) for r in mine if r in theirs]
        if pairs:
            add(other, pairs)
    # the strictest comparison: each round's fastest DALI configuration, whichever it was, among
    # the DALI rows that measured that round
    dali = [_by_round(v) for n, v in rows.items() if n.startswith("dali_") and v.get("ips")]
    if len(dali) > 1:
        pairs = [(mine[r], max((d[r] for d in dali if r in d), key=lambda x: x[0]))
                 for r in mine if any(r in d for d in dali)]
        if pairs:
            add("DALI, the fastest of its rows in each round", pairs)
    if not table:
        return []
    return ["", f"Per round, {name} over each row of the same round:", "",
            C.md_table(["row", "images/s ratio", "CPU per image ratio"], table, "lrr")]


def render(results: dict[str, Any], models: dict[str, Any], info: dict, args: Any) -> str:
    lines = ["# ImageLoader benchmark (bench_images.py)", ""]
    lines += C.machine_summary_lines(info) if not args.smoke else ["(smoke run on the host backend)"]
    for size_class, rows in results.items():
        epochs = next((v["epochs_per_run"] for v in rows.values() if "epochs_per_run" in v), None)
        lines += ["", f"## Loader-bound, {size_class}: {args.images} images, batch {args.batch}, 224 px "
                  f"{args.dtype}, {args.rounds} rounds", ""]
        if epochs is not None:
            lines += [f"Each run: {epochs} epoch(s) back to back; images/s over the batches after the first "
                      f"{args.skip_batches}, from the return of the last of those; then {args.settle_s:g} s untimed.",
                      ""]
        table = []
        for name, v in rows.items():
            if "ips_summary" in v:
                fill = C.fmt_summary(v["fill_summary"], 0) if "fill_summary" in v else ""
                table.append([name, C.fmt_summary(v["ips_summary"], 0), C.fmt_summary(v["cpu_summary"], 3), fill])
            else:
                table.append([name, f"not run: {v.get('skipped') or v.get('error')}", "", ""])
        lines.append(C.md_table(["row", "images/s", "CPU-s per 1,000 images",
                                 f"ms to the first {args.skip_batches} batches (untimed)"], table, "lrrr"))
        for name, v in rows.items():
            if "stopped_in_round" in v:
                lines += ["", f"{name} failed in round {v['stopped_in_round']} and was not run again "
                          f"(its figures are the rounds before): {v.get('error')}"]
        for name, v in rows.items():
            if v.get("gpu_decoder"):
                lines += ["", f"{name}'s GPU decoders at the end: " +
                          ", ".join(f"{k} {val}" for k, val in v["gpu_decoder"].items())]
        lines += ratio_lines(rows)
    for mname, rec in models.items():
        lines += ["", f"## {mname} ({rec['size_class']} images), batch {args.batch}, {args.steps} steps "
                  f"per row per round", ""]
        if "error" in rec:
            lines.append(f"error: {rec['error']}")
            continue
        table = []
        for name, v in rec["rows"].items():
            calls = C.fmt_summary(v["decode_call_ms_summary"], 1) if "decode_call_ms_summary" in v else ""
            waits = C.fmt_summary(v["next_ms_summary"], 2) if "next_ms_summary" in v else ""
            if "ips_summary" in v:
                table.append([name, C.fmt_summary(v["ips_summary"], 0), C.fmt_summary(v["ratio_summary"], 2),
                              waits, calls])
            else:
                table.append([name, f"not run: {v.get('skipped')}", "", "", ""])
        lines.append(C.md_table(["feed", "images/s", "ratio to the bound", "next() per step, ms",
                                 "GPU decode call per batch, ms"], table, "lrrrr"))
        for name, v in rec["rows"].items():
            got = [(k, v[f"decode_{k}_ms_summary"]) for k in DECODE_STEPS if f"decode_{k}_ms_summary" in v]
            if got:
                lines += ["", f"{name}'s decode call per batch by step, ms (the C decoder's own clock): " +
                          "; ".join(f"{k} {C.fmt_summary(sm, 2)}" for k, sm in got)]
        if rec.get("cuda_connections"):
            queues, why = rec["cuda_connections"]
            lines += ["", f"CUDA hardware work queues (ImageLoader's stats()): {queues} ({why})"]
    if models:
        lines += ["", "next() per step: the training thread's time in next() on its feed during the timed "
                  "steps: its waits for the loader, with the feed's own host work (and, for the "
                  "DataLoader and DALI rows, their label copies); the GPU waits for an ImageLoader batch "
                  "on the device, not here. GPU decode call: ImageLoader's decoder calls while the "
                  "model trains, host time per batch; by step, the calls that succeeded "
                  "(src/core/jpeg_cuda.h)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-class", type=C.choice_list(["imagenet", "highres"]), default=["imagenet", "highres"])
    ap.add_argument("--images", type=int, default=8192, help="images per size class (one epoch)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=C.choice_list(LOADER_ROWS), default=list(LOADER_ROWS))
    ap.add_argument("--skip-batches", type=_count(0), default=4,
                    help="loader-bound: batches of each run not timed (ready before the run began, or "
                         "the loader's start-up; 0 credits a loader with what it prepared before)")
    ap.add_argument("--min-batches", type=_count(1), default=40,
                    help="loader-bound: timed batches each run has at least (epochs run back to back)")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="loader-bound: untimed wait after each run (CPU time counted to the row)")
    ap.add_argument("--variant", type=_variant, action="append", default=[],
                    help="NAME:VAR=VALUE[+VAR=VALUE...]: a row imageloader_packed_NAME made and run with each VAR "
                         f"set, VAR one of {', '.join(VARIANT_VARS)} (repeatable)")
    ap.add_argument("--models", type=C.choice_list(list(MODELS)), default=[],
                    help="real models against the bound (e.g. resnet50,resnet18,efficientnet_b0,vit_b_16)")
    ap.add_argument("--steps", type=int, default=50, help="training steps per row per round")
    ap.add_argument("--drain", type=int, default=40,
                    help="batches taken without training before each timed row (what a loader "
                         "buffered while the other rows ran)")
    ap.add_argument("--settle", type=int, default=3, help="untimed training steps before each timed row")
    ap.add_argument("--workers", type=int, default=15, help="DataLoader workers")
    ap.add_argument("--dali-threads", type=int, default=8)
    ap.add_argument("--dali-sweep", type=_dali_config, default=[],
                    help="LOAD:THREADS,...: one more DALI loader-bound row per configuration "
                         "(hw_decoder_load, num_threads), named dali_LOAD_THREADSt, so that DALI's "
                         "best configuration on the machine is found in the same rounds")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "uint8"])
    ap.add_argument("--data-dir", type=Path, default=None, help="keep the generated datasets here")
    ap.add_argument("--smoke", action="store_true",
                    help="a few small images on the host backend, the ImageLoader rows and the tiny model")
    ap.add_argument("--model-rows", type=C.choice_list(MODEL_ROWS), default=list(MODEL_ROWS),
                    help="the feeds of the --models table (the bound is always kept first)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds; Python's default is 0.005): how "
                         "long a thread that wants the GIL waits for the training thread to let it go")
    ap.add_argument("--model-stream", default="default", choices=["default", "side"],
                    help="the stream the --models table trains on: torch's default (the legacy "
                         "default stream, which blocking streams and synchronous copies wait for) "
                         "or a stream of torch's own made for the run (non-blocking); every feed "
                         "of the table on the same one")
    ap.add_argument("--stall-s", type=float, default=120,
                    help="when nothing is logged for this long, write the process's stacks to "
                         "<out>/<name>_stall.txt and end the run with exit status 3 (0: off)")
    C.add_output_args(ap, "images")
    args = ap.parse_args(argv)
    args.model_rows = ["bound"] + [r for r in args.model_rows if r != "bound"]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.smoke:
        C.smoke_out(args)
        args.device, args.images, args.batch, args.rounds, args.steps = "cpu", 48, 8, 2, 2
        args.drain, args.settle = 2, 1
        args.skip_batches, args.min_batches, args.settle_s = 1, 6, 0.0
        args.size_class = ["imagenet"]
        args.rows = ["imageloader_packed", "imageloader_tar", "imageloader_folder"]
        args.models = [m for m in args.models if m == "tiny"] or ["tiny"]
        args.dtype = "float32"
        args.workers = 0
        import torch
    else:
        # what ImageLoader asks for when made before CUDA is first initialized (the images guide):
        # this benchmark measures the GPU before it makes its loaders, so it asks here, for every
        # row alike (a value set in the environment is kept; the result's Settings line shows it)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        torch = C.require_cuda(args.device)
    if not args.smoke:
        C.watch_for_stalls(args.stall_s, Path(args.out) / f"{args.name}_stall.txt", exit_code=3, grace=45)
    info = C.machine_info(torch if not args.smoke else None, args.device)
    with data_root(args.data_dir, "pl-bench-images-") as root:
        datasets = {}
        for sc in args.size_class + (["highres"] if "vit_b_16" in args.models and "highres" not in args.size_class else []):
            datasets[sc] = dataset(root, sc, args.images, args.smoke)
        results = {sc: loader_bound(datasets[sc], args, torch, sc) for sc in args.size_class}
        models = models_table(datasets, args, torch) if args.models else {}
        payload = {"args": vars(args), "machine": info, "loader_bound": results, "models": models}
        C.publish(args.out, args.name, payload, render(results, models, info, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
