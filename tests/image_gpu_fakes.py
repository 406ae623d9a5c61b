"""The stand-in for ``_C.JpegDecoder`` that ImageLoader's GPU path runs against on the host
(FakeJpegDecoder: ``decode()``'s contract as src/py/jpeg_decoder.c checks it, the statuses of
src/core/jpeg_cuda.h, every sample computed by the host decoder's own functions), the ``gpu``
fixture that puts it in place, the data sets (``data``: every kind of source; ``mixed``: images
nvJPEG does not take and bad ones), and the helpers that run a loader both ways. Used by
tests/test_image_loader_gpu_logic.py and tests/test_image_loader_decoder_threads.py."""
from __future__ import annotations

import hashlib
import io
import operator
import os
import tarfile
import threading
import time

import numpy as np
import pytest

from pinloader import ImageLoader, _C
from pinloader import _image_ops as ops
from pinloader._image_pack import pack

from image_helpers import folder_items, jpeg, make_sources, photo

Image = pytest.importorskip("PIL.Image")

# src/core/jpeg_cuda.h's PL_JPEG_* statuses
DECODED, BAD_HEADER, BAD_DATA, UNSUPPORTED, BOX_OUTSIDE, NO_END = range(6)
END_WINDOW = 4096  # jpeg_cuda.c's search window for the end-of-image marker
_DTYPES = ("uint8", "float32", "float16", "bfloat16")


def _int_array(o, dtype, name, n, cols):
    """jpeg_decoder.c's int_array: PyArray_FROMANY to ``dtype`` (safe casts only), C-contiguous,
    shape (n,) or (n, cols)."""
    a = np.asarray(o)
    if not np.can_cast(a.dtype, dtype, "safe"):
        raise TypeError(f"decode: {name} cannot be cast from {a.dtype} to {np.dtype(dtype)}")
    a = np.ascontiguousarray(a, dtype)
    want = (n, cols) if cols else (n,)
    if a.shape != want:
        raise ValueError(f"decode: {name} must have shape {want}")
    return a


def _triple(o, name):
    try:
        v = [float(x) for x in o]
    except TypeError:
        raise ValueError(f"decode: {name} must be three numbers") from None
    if len(v) != 3:
        raise ValueError(f"decode: {name} must be three numbers")
    return np.asarray(v, np.float32)  # (float) in C


def has_end_marker(data: bytes) -> bool:
    """jpeg_header.c's pl_jpeg_has_end_marker (Note [truncated JPEGs]): FF D9 in the last END_WINDOW bytes."""
    return data.rfind(b"\xff\xd9", max(0, len(data) - END_WINDOW)) >= 0


