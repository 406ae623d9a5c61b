"""ImageLoader's epochs (pinloader/image_loader.py): the generator that makes each epoch's
batches on the prefetcher's producer thread, on the GPU (nvJPEG through ``JpegDecoder``, one or
more decoders on threads of their own) or on the host (Pillow on worker threads), and the
prefetcher's re-iterable source over it. The loader's module documentation says what a batch
is and how it is made; this module is how, and holds nothing that refers to the loader (the
loader holds the prefetcher, which holds the source)."""
from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np

from . import _C, _resume
from ._epoch_plan import epoch_order, Plan
from ._iter_state import IterState
from . import _image_ops as ops

_HOST_AHEAD = 2  # host batches decoding ahead of the one the producer waits for
_SKIP_RECORDS = 16  # skipped samples kept in stats() (the count is exact)
_RAW_SIDE = 65535  # the longest side of a host-decoded image JpegDecoder.decode takes (raw=)
_MAX_DECODERS = 8  # PINLOADER_JPEG_DECODERS's bound (Note [decoder threads])
_DEFAULT_DECODERS = 2  # its default (Note [decoder threads])


def decoders_wanted() -> int:
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


def decoder_options() -> dict[str, Any]:
    """What the GPU decoders are made with, from the environment (read where the loader is made,
    so that a bad value is refused there, and again when the loader chooses the GPU decoder; the
    decoders it makes after that, one per decoder thread, are made the same way):
    PINLOADER_JPEG_INTERPOLATE, unset, empty or "1" (on) or "0" (Note [interpolated chroma] in
    src/core/nvjpeg_load.c)."""
    interp = os.environ.get("PINLOADER_JPEG_INTERPOLATE", "")
    if interp not in ("", "0", "1"):
        raise ValueError(f'PINLOADER_JPEG_INTERPOLATE must be "0" or "1", got {interp[:40]!r}')
    return {"interpolate": interp != "0"}


class ImageDecodeError(ValueError):
    """A sample that cannot be read or decoded (``on_error="raise"``): names the sample index
    and its file or shard member."""

    __module__ = "pinloader.image_loader"  # the public module: tracebacks and pickles name it


class _Tag:
    """Which of the epoch's planned batches an item is: a pass-through leaf the loader's
    ``__next__`` takes off (skipped samples make batches smaller, never fewer)."""

    __slots__ = ("batch",)

    def __init__(self, batch: int) -> None:
        self.batch = batch


