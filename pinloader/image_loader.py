"""ImageLoader: batches of encoded images (JPEG files in an ImageFolder tree, a list of paths,
WebDataset tar shards, or a packed dataset), decoded, cropped, resized, flipped, normalized and
cast on the GPU by nvJPEG and pinloader's image kernel, or by Pillow on the host backend.

The loader is a source for :class:`pinloader.AsyncPrefetcher`, as ArrayLoader's batches are: it
shares ArrayLoader's epoch plan (the seeded permutation, the sharding, the batches:
pinloader/_epoch_plan.py) and its checkpoint format and re-sharding (pinloader/_resume.py), so
everything the ArrayLoader's module documentation says under "Sampling" and "Resuming" holds
here with images as the items. Each epoch's batches are made by a generator on the
prefetcher's producer thread (pinloader/_image_epochs.py):

* GPU (a CUDA device, nvJPEG found): the batch's encoded bytes as ragged rows of one buffer
  (the region the packed file or the tar shards are mapped into, or the files read by native
  threads into one buffer: pinloader/_image_sources.py), read one batch ahead on a thread of
  their own; the crop parameters from the images' header sizes (Note [image parameters] in
  pinloader/_image_ops.py); then one ``JpegDecoder.decode`` call (src/py/jpeg_decoder.c) that
  decodes on the GPU's JPEG engines and runs the resampling kernel into the batch. The image
  is a device array the prefetcher passes through (it is already where it is going) and that
  ``__next__`` hands to a framework door's import; the labels travel the usual way. Images
  nvJPEG does not take (PNG and other formats, JPEGs with other than 1 or 3 components,
  anything it fails on) are decoded by the host decoder and handed to the same call
  (``raw=``), so the kernel still crops them; ``stats()`` counts them by reason.
* Host: each sample decoded, resampled, normalized and laid out by Pillow and NumPy on the
  loader's worker threads (both release the GIL while they compute), up to two batches ahead
  of the one the producer waits for; the batch is copied by the prefetcher like any other.

Each item the generator yields is ``(batch, _Tag)``: the tag says which planned batch it is,
so that skipped samples (``on_error="skip"``) never shift the position a checkpoint records.
The generator holds the GIL while it plans a batch (a few NumPy calls), not while images are
read or decoded. ArrayLoader's epochs are made in C without the GIL (Note [native epochs] in
src/py/row_batches.c); the image epochs are not yet.

Both take the same parameters for the same (seed, epoch, sample): the crops are the same on
every backend, rank and resume.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from . import _C, _cudart, _device, _hardware_queues, _resume
from ._C import AsyncPrefetcher
from ._epoch_plan import epoch_order, Plan
from ._image_epochs import ImageDecodeError, decoder_info, decoder_options, decoders_wanted, ImageEpochs, Runner
from ._iter_state import IterState
from . import _image_ops as ops
from ._image_sources import make_source
from ._loader_base import EpochLoader, epoch_arg, int_arg, prefetch_opts_arg, rank_world

__all__ = ["ImageLoader", "ImageDecodeError"]

FORMAT = "pinloader.ImageLoader"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_DTYPES = ("uint8", "float16", "bfloat16", "float32")
_LAYOUTS = {"NCHW": False, "NHWC": True, "channels_last": True}
_DEFAULT_DEPTH = 3
_KEYWORDS = ("batch_size", "train", "size", "resize", "scale", "ratio", "flip", "mean", "std", "dtype",
             "layout", "keys", "shuffle", "seed", "drop_last", "device", "depth", "rank", "world_size",
             "decoder", "workers", "on_error")
# The most images a batch holds: what one call of the GPU decoder takes (src/py/jpeg_decoder.c).
_MAX_BATCH = 65535


def _int_arg(name: str, value: Any, lo: int) -> int:
    return int_arg("ImageLoader", name, value, lo)


def _pair(name: str, v: Any) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v), int(v))
    try:
        a, b = v
    except (TypeError, ValueError):
        raise TypeError(f"ImageLoader: {name} must be an int or (height, width), got {v!r}") from None
    out = (_int_arg(name, a, 1), _int_arg(name, b, 1))
    if max(out) > 16384:
        raise ValueError(f"ImageLoader: {name} must be at most 16384, got {out}")
    return out


def _range(name: str, v: Any, lo: float) -> tuple[float, float]:
    try:
        if isinstance(v, (str, bytes)):  # "12" is no (1.0, 2.0)
            raise TypeError
        a, b = (float(x) for x in v)
    except (TypeError, ValueError):
        raise TypeError(f"ImageLoader: {name} must be two numbers, got {v!r}") from None
    if not (lo < a <= b) or not np.isfinite(b):
        raise ValueError(f"ImageLoader: {name} must be (low, high) with {lo} < low <= high, got {v!r}")
    return a, b


class ImageLoader(EpochLoader):
    """Shuffled, sharded batches of images from JPEG files, tar shards or a packed file,
    decoded on the GPU (nvJPEG) or on the host (Pillow), with torchvision's crops.

    Parameters
    ----------
    source : str, path, list
        A folder in torchvision's ``ImageFolder`` layout (``root/<class>/<image>``; labels are
        the sorted class folders' positions, as torchvision's), a packed dataset folder
        (written by ``python -m pinloader pack``), a ``.tar`` shard or a list of them
        (WebDataset: ``key.jpg`` with ``key.cls``), or a list of ``(path, label)``.
    batch_size : int
        Images per batch, 1 to 65,535.
    train : bool, default True
        ``True``: torchvision's ``RandomResizedCrop(size, scale, ratio)`` and a random
        horizontal flip. ``False``: ``Resize(resize)`` then ``CenterCrop(size)``.
    size : int or (height, width), default 224
        The output images' size.
    resize : int, optional
        ``train=False``: the shorter side before the center crop (default
        ``round(max(size) / 0.875)``, 256 for 224, at most 16,384), at least ``max(size)``.
    scale, ratio : (float, float)
        ``RandomResizedCrop``'s (defaults ``(0.08, 1.0)``, ``(3/4, 4/3)``).
    flip : bool, optional
        Random horizontal flip (default: ``train``).
    mean, std : three floats, or None
        Normalization (default ImageNet's): ``(pixel / 255 - mean) / std``. None: ``pixel /
        255``. Not applied to ``dtype="uint8"``, which gives the pixels.
    dtype : {"float32", "float16", "bfloat16", "uint8"}, default "float32"
    layout : {"NCHW", "NHWC"}, default "NCHW"
        ``"NHWC"`` (alias ``"channels_last"``): images of shape (B, H, W, 3); in torch,
        ``image.permute(0, 3, 1, 2)`` is then a (B, 3, H, W) tensor in channels_last memory
        format, without a copy.
    keys : (str, str), default ("image", "label")
        The batch dict's keys.
    shuffle : bool, optional
        Default: ``train``.
    seed, drop_last, device, depth, rank, world_size
        As for :class:`pinloader.ArrayLoader`.
    decoder : {"auto", "gpu", "host"}, default "auto"
        ``"auto"``: the GPU decoder on a CUDA device when nvJPEG can be loaded, else the host
        decoder (the reason in ``stats()["decoder_reason"]``). ``"gpu"``: an error when it
        cannot be had.
    workers : int, optional
        Host decoder threads (default: the CPUs this process may use, at most 32).
    on_error : {"raise", "skip"}, default "raise"
        A sample that cannot be read or decoded: ``ImageDecodeError`` naming its index and its
        file or shard member, or skipped (its batch is one image shorter) and counted in
        ``stats()["skipped"]``.
    **prefetch_opts
        Passed to :class:`pinloader.AsyncPrefetcher`: those ArrayLoader takes (``pool``,
        ``max_pinned_bytes``, ``staging_threads``, ``copy_stream_priority``, ``output``,
        ``stream``, ``convert``, ``static``, ``out``); another is a TypeError. ``static=True`` or ``out=`` batches are
        made by the host decoder (the prefetcher copies them into its static buffers).

    The iteration, ``set_epoch``, ``indices``, ``state_dict`` / ``load_state_dict`` (exact, and
    re-sharded to another world size) and the framework doors are ArrayLoader's.

    A loader that may decode on the GPU, made where a CUDA driver is installed but before CUDA is
    first initialized in the process (before ``torch.cuda.is_available()`` for one), sets
    ``CUDA_DEVICE_MAX_CONNECTIONS=32`` in ``os.environ`` unless it is set already: with the
    driver's default of 8 hardware work queues, its decode calls beside a model lasted about
    twice as long and the model waited for it.
    Making a loader never initializes CUDA itself; made later, it leaves the variable alone. The
    keys ``cuda_connections`` and ``cuda_connections_reason`` of ``stats()`` say what was
    requested and why.
    """

    _NAME = "ImageLoader"
    _DEFAULT_DEPTH = _DEFAULT_DEPTH

    windows = None  # (the resume machinery's; an image loader has no windows)

    def __init__(self, source: Any, batch_size: int, *, train: bool = True, size: Any = 224,
                 resize: int | None = None, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), flip: bool | None = None,
                 mean: Sequence[float] | None = IMAGENET_MEAN, std: Sequence[float] | None = IMAGENET_STD,
                 dtype: str = "float32", layout: str = "NCHW", keys: Sequence[str] = ("image", "label"),
                 shuffle: bool | None = None, seed: int = 0, drop_last: bool = False, device: Any = None,
                 depth: int | None = None, rank: int | None = None, world_size: int | None = None,
                 decoder: str = "auto", workers: int | None = None, on_error: str = "raise",
                 **prefetch_opts: Any) -> None:
        self._pf: AsyncPrefetcher | None = None
        self._closed = False
        self._runner: Runner | None = None
        self.batch_size = _int_arg("batch_size", batch_size, 1)
        decoders_wanted()  # a bad PINLOADER_JPEG_DECODERS is refused here, not at the first batch
        decoder_options()  # and a bad PINLOADER_JPEG_INTERPOLATE
        if self.batch_size > _MAX_BATCH:
            # the GPU decoder's call takes this many; one limit whichever decoder runs, so a
            # job made on a laptop does not fail on the GPU machine
            raise ValueError(f"ImageLoader: batch_size must be at most {_MAX_BATCH}, got {self.batch_size}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"ImageLoader: seed must be an int, not {type(seed).__name__}")
        self.seed = int(seed)
        self.train = bool(train)
        self.shuffle = self.train if shuffle is None else bool(shuffle)
        self.drop_last = bool(drop_last)
        if not isinstance(dtype, str):  # np.dtype("uint8") == "uint8", but is no key of a dict of str
            raise TypeError(f"ImageLoader: dtype must be one of the str {_DTYPES}, got {dtype!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"ImageLoader: dtype must be one of {_DTYPES}, got {dtype!r}")
        if layout not in _LAYOUTS:
            raise ValueError(f"ImageLoader: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if decoder not in ("auto", "gpu", "host"):
            raise ValueError(f"ImageLoader: decoder must be 'auto', 'gpu' or 'host', got {decoder!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"ImageLoader: on_error must be 'raise' or 'skip', got {on_error!r}")
        if isinstance(keys, (str, bytes)):  # "il" is no ("i", "l")
            raise TypeError(f"ImageLoader: keys must be two different str, got {keys!r}")
        keys = tuple(keys)
        if len(keys) != 2 or not all(isinstance(k, str) for k in keys) or keys[0] == keys[1]:
            raise ValueError(f"ImageLoader: keys must be two different str, got {keys!r}")
        size_hw = _pair("size", size)
        if resize is None:  # no more than the largest resize taken (size is at most that)
            resize = min(16384, int(round(max(size_hw) / 0.875)))
        resize = _int_arg("resize", resize, 1)
        if resize > 16384:  # as size: the crop parameters are int32, resized sides bounded
            raise ValueError(f"ImageLoader: resize must be at most 16384, got {resize}")
        if not train and resize < max(size_hw):
            # the resized image could be smaller than the crop, which torchvision's CenterCrop
            # pads with zeros and the resampling kernel cannot
            raise ValueError(f"ImageLoader: resize ({resize}) must be at least the larger side of size "
                             f"{size_hw} when train=False (torchvision's CenterCrop would pad the "
                             "resized image)")
        if (mean is None) != (std is None):
            raise ValueError("ImageLoader: give both mean and std, or neither")
        if mean is not None and std is not None:
            try:
                if isinstance(mean, (str, bytes)) or isinstance(std, (str, bytes)):
                    raise TypeError
                m3, s3 = tuple(float(x) for x in mean), tuple(float(x) for x in std)
            except (TypeError, ValueError):
                raise TypeError(f"ImageLoader: mean and std must be three numbers each, got {mean!r:.60} "
                                f"and {std!r:.60}") from None
            if len(m3) != 3 or len(s3) != 3 or not np.isfinite(m3 + s3).all() or not all(x > 0 for x in s3):
                raise ValueError(f"ImageLoader: mean and std must be three finite numbers each, std "
                                 f"positive, got {m3} and {s3}")
        if dtype == "bfloat16":
            try:
                import torch  # noqa: F401 -- the host decoder's bfloat16 cast
            except ImportError:
                raise ValueError("ImageLoader: dtype='bfloat16' needs torch (the host decoder casts "
                                 "with it)") from None
        self.decoder = decoder
        self.dtype, self.layout = dtype, layout
        self._device = _device.canonical(device, "ImageLoader")
        # where the GPU may decode, before CUDA is initialized (which making a loader never
        # does): Note [hardware work queues] in src/core/backend_cuda.c
        self._queues: tuple[int | None, str] | None = None
        if decoder != "host" and self._device != "cpu":
            self._queues = _hardware_queues.ask()
        self._depth = None if depth is None else _int_arg("depth", depth, 1)
        self._opts = prefetch_opts_arg("ImageLoader", prefetch_opts, _KEYWORDS)
        if workers is None:
            try:
                workers = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                workers = os.cpu_count() or 1
            workers = max(1, min(32, workers))
        workers = _int_arg("workers", workers, 1)

        self.rank, self.world_size = rank_world("ImageLoader", rank, world_size)

        scale_r, ratio_r = _range("scale", scale, 0.0), _range("ratio", ratio, 0.0)
        src = make_source(source)  # last: a large tree takes a while to walk
        self.source = src
        self.num_rows = self.num_items = len(src)
        self.classes = getattr(src, "classes", None)
        if self.drop_last:
            self.num_samples = self.num_items // self.world_size
        else:
            self.num_samples = -(-self.num_items // self.world_size)
        n_batches = (self.num_samples // self.batch_size if self.drop_last
                     else -(-self.num_samples // self.batch_size))
        plan = Plan()
        # the resume machinery's record of the sources (pinloader/_resume.py fingerprint)
        plan.leaves = [(f"images[{src.kind}]", None, False, (self.num_items,))]
        plan.dtypes = {plan.leaves[0][0]: "encoded"}
        plan.batch_size, plan.n_batches = self.batch_size, n_batches
        plan.window = None
        plan.num_rows, plan.num_items, plan.num_samples = self.num_items, self.num_items, self.num_samples
        plan.rank, plan.world_size, plan.seed = self.rank, self.world_size, self.seed
        plan.shuffle, plan.drop_last = self.shuffle, self.drop_last
        self._plan = plan
        cfg = dict(batch_size=self.batch_size, train=self.train, size=size_hw, resize=resize,
                   scale=scale_r, ratio=ratio_r,
                   flip=self.train if flip is None else bool(flip), seed=self.seed,
                   dtype=dtype, channels_last=_LAYOUTS[layout], keys=keys,
                   norm=ops.norm_constants(mean, std, dtype), workers=workers, on_error=on_error)
        self._runner = Runner(src, cfg)
        # where the iteration is: epochs, batches handed out, a loaded state to resume at
        self._it = IterState()
        self._source = ImageEpochs(self._runner, plan, self._it)
        self._decoder_kind = ""
        self._decoder_reason = ""
        self._decoder_key: tuple[str, bool] | None = None
        self._pf_settings: tuple[Any, int, dict[str, Any]] | None = None

    # ---- sampling ----

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample order for ``epoch`` (as :meth:`pinloader.ArrayLoader.indices`)."""
        return epoch_order(self._plan, epoch_arg("ImageLoader", epoch)).view()

    def indices_after(self, epoch: int, position: int) -> np.ndarray:
        """This rank's sample order for what is left of ``epoch`` once the ranks together were
        handed its first ``position`` images (as :meth:`pinloader.ArrayLoader.indices_after`)."""
        for name, v in (("epoch", epoch), ("position", position)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"ImageLoader: {name} must be an int, not {type(v).__name__}")
        if position < 0:
            raise ValueError(f"ImageLoader: position must be >= 0, got {position}")
        return _resume.resumed_order(self._plan, epoch_arg("ImageLoader", epoch), int(position))

    def params(self, epoch: int, indices: Any) -> np.ndarray:
        """The resampling parameters (int32 (n, 9), Note [image parameters] in
        pinloader/_image_ops.py) the loader uses for these samples in ``epoch``; the image sizes
        are read from the samples' headers."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        runner = self._runner
        assert runner is not None
        epoch = epoch_arg("ImageLoader", epoch)

        def size(i: int) -> np.ndarray:
            if not 0 <= i < self.num_items:  # (a negative index would name another sample)
                raise IndexError(f"ImageLoader.params: sample {i} is not in 0..{self.num_items - 1}")
            try:
                data = runner.src.read_one(i)
            except OSError as e:
                raise runner.fail(i, f"cannot be read ({e})") from None
            try:
                return runner.header(i, data)
            except ValueError as e:
                raise runner.fail(i, str(e)) from None
        hw = np.stack([size(int(i)) for i in idx]) if len(idx) else np.zeros((0, 3), np.int32)
        return runner.params(epoch, idx, hw)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (as ``DistributedSampler.set_epoch``)."""
        self._it.requested = epoch_arg("ImageLoader", epoch)

    @property
    def epoch(self) -> int | None:
        return self._it.epoch

    # ---- iteration ----

    def _choose_decoder(self, settings: tuple[Any, int, dict[str, Any]]) -> None:
        """The GPU decoder where it can be had for these settings (static=/out= batches are the
        host's); kept while the settings call for the same one."""
        runner = self._runner
        assert runner is not None
        device, _, opts = settings
        static = bool(opts.get("static")) or opts.get("out") is not None
        key = (str(device), static)
        if self._decoder_kind and self._decoder_key == key:
            return
        self._release_decoder()
        why = ""
        if self.decoder == "host":
            why = "decoder='host'"
        elif static:
            why = "static=/out= batches are filled by the prefetcher from host batches"
        elif device is None and not _C.cuda_available():
            why = "no CUDA device (the host backend)"
        elif device == "cpu":  # canonical (Note [device spellings] in pinloader/_device.py)
            why = f"device={device!r}"
        if not why:
            made_with = decoder_options()
            try:
                runner.decoder = _C.JpegDecoder(device, libraries=_cudart.nvjpeg_candidates(), **made_with)
                runner.decoder_factory = lambda: _C.JpegDecoder(device, libraries=_cudart.nvjpeg_candidates(),
                                                                **made_with)
            except (RuntimeError, ValueError, OSError, _C.CudaError) as e:
                why = f"the GPU decoder is not available ({e})"
        if why and self.decoder == "gpu":
            raise RuntimeError(f"ImageLoader: decoder='gpu' cannot be used: {why}")
        self._decoder_kind = "gpu" if runner.decoder is not None else "host"
        self._decoder_reason = why
        self._decoder_key = key

    def _make_prefetcher(self, settings: tuple[Any, int, dict[str, Any]]) -> AsyncPrefetcher:
        self._choose_decoder(settings)
        device, depth, opts = settings
        if opts.get("static") or opts.get("out") is not None:
            # static buffers for a whole batch, even when a resumed epoch starts short
            opts = dict(opts, static_rows=self.batch_size)
        pf = AsyncPrefetcher(self._source, device=device, depth=depth, **opts)
        self._pf_settings = settings
        return pf

    def __next__(self) -> Any:
        batch, tag = self._take()
        self._it.consumed = tag.batch + 1
        k = self._runner.cfg["keys"][0] if self._runner is not None else "image"
        img = batch[k]
        opts = self._pf_settings[2] if self._pf_settings is not None else {}
        if isinstance(img, _C.DeviceArray) and img.device.startswith("cuda") and "convert" in opts:
            batch[k] = self._convert(img, opts)
        return batch

    def _convert(self, arr: Any, opts: dict[str, Any]) -> Any:
        """A door's import applied to the GPU-decoded image (the prefetcher passed it through):
        as the door does for the leaves it copies (Note [per-batch import] in
        pinloader/_door.py)."""
        convert = opts["convert"]
        if opts.get("output") == "capsule":
            stream = opts.get("stream")
            s = stream() if callable(stream) else stream
            return convert(_C.export_capsules([arr], s)[0])
        return convert(arr)

    def _release_decoder(self) -> None:
        runner = self._runner
        if runner is not None:
            runner.close_decoders()
            runner.decoder_factory = None
        self._decoder_kind = ""

    # ---- the rest ----

    @property
    def valid_rows(self) -> int | None:
        rows: int | None = self._pf.valid_rows if self._pf is not None else None
        return rows

    def stats(self) -> dict[str, Any]:
        """The prefetcher's stats, the epoch, rank and world size, and the decoder's: ``decoder``
        (``"gpu"`` or ``"host"``, with ``decoder_reason``), ``samples`` decoded, the producer's
        seconds waiting for a batch's bytes (GPU) or decoded images (host)
        (``producer_wait_s``) and in GPU decode calls (``decode_call_s``), ``skipped`` (and
        the first ``skipped_samples``: index, name, reason), ``host_decoded`` on the GPU path
        (with ``host_decoded_reasons``: reason -> count), and ``gpu_decoder``
        (``JpegDecoder.info()``: batches, hardware, cuda, raw, failed, engines,
        workspace_bytes, and the decode calls' host time by step, summed over the calls that
        succeeded and over the decoders: ``headers_ns``, ``engines_wait_ns`` (before the JPEG
        engines write: waiting for the previous batch's kernels, or for the whole stream after
        the workspace grew), ``engines_ns``, ``cuda_ns`` (nvJPEG's CUDA decoder),
        ``block_ns`` (the batch's device memory), ``kernels_ns``; and ``chroma_interpolated``,
        whether the engines upsample chroma as libjpeg-turbo does; src/core/jpeg_cuda.h).
        Where the GPU decodes (or may, before the first batch): ``cuda_connections``, the CUDA
        driver's hardware work queues requested for this process's contexts (None when unknown,
        when there is no driver, or for a value the driver does not take), and
        ``cuda_connections_reason``: the loader asks for 32 before CUDA is first initialized
        (the images guide)."""
        s = dict(self._pf.stats()) if self._pf is not None else {}
        runner = self._runner
        s.update(epoch=self._it.epoch, rank=self.rank, world_size=self.world_size,
                 batches_per_epoch=len(self), source=self.source.kind,
                 decoder=self._decoder_kind or None, decoder_reason=self._decoder_reason)
        if self._queues is not None and self._decoder_kind != "host":  # "": not chosen yet
            s.update(cuda_connections=self._queues[0], cuda_connections_reason=self._queues[1])
        if runner is not None:
            c = runner.counts
            s.update(samples=c["samples"], skipped=c["skipped"], producer_wait_s=c["wait_s"],
                     decode_call_s=c["decode_call_s"],
                     skipped_samples=[dict(x) for x in c["skipped_samples"]],
                     host_decoded=c["host_decoded"], host_decoded_reasons=dict(c["host_decoded_reasons"]))
            if runner.decoder is not None:
                try:
                    s["gpu_decoder"] = decoder_info([runner.decoder, *runner.extra_decoders])
                except ValueError:
                    pass
        return s

    def close(self) -> None:
        """Stop the prefetcher, the decoder threads and the GPU decoder, and unmap the files.
        Idempotent."""
        if self._pf is not None:
            self._pf.close()
            self._pf = None
        self._closed = True
        if self._runner is not None:
            self._runner.close()
        self._it.resume_run = None
        self._plan.release_orders()

    def __repr__(self) -> str:
        return (f"pinloader.ImageLoader({self.source.kind}, images={self.num_items}, "
                f"batch_size={self.batch_size}, train={self.train}, shuffle={self.shuffle}, "
                f"seed={self.seed}, rank={self.rank}, world_size={self.world_size}, batches={len(self)})")

    # ---- checkpoint and resume (pinloader/_resume.py) ----

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, as :meth:`pinloader.ArrayLoader.state_dict` says (items are
        images; skipped images count as handed out), with ``format`` ``"pinloader.ImageLoader"``."""
        state = _resume.state_of(self, self._it, self._plan)
        state["format"] = FORMAT
        return state

    def load_state_dict(self, state: dict[str, Any], *, allow_changed: Any = ()) -> None:
        """Continue from ``state`` (as :meth:`pinloader.ArrayLoader.load_state_dict`: exact, and
        re-sharded when the world size changed)."""
        self._check_open()
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"ImageLoader.load_state_dict: not an ImageLoader state (format={got!r})")
        state = dict(state, format=_resume.FORMAT)
        epoch, position = _resume.validate(self, self._plan, state, allow_changed)
        if self._pf is not None:  # what it prefetched is not what comes next
            self._pf.close()
            self._pf = None
        _resume.load(self._it, state, epoch, position, self.num_items, self.world_size)