def digest(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


class FakeJpegDecoder:
    """``_C.JpegDecoder`` on the host: ``decode()`` takes and checks the same arguments and
    returns ``(image, status)`` as the real one, each sample decoded by Pillow
    (``_image_ops.decode_rgb``) and resampled by ``_image_ops.resample``, then normalized, cast
    and laid out as the host path does (``Runner._store`` and ``_final``). The statuses are the
    ones jpeg_cuda.c gives, in its order: 1 no header (the project's header reader finds none),
    3 components other than 1 or 3, 5 no end-of-image marker near the end, 4 the box outside
    the image, 2 the data does not decode (Pillow refuses it). ``inject``: a test's
    ``f(data, call) -> status`` for samples given as bytes (not ``raw=``) that would otherwise
    decode, standing in for what nvJPEG refuses and Pillow does not."""

    made: list = []       # every decoder made (the fixture gives each test its own list)
    inject = None         # staticmethod(f(bytes, call number) -> status), or None

    def __init__(self, device, libraries=(), interpolate=True):
        if device == "cpu":  # what pl_resolve_device finds for the host backend
            raise ValueError(f"JpegDecoder decodes on a CUDA device; {device!r} is the host backend")
        for k, lib in enumerate(list(libraries or ())):
            if not isinstance(lib, str):
                raise TypeError(f"libraries[{k}] must be a str, not {type(lib).__name__}")
        self.device = device
        self.options = {"interpolate": interpolate}  # as ImageLoader made it
        self.closed = False
        self.calls: list[dict] = []
        self.capture_local: set = set()
        self.counts = dict(batches=0, hardware=0, roi=0, cuda=0, raw=0, failed=0)
        type(self).made.append(self)

    def close(self):
        self.closed = True

    def ignore_other_captures(self):
        """Records the threads that called it (the real one puts the calling thread's CUDA
        calls in cudaStreamCaptureModeThreadLocal): each call of decode() says whether its
        thread did."""
        self.capture_local.add(threading.get_ident())

    def info(self):
        if self.closed:
            raise ValueError("info: the JpegDecoder is closed")
        return dict(device=0, engines=0, cores_per_engine=0, workspace_bytes=0, headers_ns=0, engines_wait_ns=0,
                    engines_ns=0, cuda_ns=0, block_ns=0, kernels_ns=0,
                    chroma_interpolated=self.options["interpolate"], **self.counts)

    def decode(self, base, offsets, lengths, params, size, scale, bias, dtype, channels_last, raw=None):
        # the arguments, as jd_decode parses and checks them
        try:  # "(ii)": a sequence of two ints
            oh, ow = (operator.index(x) for x in size)
        except (TypeError, ValueError):
            raise TypeError(f"decode: size must be two ints, got {size!r}") from None
        if not isinstance(dtype, str):
            raise TypeError(f"decode: dtype must be a str, not {type(dtype).__name__}")
        if self.closed:
            raise ValueError("decode: the JpegDecoder is closed")
        if not (0 < oh <= 16384 and 0 < ow <= 16384):
            raise ValueError(f"decode: size must be two ints in 1..16384, got ({oh}, {ow})")
        if dtype not in _DTYPES:
            raise ValueError(f"decode: dtype must be 'uint8', 'float32', 'float16' or 'bfloat16', got '{dtype}'")
        channels_last = bool(channels_last)
        scale, bias = _triple(scale, "scale"), _triple(bias, "bias")
        if raw is not None and not isinstance(raw, dict):
            raise TypeError(f"decode: raw must be a dict or None, not {type(raw).__name__}")
        view = memoryview(base)  # PyBUF_SIMPLE: one contiguous buffer
        if not view.c_contiguous:
            raise BufferError("decode: base is not contiguous")
        nbytes = view.nbytes
        buf = np.frombuffer(view.cast("B"), np.uint8) if nbytes else np.zeros(0, np.uint8)
        n = np.asarray(offsets).reshape(-1).shape[0] if np.ndim(offsets) == 1 else -1
        if not 1 <= n <= 65535:
            raise ValueError(f"decode: a batch holds 1 to 65535 samples, got {n}")
        off = _int_array(offsets, np.int64, "offsets", n, 0)
        ln = _int_array(lengths, np.int64, "lengths", n, 0)
        par = _int_array(params, np.int32, "params", n, 9)
        for i in range(n):
            if off[i] < 0 or ln[i] < 0 or int(off[i]) + int(ln[i]) > nbytes:
                raise ValueError(f"decode: sample {i}: bytes [{off[i]}, {off[i]} + {ln[i]}) lie outside "
                                 f"base ({nbytes} bytes)")
            if par[i, 8] not in (0, 1):
                raise ValueError(f"decode: params[{i}][8] (flip) must be 0 or 1")
        imgs: dict[int, np.ndarray] = {}
        for k, v in (raw or {}).items():
            if not isinstance(k, int) or not 0 <= k < n:
                raise ValueError(f"decode: raw key {k!r} is not a sample index in 0..{n - 1}")
            a = np.asarray(v)
            if not np.can_cast(a.dtype, np.uint8, "safe") or a.ndim != 3:
                raise ValueError(f"decode: raw[{k}] must be a 3-d uint8 array")
            a = np.ascontiguousarray(a, np.uint8)
            if a.shape[2] != 3 or not (0 < a.shape[0] <= 65535 and 0 < a.shape[1] <= 65535):
                raise ValueError(f"decode: raw[{k}] must be a (h, w, 3) uint8 image with 1 <= h, w <= 65535")
            imgs[k] = a

        call = len(self.calls)
        u8 = np.zeros((n, oh, ow, 3), np.uint8)
        status = np.zeros(n, np.int32)
        for i in range(n):
            status[i] = self._sample(buf[off[i]:off[i] + ln[i]].tobytes(), imgs.get(i), par[i], (oh, ow),
                                     call, u8[i])
        self.counts["batches"] += 1
        self.counts["failed"] += int((status != 0).sum())
        self.calls.append(dict(n=n, raw=sorted(imgs), status=status.tolist(),
                               thread=threading.current_thread().name,
                               capture_local=threading.get_ident() in self.capture_local,
                               digests=[digest(buf[off[i]:off[i] + ln[i]]) if i not in imgs else None
                                        for i in range(n)]))
        return self._output(u8, status, scale, bias, dtype, channels_last), status

    def _sample(self, data, img, p, size, call, out):
        """One sample's status, its pixels written to ``out`` when it decodes (pl_jpeg_decode's
        checks, in its order)."""
        if img is None:
            info = ops.jpeg_info(data) if data else None
            if info is None:
                return BAD_HEADER
            h, w, comps = info
            if comps not in (1, 3):
                return UNSUPPORTED
            if not has_end_marker(data):
                return NO_END
        else:
            h, w = img.shape[:2]
        top, left, bh, bw, rh, rw, oy, ox, _ = (int(x) for x in p)
        if (top < 0 or left < 0 or bh <= 0 or bw <= 0 or top + bh > h or left + bw > w or rh <= 0
                or rw <= 0 or oy < 0 or ox < 0 or oy + size[0] > rh or ox + size[1] > rw):
            return BOX_OUTSIDE
        if img is None:
            forced = type(self).inject(data, call) if type(self).inject is not None else 0
            if forced:
                return forced
            try:
                img = ops.decode_rgb(data)
            except ValueError:
                return BAD_DATA
            if img.shape[:2] != (h, w):  # nvJPEG decodes to the frame header's size
                return BAD_DATA
            self.counts["cuda"] += 1
        else:
            self.counts["raw"] += 1
        out[...] = ops.resample(img, p, size)
        return DECODED

    @staticmethod
    def _output(u8, status, scale, bias, dtype, channels_last):
        """The batch as the kernel lays it out: (n, 3, H, W) or (n, H, W, 3) of ``dtype``,
        ``float32(pixel) * scale + bias`` (Note [host decode]), a failed sample's rows zero."""
        x = u8 if channels_last else u8.transpose(0, 3, 1, 2)
        if dtype == "uint8":
            return np.ascontiguousarray(x)
        if not channels_last:
            scale, bias = scale[:, None, None], bias[:, None, None]
        f = x.astype(np.float32)
        f *= scale
        f += bias
        f[status != 0] = 0
        if dtype == "float16":
            return f.astype(np.float16)
        if dtype == "bfloat16":
            import torch
            return torch.from_numpy(f).to(torch.bfloat16)
        return f


@pytest.fixture
def gpu(monkeypatch):
    """The GPU path with FakeJpegDecoder: each test its own list of decoders made."""
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "1")  # one decoder unless a test says
    monkeypatch.setattr(FakeJpegDecoder, "made", [])
    monkeypatch.setattr(FakeJpegDecoder, "inject", None)
    monkeypatch.setattr(_C, "JpegDecoder", FakeJpegDecoder)
    monkeypatch.setattr(_C, "cuda_available", lambda: True)
    return FakeJpegDecoder


