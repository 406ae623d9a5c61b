"""ImageLoader: batches of encoded images (JPEG files in an ImageFolder tree, a list of paths,
WebDataset tar shards, or a packed dataset), decoded, cropped, resized, flipped, normalized and
cast on the GPU by nvJPEG and pinloader's image kernel, or by Pillow on the host backend.

The loader is a source for :class:`pinloader.AsyncPrefetcher`, as ArrayLoader's batches are: it
shares ArrayLoader's epoch plan (the seeded permutation, the sharding, the batches:
pinloader/_epoch_plan.py) and its checkpoint format and re-sharding (pinloader/_resume.py), so
everything the ArrayLoader's module documentation says under "Sampling" and "Resuming" holds
here with images as the items. Each epoch's batches are made by a generator on the
prefetcher's producer thread:

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

import bisect
import collections
import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np

from . import _C, _cudart, _device, _resume
from ._C import AsyncPrefetcher
from ._epoch_plan import _order, _Plan, prepare_order
from ._iter_state import IterState
from . import _image_ops as ops
from ._image_sources import make_source
from ._loader_base import _EpochLoader, _epoch_arg
from .array_loader import _default_rank_world, _int_arg

__all__ = ["ImageLoader", "ImageDecodeError"]

FORMAT = "pinloader.ImageLoader"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_DTYPES = ("uint8", "float16", "bfloat16", "float32")
_LAYOUTS = {"NCHW": False, "NHWC": True, "channels_last": True}
_DEFAULT_DEPTH = 3
# The most images a batch holds: what one call of the GPU decoder takes (src/py/jpeg_decoder.c).
_MAX_BATCH = 65535
_HOST_AHEAD = 2  # host batches decoding ahead of the one the producer waits for
_SKIP_RECORDS = 16  # skipped samples kept in stats() (the count is exact)
_RAW_SIDE = 65535  # the longest side of a host-decoded image JpegDecoder.decode takes (raw=)
_MAX_DECODERS = 8  # PINLOADER_JPEG_DECODERS's bound (Note [decoder threads])
_DEFAULT_DECODERS = 2  # its default (Note [decoder threads])


def _decoders_wanted() -> int:
    """GPU decoders per loader, each on its own thread: PINLOADER_JPEG_DECODERS, default
    _DEFAULT_DECODERS (Note [decoder threads])."""
    text = os.environ.get("PINLOADER_JPEG_DECODERS", "").strip()
    if not text:
        return _DEFAULT_DECODERS
    # ASCII digits only: str.isdigit() also passes "²" and "３", which int() refuses or converts
    try:
        k = int(text) if text.isascii() and text.isdigit() else 0
    except ValueError:  # past int()'s 4,300 digits
        k = 0
    if not 1 <= k <= _MAX_DECODERS:
        raise ValueError(f"PINLOADER_JPEG_DECODERS must be an integer from 1 to {_MAX_DECODERS}, "
                         f"got {text[:40]!r}")
    return k


class ImageDecodeError(ValueError):
    """A sample that cannot be read or decoded (``on_error="raise"``): names the sample index
    and its file or shard member."""


class _Tag:
    """Which of the epoch's planned batches an item is: a pass-through leaf the loader's
    ``__next__`` takes off (skipped samples make batches smaller, never fewer)."""

    __slots__ = ("batch",)

    def __init__(self, batch: int) -> None:
        self.batch = batch


class _Runner:
    """What the epochs' generators need, without a reference to the loader (the loader holds
    the prefetcher, which holds the source)."""

    def __init__(self, src: Any, cfg: dict[str, Any]) -> None:
        self.src = src
        self.cfg = cfg
        self.decoder: Any = None     # a JpegDecoder on the GPU path
        # more decoders for Note [decoder threads]: made by decoder_factory when an epoch wants them
        self.decoder_factory: Any = None
        self.extra_decoders: list[Any] = []
        self.decode_pool: ThreadPoolExecutor | None = None
        self.decode_pool_pid = self.decode_pool_k = 0
        self.lock = threading.Lock()  # counts, from the decoder threads
        self.lock_pid = os.getpid()
        # each batch's number, taken on the producer in the batches' order: skipped samples are
        # recorded in that order whatever thread skips them first (skip)
        self.batch_seq = itertools.count()
        self.skip_seqs: list[int] = []  # the batch numbers of counts["skipped_samples"]
        self.closed = False
        self.pool: ThreadPoolExecutor | None = None
        self.pool_pid = 0
        self.read_pool: ThreadPoolExecutor | None = None
        self.read_pool_pid = 0
        self.counts: dict[str, Any] = {"samples": 0, "skipped": 0, "skipped_samples": [],
                                       "host_decoded": 0, "host_decoded_reasons": {},
                                       # the producer's seconds: waiting for a batch's bytes (GPU)
                                       # or for its decoded images (host), and in decode() calls
                                       "wait_s": 0.0, "decode_call_s": 0.0}

    # ---- shared ----

    def workers(self) -> ThreadPoolExecutor:
        if self.pool is None or self.pool_pid != os.getpid():
            self.pool = ThreadPoolExecutor(max_workers=self.cfg["workers"], thread_name_prefix="pl-image")
            self.pool_pid = os.getpid()
        return self.pool

    def fail(self, i: int, why: str) -> ImageDecodeError:
        return ImageDecodeError(f"ImageLoader: sample {int(i)} ({self.src.name(i)}): {why}")

    def count(self, key: str, value: float) -> None:
        with self.lock:
            self.counts[key] += value

    def skip(self, i: int, why: str, seq: int) -> None:
        """Sample i of batch number ``seq`` (batch_seq) skipped: counted, and recorded when it is
        among the first _SKIP_RECORDS in the batches' order (a batch's own in its order)."""
        name = self.src.name(i)
        with self.lock:
            c = self.counts
            c["skipped"] += 1
            at = bisect.bisect_right(self.skip_seqs, seq)
            if at < _SKIP_RECORDS:
                self.skip_seqs.insert(at, seq)
                c["skipped_samples"].insert(at, {"index": int(i), "name": name, "reason": why})
                del self.skip_seqs[_SKIP_RECORDS:], c["skipped_samples"][_SKIP_RECORDS:]

    def bad(self, i: int, why: str, seq: int) -> None:
        if self.cfg["on_error"] == "raise":
            raise self.fail(i, why)
        self.skip(i, why, seq)

    def host_reason(self, why: str) -> None:
        with self.lock:
            c = self.counts
            c["host_decoded"] += 1
            r = c["host_decoded_reasons"]
            r[why] = r.get(why, 0) + 1

    def params(self, epoch: int, idx: np.ndarray, hw: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        if cfg["train"]:
            u = ops.draws(cfg["seed"], epoch, idx)
            return ops.train_params(hw[:, :2], u, cfg["size"], cfg["scale"], cfg["ratio"], cfg["flip"])
        return ops.eval_params(hw[:, :2], cfg["size"], cfg["resize"])

    def header(self, i: int, data: Any) -> np.ndarray:
        """The sample's (h, w, components), from the cache or its header (then cached)."""
        hw: np.ndarray = self.src.hw[i]
        if hw[0] > 0:
            return hw
        h, w, c = ops.image_info(data)
        self.src.hw[i] = (h, w, c)
        row: np.ndarray = self.src.hw[i]
        return row

    def labels(self, idx: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.src.labels[idx], dtype=np.int64)

    def batch(self, image: Any, labels: np.ndarray) -> dict[str, Any]:
        k_img, k_lab = self.cfg["keys"]
        return {k_img: image, k_lab: labels}

    def epoch(self, epoch: int, order: np.ndarray, n_batches: int) -> Iterator[Any]:
        if self.lock_pid != os.getpid():
            # a fork() since: a decoder thread of the parent may have held the lock then, and
            # none of this process's threads counts before its first epoch begins here
            self.lock, self.lock_pid = threading.Lock(), os.getpid()
        if self.decoder is not None:
            return self._gpu_epoch(epoch, order, n_batches)
        return self._host_epoch(epoch, order, n_batches)

    # ---- host ----

    def _host_sample(self, epoch: int, i: int, u: np.ndarray | None, p: np.ndarray | None,
                     out: np.ndarray) -> str | None:
        """Decode sample i into ``out`` (its row of the batch, in the output dtype and layout);
        an error's text, or None. ``p``: its parameters when its size was known, else they are
        made here from its header (``u``: its draws)."""
        cfg = self.cfg
        try:
            data = self.src.read_one(i)
        except OSError as e:
            return f"cannot be read ({e})"
        try:
            hw = self.header(i, data)
            if p is not None:
                pass
            elif u is not None:
                p = ops.train_params(hw[None, :2], u[None], cfg["size"], cfg["scale"], cfg["ratio"],
                                     cfg["flip"])[0]
            else:
                p = ops.eval_params(hw[None, :2], cfg["size"], cfg["resize"])[0]
            px = ops.host_decode(data, p, cfg["size"], (int(hw[0]), int(hw[1])))
        except ValueError as e:
            return str(e)
        self._store(px[None], out[None])
        return None

    def _store(self, u8: np.ndarray, out: np.ndarray) -> None:
        """(n, H, W, 3) uint8 pixels into ``out`` (n rows of the batch), normalized (Note [host
        decode]) and laid out; on the worker threads (NumPy releases the GIL while it computes)."""
        cfg = self.cfg
        if not cfg["channels_last"]:
            u8 = u8.transpose(0, 3, 1, 2)
        if cfg["dtype"] == "uint8":
            out[...] = u8
            return
        scale = np.asarray(cfg["norm"][0], np.float32)
        bias = np.asarray(cfg["norm"][1], np.float32)
        if not cfg["channels_last"]:
            scale, bias = scale[:, None, None], bias[:, None, None]
        f = u8.astype(np.float32)
        f *= scale
        f += bias
        out[...] = f

    def _host_start(self, epoch: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[Future[str | None]]]:
        out = self._alloc(len(idx))
        u = ops.draws(self.cfg["seed"], epoch, idx) if self.cfg["train"] else None
        # the parameters of the images whose sizes are known (a packed dataset's, or met
        # before), for the whole batch at once; the others' are made from their headers
        hw = self.src.hw[idx]
        known = hw[:, 0] > 0
        params = self.params(epoch, idx, np.where(known[:, None], hw, 1)) if known.any() else None
        pool = self.workers()
        futs = [pool.submit(self._host_sample, epoch, int(i), None if u is None else u[k],
                            params[k] if params is not None and known[k] else None, out[k])
                for k, i in enumerate(idx)]
        return idx, out, futs

    def _alloc(self, n: int) -> np.ndarray:
        """A host batch: bfloat16 is made as float32 and cast at the end (NumPy has no bfloat16)."""
        cfg = self.cfg
        H, W = cfg["size"]
        shape = (n, H, W, 3) if cfg["channels_last"] else (n, 3, H, W)
        dt = {"uint8": np.uint8, "float16": np.float16}.get(cfg["dtype"], np.float32)
        return np.empty(shape, dt)

    def _host_finish(self, started: tuple[np.ndarray, np.ndarray, list[Future[str | None]]]) -> dict[str, Any]:
        idx, out, futs = started
        seq = next(self.batch_seq)
        keep = []
        t0 = time.perf_counter()
        for f in futs:
            f.exception()  # waits (a worker's own exception is raised below, in order)
        self.count("wait_s", time.perf_counter() - t0)
        for k, f in enumerate(futs):
            why = f.result()
            if why is None:
                keep.append(k)
            else:
                self.bad(int(idx[k]), why, seq)
        if len(keep) != len(idx):
            out, idx = out[keep], idx[keep]
        self.count("samples", len(idx))
        return self.batch(self._final(out), self.labels(idx))

    def _final(self, out: np.ndarray) -> Any:
        if self.cfg["dtype"] == "bfloat16":
            import torch  # checked when the loader was made
            return torch.from_numpy(out).to(torch.bfloat16)
        return out

    def _empty(self) -> Any:
        """A batch whose every sample was skipped: zero rows, on the host (the prefetcher copies it)."""
        return self._final(self._alloc(0))

    def _host_epoch(self, epoch: int, order: np.ndarray, n_batches: int) -> Iterator[Any]:
        bs = self.cfg["batch_size"]
        started: collections.deque[Any] = collections.deque()
        nxt = 0
        try:
            for b in range(n_batches):
                while nxt < n_batches and len(started) <= _HOST_AHEAD:
                    started.append(self._host_start(epoch, np.asarray(order[nxt * bs:(nxt + 1) * bs], np.int64)))
                    nxt += 1
                yield (self._host_finish(started.popleft()), _Tag(b))
        finally:
            for _, _, futs in started:
                for f in futs:
                    f.cancel()
                for f in futs:  # the arrays they write into are dropped with the deque
                    if not f.cancelled():
                        try:
                            f.result()
                        except BaseException:  # noqa: BLE001 -- the epoch is being abandoned
                            pass

    # ---- GPU ----

    def reader(self) -> ThreadPoolExecutor:
        """One thread that reads the next batch's bytes while this one is decoded."""
        if self.read_pool is None or self.read_pool_pid != os.getpid():
            self.read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pl-image-read")
            self.read_pool_pid = os.getpid()
            self.check_open(self.read_pool)
        return self.read_pool

    def check_open(self, made: Any) -> None:
        """A pool or decoder just made by an epoch's generator: shut down, and the epoch ended,
        when close() ran meanwhile on another thread (it detaches a producer inside the
        generator: Note [stuck producers] in src/py/prefetcher.c), which then cannot free it.
        close() sets ``closed`` before it frees what it finds."""
        if self.closed:
            if isinstance(made, ThreadPoolExecutor):
                made.shutdown(wait=False, cancel_futures=True)
            else:
                made.close()
            raise ValueError("ImageLoader: closed while an epoch began")

    def decoders(self, want: int) -> list[Any]:
        """The first decoder and as many more as the epoch wants (Note [decoder threads]); fewer
        when no more can be made (no factory: a decoder given by hand; or one failed)."""
        while len(self.extra_decoders) + 1 < want and self.decoder_factory is not None:
            try:
                dec = self.decoder_factory()
            except (RuntimeError, ValueError, OSError, _C.CudaError):
                break  # the first decoder still decodes everything
            self.extra_decoders.append(dec)
            self.check_open(dec)
        return [self.decoder, *self.extra_decoders[:want - 1]]

    def decode_threads(self, k: int) -> ThreadPoolExecutor:
        pool = self.decode_pool
        if pool is None or self.decode_pool_pid != os.getpid() or self.decode_pool_k != k:
            if pool is not None and self.decode_pool_pid == os.getpid():
                pool.shutdown(wait=True)
            self.decode_pool = pool = ThreadPoolExecutor(max_workers=k, thread_name_prefix="pl-image-decode")
            self.decode_pool_pid, self.decode_pool_k = os.getpid(), k
            self.check_open(pool)
        return pool

    # Note [decoder threads]
    # Most of a batch's time on one GPU decoder is the host side of nvJPEG's batched calls, on the
    # one thread that drives it. With PINLOADER_JPEG_DECODERS=K (default 2: on an H200 with
    # ImageNet-like images two decoders were faster than one, three no faster than two, at more
    # CPU; benchmarks/results/h200_2026-12-05), batch b is decoded by decoder b % K on one of K
    # threads, up to K batches at a time, each decoder with its own stream, workspace and lock; the
    # batches are handed on in order, and a batch's error reaches the epoch when its turn comes.
    # The reads stay on one thread, one batch ahead of the last decode begun. The crops depend on
    # (seed, epoch, sample) only, so the batches are the same whatever K is.
    def _gpu_epoch(self, epoch: int, order: np.ndarray, n_batches: int) -> Iterator[Any]:
        bs = self.cfg["batch_size"]
        decs = self.decoders(_decoders_wanted())
        k = len(decs)

        def idx_of(b: int) -> np.ndarray:
            return np.asarray(order[b * bs:(b + 1) * bs], np.int64)

        # the reads (native threads without the GIL for files; a copy for batches over several
        # tar shards) overlap the decodes
        reader = self.reader()
        reads: dict[int, Future[Any]] = {}

        def read(j: int) -> None:
            if j < n_batches and j not in reads:
                reads[j] = reader.submit(self.src.read, idx_of(j))

        if k == 1:
            read(0)
            try:
                for b in range(n_batches):
                    t0 = time.perf_counter()
                    got = reads.pop(b).result()
                    self.count("wait_s", time.perf_counter() - t0)
                    read(b + 1)
                    yield (self._gpu_batch(epoch, idx_of(b), got, decs[0], next(self.batch_seq)), _Tag(b))
            finally:
                _abandon(reads.values())
            return
        pool = self.decode_threads(k)
        decodes: collections.deque[Future[Any]] = collections.deque()
        begun = 0
        try:
            for b in range(n_batches):
                while begun < n_batches and begun < b + k:
                    read(begun)
                    read(begun + 1)
                    decodes.append(pool.submit(self._gpu_batch_read, epoch, idx_of(begun),
                                               reads.pop(begun), decs[begun % k], next(self.batch_seq)))
                    begun += 1
                t0 = time.perf_counter()
                out = decodes.popleft().result()
                self.count("wait_s", time.perf_counter() - t0)
                yield (out, _Tag(b))
        finally:
            _abandon(decodes)
            _abandon(reads.values())

    def _gpu_batch_read(self, epoch: int, idx: np.ndarray, got: Future[Any], decoder: Any,
                        seq: int) -> dict[str, Any]:
        """On a decoder thread: batch ``idx`` once its bytes are read. The thread's CUDA calls
        ignore other threads' graph captures, as the producer's do (Note [the producer and graph
        captures] in src/py/pf_producer.c): a training thread captures while batches decode."""
        decoder.ignore_other_captures()
        return self._gpu_batch(epoch, idx, got.result(), decoder, seq)

    def _gpu_batch(self, epoch: int, idx: np.ndarray, got: Any, decoder: Any, seq: int) -> dict[str, Any]:
        """Batch ``idx`` (``seq``: its number, for skip) decoded by ``decoder``."""
        base, offs, lens, fails = got
        n = len(idx)
        ok = np.ones(n, bool)
        whys: dict[int, str] = dict(fails)
        ok[list(fails)] = False
        raw: dict[int, np.ndarray] = {}
        fixed: dict[int, np.ndarray] = {}  # the parameters of raw images resampled already (_raw)
        hw = self.src.hw[idx].copy()
        unknown = np.flatnonzero(ok & (hw[:, 0] <= 0))
        if len(unknown):
            # first meeting: the headers, read in C, and cached (Pillow reads other formats')
            hw[unknown] = _C._jpeg_info(base, offs[unknown], lens[unknown])
            for k in unknown[hw[unknown, 0] <= 0]:
                try:
                    hw[k] = ops.image_info(base[int(offs[k]):int(offs[k]) + int(lens[k])])
                except ValueError as e:
                    whys[int(k)] = str(e)
                    ok[k] = False
            good = unknown[ok[unknown]]
            self.src.hw[idx[good]] = hw[good]
        # what nvJPEG does not take goes to the host decoder (Note [host decode])
        for k in np.flatnonzero(ok & (hw[:, 2] != 1) & (hw[:, 2] != 3)):
            self._raw(epoch, idx, base, offs, lens, int(k), hw, raw, fixed, whys, ok,
                      "not a JPEG" if hw[k, 2] == 0 else f"a JPEG of {hw[k, 2]} components")
        # the GPU call takes the samples still good: one that could not be read or is not an
        # image would make the batch decode a second time without it
        sel = np.flatnonzero(ok)
        image: Any = None
        retry = False
        if len(sel):
            image, status = self._decode(decoder, epoch, idx[sel], base, offs[sel], lens[sel], hw[sel], _rows(raw, sel),
                                         _rows(fixed, sel))
            for j in np.flatnonzero(status != 0).tolist():
                k = int(sel[j])
                reason = {1: "nvJPEG could not parse its header", 2: "nvJPEG could not decode it",
                          3: "nvJPEG does not support it", 4: "its size differs from its header's",
                          5: "no end-of-image marker (cut short, or data after the image)"}.get(
                              int(status[j]), f"status {int(status[j])}")
                self._raw(epoch, idx, base, offs, lens, k, hw, raw, fixed, whys, ok, reason)
                retry = True
        for k in np.flatnonzero(~ok):
            self.bad(int(idx[k]), whys.get(int(k), "cannot be read"), seq)
        keep = np.flatnonzero(ok)
        if retry or not len(keep):
            del image
            if not len(keep):
                image = self._empty()
            else:
                image, status = self._decode(decoder, epoch, idx[keep], base, offs[keep], lens[keep], hw[keep],
                                             _rows(raw, keep), _rows(fixed, keep))
                if (status != 0).any():  # host-decoded samples cannot fail; nvJPEG's did not before
                    j = int(np.flatnonzero(status != 0)[0])
                    raise self.fail(int(idx[keep][j]), f"the GPU decoder failed on a retry (status {int(status[j])})")
        idx = idx[keep]
        self.count("samples", len(idx))
        return self.batch(image, self.labels(idx))

    def _raw(self, epoch: int, idx: np.ndarray, base: np.ndarray, offs: np.ndarray, lens: np.ndarray, k: int,
             hw: np.ndarray, raw: dict[int, np.ndarray], fixed: dict[int, np.ndarray], whys: dict[int, str],
             ok: np.ndarray, reason: str) -> None:
        """Decode sample k on the host for the GPU call's ``raw=``; one with a side past what
        the call takes (_RAW_SIDE) is cropped and resized here too, and ``fixed[k]`` is then the
        parameters that hand it over as it is."""
        i = int(idx[k])
        try:
            img = ops.decode_rgb(base[int(offs[k]):int(offs[k]) + int(lens[k])])
        except ValueError as e:
            whys[k] = f"{reason}, and {e}"
            ok[k] = False
            return
        if tuple(img.shape[:2]) != (int(hw[k, 0]), int(hw[k, 1])):
            hw[k, :2] = img.shape[:2]
            self.src.hw[i] = hw[k]
        if max(img.shape[:2]) > _RAW_SIDE:
            size = self.cfg["size"]
            try:
                p = self.params(epoch, idx[k:k + 1], hw[k:k + 1])[0]
                img = np.ascontiguousarray(ops.resample(img, p, size))
            except ValueError as e:
                whys[k] = f"{reason}, and {e}"
                ok[k] = False
                return
            fixed[k] = np.array([0, 0, size[0], size[1], size[0], size[1], 0, 0, 0], np.int32)
        raw[k] = img
        self.host_reason(reason)

    def _decode(self, decoder: Any, epoch: int, idx: np.ndarray, base: np.ndarray, offs: np.ndarray,
                lens: np.ndarray, hw: np.ndarray, raw: dict[int, np.ndarray],
                fixed: dict[int, np.ndarray]) -> tuple[Any, np.ndarray]:
        cfg = self.cfg
        p = self.params(epoch, idx, hw)
        for j, q in fixed.items():
            p[j] = q
        t0 = time.perf_counter()
        out: tuple[Any, np.ndarray] = decoder.decode(
            base, offs, lens, p, cfg["size"], cfg["norm"][0], cfg["norm"][1], cfg["dtype"],
            cfg["channels_last"], raw or None)
        self.count("decode_call_s", time.perf_counter() - t0)
        return out

    def close_decoders(self) -> None:
        """The GPU decoders closed (each waits for a decode in flight on it)."""
        for dec in (self.decoder, *self.extra_decoders):
            if dec is not None:
                dec.close()
        self.decoder = None
        self.extra_decoders = []

    def close(self) -> None:
        self.closed = True  # first: see check_open
        for pool, pid in ((self.pool, self.pool_pid), (self.read_pool, self.read_pool_pid),
                          (self.decode_pool, self.decode_pool_pid)):
            if pool is not None and pid == os.getpid():
                pool.shutdown(wait=True, cancel_futures=True)
        self.pool = self.read_pool = self.decode_pool = None
        self.close_decoders()
        self.src.close()