class Runner:
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
        """The samples' parameters (Note [image parameters]): the one place they are made, for
        every backend and batch."""
        cfg = self.cfg
        if cfg["train"]:
            u = ops.draws(cfg["seed"], epoch, idx)
            return ops.train_params(hw[:, :2], u, cfg["size"], cfg["scale"], cfg["ratio"], cfg["flip"])
        p = ops.eval_params(hw[:, :2], cfg["size"], cfg["resize"])
        if cfg["flip"] and len(idx):  # the flip draw of a training crop (Note [counter-based draws])
            p[:, 8] = ops.draws(cfg["seed"], epoch, idx)[:, ops.DRAWS - 1] < 0.5
        return p

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

    def _host_sample(self, epoch: int, i: int, p: np.ndarray | None, out: np.ndarray) -> str | None:
        """Decode sample i into ``out`` (its row of the batch, in the output dtype and layout);
        an error's text, or None. ``p``: its parameters when its size was known, else they are
        made here from its header."""
        cfg = self.cfg
        try:
            data = self.src.read_one(i)
        except OSError as e:
            return f"cannot be read ({e})"
        try:
            hw = self.header(i, data)
            if p is None:
                p = self.params(epoch, np.array([i], np.int64), hw[None])[0]
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
        # the parameters of the images whose sizes are known (a packed dataset's, or met
        # before), for the whole batch at once; the others' are made from their headers
        hw = self.src.hw[idx]
        known = hw[:, 0] > 0
        params = self.params(epoch, idx, np.where(known[:, None], hw, 1)) if known.any() else None
        pool = self.workers()
        futs = [pool.submit(self._host_sample, epoch, int(i),
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
    # one thread that drives it. With PINLOADER_JPEG_DECODERS=K (default 2: two decoders keep the
    # engines fed while each thread waits in its host calls; a third adds CPU, not images: see
    # benchmarks/results/design_measurements.md), batch b is decoded by decoder b % K on one of K
    # threads, up to K batches at a time, each decoder with its own stream, workspace and lock; the
    # batches are handed on in order, and a batch's error reaches the epoch when its turn comes.
    # The reads stay on one thread, one batch ahead of the last decode begun. The crops depend on
    # (seed, epoch, sample) only, so the batches are the same whatever K is.
    def _gpu_epoch(self, epoch: int, order: np.ndarray, n_batches: int) -> Iterator[Any]:
        bs = self.cfg["batch_size"]
        decs = self.decoders(decoders_wanted())
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
        recorded = ok & (hw[:, 0] > 0)  # sizes from sizes.npy, or read when first met
        unknown = np.flatnonzero(ok & (hw[:, 0] <= 0))
        if len(unknown):
            # first meeting: the headers, read in C, and cached (Pillow reads other formats')
            hw[unknown] = _C.jpeg_info(base, offs[unknown], lens[unknown])
            for k in unknown[hw[unknown, 0] <= 0]:
                try:
                    hw[k] = ops.image_info(base[int(offs[k]):int(offs[k]) + int(lens[k])])
                except ValueError as e:
                    whys[int(k)] = str(e)
                    ok[k] = False
            good = unknown[ok[unknown]]
            self.src.hw[idx[good]] = hw[good]
        # a recorded size must still be the image's, as the host path checks when it decodes
        # (ops.host_decode's expect): a JPEG's header tells before nvJPEG crops the wrong box
        rec = np.flatnonzero(recorded & ((hw[:, 2] == 1) | (hw[:, 2] == 3)))
        if len(rec):
            real = _C.jpeg_info(base, offs[rec], lens[rec])
            differs = (real[:, 0] > 0) & ((real[:, 0] != hw[rec, 0]) | (real[:, 1] != hw[rec, 1]))
            for m in np.flatnonzero(differs).tolist():
                r = int(rec[m])
                whys[r] = ops.size_mismatch(real[m], hw[r])
                ok[r] = False
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
        try:
            img = ops.decode_rgb(base[int(offs[k]):int(offs[k]) + int(lens[k])])
        except ValueError as e:
            whys[k] = f"{reason}, and {e}"
            ok[k] = False
            return
        if tuple(img.shape[:2]) != (int(hw[k, 0]), int(hw[k, 1])):
            # the size its crop is drawn for is not the image's: the host path's error
            whys[k] = ops.size_mismatch(img.shape[:2], hw[k])
            ok[k] = False
            return
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


def decoder_info(decoders: list[Any]) -> dict[str, Any]:
    """The decoders' info() as one: the counts summed over them (Note [decoder threads]), the
    device and its engines as the first says, and ``decoders``, how many."""
    out = dict(decoders[0].info())
    for dec in decoders[1:]:
        for key, v in dec.info().items():
            if key in _SUMMED_INFO:
                out[key] = out.get(key, 0) + v
    out["decoders"] = len(decoders)
    return out


_SUMMED_INFO = frozenset({"batches", "hardware", "roi", "cuda", "raw", "failed", "workspace_bytes",
                          "headers_ns", "engines_wait_ns", "engines_ns", "cuda_ns", "block_ns", "kernels_ns"})


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


class ImageEpochs(_resume.ResumableEpochs):
    """The prefetcher's source: each iter() is the plan's epoch, or the resumed part of it once a
    state was loaded (``resume``, set by pinloader/_resume.py)."""

    def __init__(self, runner: Runner, plan: Plan, it: IterState) -> None:
        super().__init__(None, plan, it)
        self._runner = runner

    def __len__(self) -> int:
        return int(self._plan.n_batches)

    def __iter__(self) -> Iterator[Any]:
        plan, r = self._plan, self.resume
        if r is not None and r[0] == plan.epoch:
            _, order, n_batches = r
        else:
            order, n_batches = epoch_order(plan, plan.epoch), plan.n_batches
        return self._runner.epoch(plan.epoch, order, n_batches)