# ---- data ----

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_sources(str(tmp_path_factory.mktemp("gpu_logic")), per_shard=7)


def _cmyk(a):
    buf = io.BytesIO()
    Image.fromarray(a).convert("CMYK").save(buf, format="JPEG")
    return buf.getvalue()


def _png(a):
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _bad_huffman(blob):
    """A JPEG whose frame header reads and whose end marker is there, with a Huffman table
    that does not decode."""
    i = blob.find(b"\xff\xc4")
    c = bytearray(blob)
    c[i + 4:i + 24] = b"\xff" * 20
    return bytes(c)


# the mixed set: name -> (bytes, what the host decoder does with it)
def _mixed_blobs():
    a = photo(40, 50, 0)
    good = jpeg(a)
    return {
        "s00_good.jpg": jpeg(photo(36, 44, 1)),
        "s01_png.png": _png(a),
        "s02_gray.jpg": jpeg(a[..., 0]),
        "s03_cmyk.jpg": _cmyk(a),
        "s04_truncated.jpg": good[: len(good) // 2],
        "s05_corrupt.jpg": _bad_huffman(good),
        "s06_text.jpg": b"not an image at all",
        "s07_appended.jpg": good + bytes(END_WINDOW + 100),  # a camera's trailer after EOI
        "s08_prog.jpg": jpeg(photo(30, 60, 2), progressive=True),
        "s09_good.jpg": jpeg(photo(50, 30, 3)),
    }


def _member(name):
    """A skipped sample's file or tar member, without its folder or shard."""
    return os.path.basename(name.rsplit(": ", 1)[-1])


BAD = ("s04_truncated.jpg", "s05_corrupt.jpg", "s06_text.jpg")


def _tars(items, dest, per_shard):
    """WebDataset shards whose members keep their files' names (and extensions)."""
    tars = []
    for s in range(0, len(items), per_shard):
        tars.append(os.path.join(dest, f"shard-{s // per_shard}.tar"))
        with tarfile.open(tars[-1], "w") as t:
            for path, lab in items[s:s + per_shard]:
                t.add(path, arcname=os.path.basename(path))
                info = tarfile.TarInfo(os.path.basename(path).split(".")[0] + ".cls")
                info.size = len(str(lab))
                t.addfile(info, io.BytesIO(str(lab).encode()))
    return tars


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The mixed set as a folder (one class per file, so labels tell them apart), a list of
    (path, label) with a missing file at the end, tar shards, and packed."""
    root = tmp_path_factory.mktemp("gpu_logic_mixed")
    folder = root / "folder"
    for k, (name, blob) in enumerate(sorted(_mixed_blobs().items())):
        d = folder / f"c{k:02d}"
        d.mkdir(parents=True)
        (d / name).write_bytes(blob)
    items = folder_items(str(folder))
    tars = _tars(items, str(root), 4)
    packed = str(root / "packed")
    pack(str(folder), packed, quiet=True)
    listed = items + [(str(root / "missing.jpg"), len(items))]
    # a good image then a bad one, for each bad one, in each source kind
    pairs = {"items": {}, "tars": {}, "packed": {}}
    by_name = {os.path.basename(p): (p, lab) for p, lab in listed}
    for bad in BAD + ("missing.jpg",):
        pair = [by_name["s00_good.jpg"], by_name[bad]]
        pairs["items"][bad] = pair
        if bad == "missing.jpg":
            continue
        d = root / f"pair_{bad}"
        for k, (path, _) in enumerate(pair):
            (d / f"c{k}").mkdir(parents=True)
            (d / f"c{k}" / os.path.basename(path)).write_bytes(open(path, "rb").read())
        pairs["tars"][bad] = _tars(folder_items(str(d)), str(d), 4)
        pairs["packed"][bad] = str(root / f"packed_{bad}")  # outside the folder it packs
        pack(str(d), pairs["packed"][bad], quiet=True)
    return {"folder": str(folder), "items": listed, "tars": tars, "packed": packed, "pairs": pairs}


# ---- running ----

def arrays(batch):
    out = {}
    for k, v in batch.items():
        try:
            out[k] = np.from_dlpack(v).copy()
        except (BufferError, TypeError, RuntimeError):  # bfloat16: NumPy has none
            import torch
            out[k] = torch.from_dlpack(v).float().numpy().copy()
    return out


def collect(loader):
    return [arrays(b) for b in loader]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
            np.testing.assert_array_equal(x[k], y[k])


def host_run(source, batch_size, **kw):
    with ImageLoader(source, batch_size, device="cpu", **kw) as loader:
        got = collect(loader)
        assert loader.stats()["decoder"] == "host"
        return got, loader.stats()


def gpu_run(source, batch_size, **kw):
    with ImageLoader(source, batch_size, **kw) as loader:
        got = collect(loader)
        s = loader.stats()
        assert s["decoder"] == "gpu" and s["decoder_reason"] == "", s
        return got, s


# ---- threads ----

def _image_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("pl-image"))


def _os_threads():
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _baseline(data):
    """The process's threads with the process-wide ones made (the default pinned pool's host
    stream is made by the first prefetcher and kept): a loader made and closed first."""
    with ImageLoader(data["packed"], 18, size=8, device="cpu") as loader:
        collect(loader)
    return _os_threads()


def _settle(want, deadline=30.0):
    """The process's threads once they are at most ``want`` (a detached producer ends when the
    read it waits for returns), or after ``deadline`` seconds, whichever is first."""
    t0 = time.monotonic()
    while _os_threads() > want and time.monotonic() - t0 < deadline:
        time.sleep(0.02)
    return _os_threads()