def _decoder_info(decoders: list[Any]) -> dict[str, Any]:
    """The decoders' info() as one: the counts summed over them (Note [decoder threads]), the
    device and its engines as the first says, and ``decoders``, how many."""
    out = dict(decoders[0].info())
    for dec in decoders[1:]:
        for key, v in dec.info().items():
            if key in _SUMMED_INFO:
                out[key] = out.get(key, 0) + v
    out["decoders"] = len(decoders)
    return out


_SUMMED_INFO = frozenset({"batches", "hardware", "roi", "cuda", "raw", "failed", "workspace_bytes"})


def _abandon(futures: Any) -> None:
    """An epoch left early: its reads and decodes not begun are cancelled, those running are
    waited for (they hold the batch's buffers and a decoder), their errors dropped."""
    for f in list(futures):
        if not f.cancel():
            try:
                f.result()
            except BaseException:  # noqa: BLE001 -- the epoch is being abandoned
                pass


def _rows(raw: dict[int, np.ndarray], rows: np.ndarray) -> dict[int, np.ndarray]:
    """``raw`` for the samples ``rows`` of a batch, keyed by their positions among them."""
    return {j: raw[int(k)] for j, k in enumerate(rows) if int(k) in raw}


class _ImageEpochs(_resume.ResumableEpochs):
    """The prefetcher's source: each iter() is the plan's epoch, or the resumed part of it once a
    state was loaded (``resume``, set by pinloader/_resume.py)."""

    def __init__(self, runner: _Runner, plan: _Plan, it: IterState) -> None:
        super().__init__(None, plan, it)
        self._runner = runner

    def __len__(self) -> int:
        return int(self._plan.n_batches)

    def __iter__(self) -> Iterator[Any]:
        plan, r = self._plan, self.resume
        if r is not None and r[0] == plan.epoch:
            _, order, n_batches = r
        else:
            order, n_batches = _order(plan, plan.epoch), plan.n_batches
        return self._runner.epoch(plan.epoch, order, n_batches)


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
        a, b = (float(x) for x in v)
    except (TypeError, ValueError):
        raise TypeError(f"ImageLoader: {name} must be two numbers, got {v!r}") from None
    if not (lo < a <= b) or not np.isfinite(b):
        raise ValueError(f"ImageLoader: {name} must be (low, high) with {lo} < low <= high, got {v!r}")
    return a, b


class ImageLoader(_EpochLoader):
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
        ``round(max(size) / 0.875)``, 256 for 224).
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
        Passed to :class:`pinloader.AsyncPrefetcher`. ``static=True`` or ``out=`` batches are
        made by the host decoder (the prefetcher copies them into its static buffers).

    The iteration, ``set_epoch``, ``indices``, ``state_dict`` / ``load_state_dict`` (exact, and
    re-sharded to another world size) and the framework doors are ArrayLoader's.
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
        self._runner: _Runner | None = None
        self.batch_size = _int_arg("batch_size", batch_size, 1)
        _decoders_wanted()  # a bad PINLOADER_JPEG_DECODERS is refused here, not at the first batch
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
        if dtype not in _DTYPES:
            raise ValueError(f"ImageLoader: dtype must be one of {_DTYPES}, got {dtype!r}")
        if layout not in _LAYOUTS:
            raise ValueError(f"ImageLoader: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if decoder not in ("auto", "gpu", "host"):
            raise ValueError(f"ImageLoader: decoder must be 'auto', 'gpu' or 'host', got {decoder!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"ImageLoader: on_error must be 'raise' or 'skip', got {on_error!r}")
        keys = tuple(keys)
        if len(keys) != 2 or not all(isinstance(k, str) for k in keys) or keys[0] == keys[1]:
            raise ValueError(f"ImageLoader: keys must be two different str, got {keys!r}")
        size_hw = _pair("size", size)
        if resize is None:
            resize = int(round(max(size_hw) / 0.875))
        resize = _int_arg("resize", resize, 1)
        if resize > 16384:  # as size: the crop parameters are int32, resized sides bounded
            raise ValueError(f"ImageLoader: resize must be at most 16384, got {resize}")
        if (mean is None) != (std is None):
            raise ValueError("ImageLoader: give both mean and std, or neither")
        if mean is not None and std is not None:
            try:
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
        self._depth = None if depth is None else _int_arg("depth", depth, 1)
        self._opts = dict(prefetch_opts)
        if workers is None:
            try:
                workers = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                workers = os.cpu_count() or 1
            workers = max(1, min(32, workers))
        workers = _int_arg("workers", workers, 1)

        if rank is None or world_size is None:
            d_rank, d_world = _default_rank_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        self.world_size = _int_arg("world_size", world_size, 1)
        self.rank = _int_arg("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"ImageLoader: rank must be < world_size, got rank={self.rank}, "
                             f"world_size={self.world_size}")

        src = make_source(source)
        self.source = src
        self.num_rows = self.num_items = len(src)
        self.classes = getattr(src, "classes", None)
        if self.drop_last:
            self.num_samples = self.num_items // self.world_size
        else:
            self.num_samples = -(-self.num_items // self.world_size)
        n_batches = (self.num_samples // self.batch_size if self.drop_last
                     else -(-self.num_samples // self.batch_size))
        plan = _Plan()
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
                   scale=_range("scale", scale, 0.0), ratio=_range("ratio", ratio, 0.0),
                   flip=self.train if flip is None else bool(flip), seed=self.seed,
                   dtype=dtype, channels_last=_LAYOUTS[layout], keys=keys,
                   norm=ops.norm_constants(mean, std, dtype), workers=workers, on_error=on_error)
        self._runner = _Runner(src, cfg)
        # where the iteration is: epochs, batches handed out, a loaded state to resume at
        self._it = IterState()
        self._source = _ImageEpochs(self._runner, plan, self._it)
        self._decoder_kind = ""
        self._decoder_reason = ""
        self._decoder_key: tuple[str, bool] | None = None
        self._pf_settings: tuple[Any, int, dict[str, Any]] | None = None

    # ---- sampling ----

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample order for ``epoch`` (as :meth:`pinloader.ArrayLoader.indices`)."""
        return _order(self._plan, _epoch_arg("ImageLoader", epoch)).view()

    def indices_after(self, epoch: int, position: int) -> np.ndarray:
        """This rank's sample order for what is left of ``epoch`` once the ranks together were
        handed its first ``position`` images (as :meth:`pinloader.ArrayLoader.indices_after`)."""
        for name, v in (("epoch", epoch), ("position", position)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"ImageLoader: {name} must be an int, not {type(v).__name__}")
        if position < 0:
            raise ValueError(f"ImageLoader: position must be >= 0, got {position}")
        return _resume.resumed_order(self._plan, _epoch_arg("ImageLoader", epoch), int(position))

    def params(self, epoch: int, indices: Any) -> np.ndarray:
        """The resampling parameters (int32 (n, 9), Note [image parameters] in
        pinloader/_image_ops.py) the loader uses for these samples in ``epoch``; the image sizes
        are read from the samples' headers."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        runner = self._runner
        assert runner is not None
        hw = np.stack([runner.header(int(i), runner.src.read_one(int(i))) for i in idx]) if len(idx) \
            else np.zeros((0, 3), np.int32)
        return runner.params(_epoch_arg("ImageLoader", epoch), idx, hw)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (as ``DistributedSampler.set_epoch``)."""
        self._it.requested = _epoch_arg("ImageLoader", epoch)

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
            try:
                runner.decoder = _C.JpegDecoder(device, libraries=_cudart.nvjpeg_candidates())
                runner.decoder_factory = lambda: _C.JpegDecoder(device, libraries=_cudart.nvjpeg_candidates())
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
        workspace_bytes)."""
        s = dict(self._pf.stats()) if self._pf is not None else {}
        runner = self._runner
        s.update(epoch=self._it.epoch, rank=self.rank, world_size=self.world_size,
                 batches_per_epoch=len(self), source=self.source.kind,
                 decoder=self._decoder_kind or None, decoder_reason=self._decoder_reason)
        if runner is not None:
            c = runner.counts
            s.update(samples=c["samples"], skipped=c["skipped"], producer_wait_s=c["wait_s"],
                     decode_call_s=c["decode_call_s"],
                     skipped_samples=[dict(x) for x in c["skipped_samples"]],
                     host_decoded=c["host_decoded"], host_decoded_reasons=dict(c["host_decoded_reasons"]))
            if runner.decoder is not None:
                try:
                    s["gpu_decoder"] = _decoder_info([runner.decoder, *runner.extra_decoders])
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
