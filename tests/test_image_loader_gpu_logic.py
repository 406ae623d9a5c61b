"""ImageLoader's GPU path (pinloader/_image_epochs.py: _Runner._gpu_epoch, _gpu_batch, _raw,
_decode) on the host backend, against FakeJpegDecoder: a stand-in for ``_C.JpegDecoder`` that
keeps ``decode()``'s contract (src/py/jpeg_decoder.c: its arguments as the C code checks them,
the per-sample statuses of src/core/jpeg_cuda.h, a failed sample's output zero, the shape,
dtype and layout of the batch) and computes every sample with the host decoder's own functions
(pinloader/_image_ops.py), so that the GPU path's batches must equal the host path's exactly.

What the fake cannot show, and tests/test_image_loader_gpu.py checks on a GPU: nvJPEG's own
pixels (it differs from libjpeg-turbo by a few levels), which files nvJPEG's header parser and
decoders accept or refuse (the fake's verdicts are Pillow's and the project's header reader's),
the device array the prefetcher passes through and the door's import of it, the kernel's
arithmetic, device memory.

The GPU path is chosen by the loader itself: ``_C.JpegDecoder`` is the fake and
``_C.cuda_available`` says True (pytest's monkeypatch), ``device=None``; the native
prefetcher still finds no CUDA device and runs on the host backend.
"""
from __future__ import annotations

import hashlib
import io
import operator
import os
import re
import tarfile
import textwrap
import threading
import time

import numpy as np
import pytest

from pinloader import ImageDecodeError, ImageLoader, _C
from pinloader import _image_ops as ops
from pinloader._image_pack import pack

from helpers import WAIT_CHILD, describe, run_py
from image_helpers import folder_items, jpeg, make_folder, make_tars, photo

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
    """jpeg_cuda.c's has_end_marker (Note [truncated JPEGs]): FF D9 in the last END_WINDOW bytes."""
    return data.rfind(b"\xff\xd9", max(0, len(data) - END_WINDOW)) >= 0


def digest(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


class FakeJpegDecoder:
    """``_C.JpegDecoder`` on the host: ``decode()`` takes and checks the same arguments and
    returns ``(image, status)`` as the real one, each sample decoded by Pillow
    (``_image_ops.decode_rgb``) and resampled by ``_image_ops.resample``, then normalized, cast
    and laid out as the host path does (``_Runner._store`` and ``_final``). The statuses are the
    ones jpeg_cuda.c gives, in its order: 1 no header (the project's header reader finds none),
    3 components other than 1 or 3, 5 no end-of-image marker near the end, 4 the box outside
    the image, 2 the data does not decode (Pillow refuses it). ``inject``: a test's
    ``f(data, call) -> status`` for samples given as bytes (not ``raw=``) that would otherwise
    decode, standing in for what nvJPEG refuses and Pillow does not."""

    made: list = []       # every decoder made (the fixture gives each test its own list)
    inject = None         # staticmethod(f(bytes, call number) -> status), or None

    def __init__(self, device, libraries=()):
        if device == "cpu":  # what pl_resolve_device finds for the host backend
            raise ValueError(f"JpegDecoder decodes on a CUDA device; {device!r} is the host backend")
        for k, lib in enumerate(list(libraries or ())):
            if not isinstance(lib, str):
                raise TypeError(f"libraries[{k}] must be a str, not {type(lib).__name__}")
        self.device = device
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
        return dict(device=0, engines=0, cores_per_engine=0, workspace_bytes=0, **self.counts)

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
    root = tmp_path_factory.mktemp("gpu_logic")
    folder = make_folder(str(root / "folder"), n_per_class=6)
    items = folder_items(folder)
    tars = make_tars(items, str(root), per_shard=7)
    packed = str(root / "packed")
    pack(folder, packed, quiet=True)
    return {"folder": folder, "items": items, "tars": tars, "packed": packed}


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
        pairs["packed"][bad] = str(d / "packed")
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


# ---- the same batches as the host path ----

@pytest.mark.parametrize("source", ["folder", "items", "tars", "packed"])
@pytest.mark.parametrize("train", [True, False])
def test_same_batches_as_the_host_path(gpu, data, source, train):
    for dtype in ("uint8", "float32"):
        for layout in ("NCHW", "NHWC"):
            kw = dict(size=(12, 14), seed=5, train=train, dtype=dtype, layout=layout, resize=16)
            want, hs = host_run(data[source], 5, **kw)
            got, s = gpu_run(data[source], 5, **kw)
            same(got, want)
            assert [len(b["label"]) for b in got] == [5, 5, 5, 3]
            assert s["samples"] == hs["samples"] == 18 and s["skipped"] == 0 and s["host_decoded"] == 0
            dec = gpu.made[-1]
            assert s["gpu_decoder"]["batches"] == 4 and s["gpu_decoder"]["cuda"] == 18
            assert all(c["raw"] == [] and not any(c["status"]) for c in dec.calls)
            assert dec.closed  # the loader's close() closed it


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes_as_the_host_path(gpu, data, dtype):
    if dtype == "bfloat16":
        pytest.importorskip("torch")
    for layout in ("NCHW", "NHWC"):
        kw = dict(size=10, seed=2, dtype=dtype, layout=layout, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.25))
        want, _ = host_run(data["packed"], 6, **kw)
        got, _ = gpu_run(data["packed"], 6, **kw)
        same(got, want)


def test_the_decoder_is_chosen_and_kept(gpu, data):
    loader = ImageLoader(data["packed"], 6, size=8, decoder="gpu")
    for _ in range(3):  # three epochs, one decoder
        assert len(collect(loader)) == 3
    assert len(gpu.made) == 1 and gpu.made[0].device is None and not gpu.made[0].closed
    assert loader.stats()["gpu_decoder"]["batches"] == 9
    loader.close()
    assert gpu.made[0].closed
    # static batches are the host's (the prefetcher fills its buffers from host batches)
    with ImageLoader(data["packed"], 6, size=8, static=True) as loader:
        next(iter(loader))
        s = loader.stats()
        assert s["decoder"] == "host" and "static" in s["decoder_reason"]
    # a decoder that cannot be made: the host decoder, with the reason; "gpu" refuses
    def broken(device, libraries=()):
        raise RuntimeError("JpegDecoder: nvJPEG was not found")
    gpu.made.clear()
    _C.JpegDecoder = broken  # restored by the fixture's monkeypatch
    with ImageLoader(data["packed"], 6, size=8) as loader:
        next(iter(loader))
        assert loader.stats()["decoder"] == "host"
        assert "nvJPEG was not found" in loader.stats()["decoder_reason"]
    with ImageLoader(data["packed"], 6, size=8, decoder="gpu") as loader:
        with pytest.raises(RuntimeError, match="decoder='gpu' cannot be used.*nvJPEG was not found"):
            iter(loader)



def test_the_decoder_follows_the_settings(gpu, data):
    """A static door's epoch is the host decoder's (the GPU decoder released), the plain
    iteration after it the GPU decoder's again; each epoch the batches of its own number."""
    pytest.importorskip("torch")
    import pinloader.torch as pt
    kw = dict(size=8, seed=3, dtype="uint8")
    loader = ImageLoader(data["packed"], 5, **kw)
    want = {}
    for ep in range(3):
        ref = ImageLoader(data["packed"], 5, device="cpu", **kw)
        ref.set_epoch(ep)
        want[ep] = collect(ref)
        ref.close()
    same(collect(loader), want[0])
    assert loader.stats()["decoder"] == "gpu"
    door = pt.prefetch(loader, static=True)
    got = [{k: v[: door.valid_rows].numpy().copy() for k, v in b.items()} for b in door]
    same(got, want[1])
    assert loader.stats()["decoder"] == "host" and len(gpu.made) == 1 and gpu.made[0].closed
    same(collect(loader), want[2])
    assert loader.stats()["decoder"] == "gpu" and len(gpu.made) == 2 and not gpu.made[1].closed
    loader.close()
    assert gpu.made[1].closed

# ---- images nvJPEG does not take, and bad ones ----

@pytest.mark.parametrize("source", ["folder", "items", "tars", "packed"])
def test_mixed_images_skipped_as_on_the_host(gpu, mixed, source):
    for dtype in ("uint8", "float32"):
        kw = dict(size=(10, 12), seed=3, train=dtype == "uint8", shuffle=False, dtype=dtype, on_error="skip")
        want, hs = host_run(mixed[source], 4, **kw)
        got, s = gpu_run(mixed[source], 4, **kw)
        same(got, want)
        missing = 1 if source == "items" else 0
        assert s["samples"] == hs["samples"] == 7
        assert s["skipped"] == hs["skipped"] == 3 + missing
        names = sorted(_member(x["name"]) for x in s["skipped_samples"])
        assert names == sorted(_member(x["name"]) for x in hs["skipped_samples"])
        assert names == sorted(list(BAD) + (["missing.jpg"] if missing else []))
        assert sorted(x["index"] for x in s["skipped_samples"]) == \
            sorted(x["index"] for x in hs["skipped_samples"])
        # the PNG and the CMYK JPEG by their headers, the JPEG with a trailer by its status
        assert s["host_decoded_reasons"] == {
            "not a JPEG": 1, "a JPEG of 4 components": 1,
            "no end-of-image marker (cut short, or data after the image)": 1}
        assert s["host_decoded"] == 3
        why = {_member(x["name"]): x["reason"] for x in s["skipped_samples"]}
        assert why["s04_truncated.jpg"].startswith("no end-of-image marker") and "cannot decode" in why["s04_truncated.jpg"]
        assert why["s05_corrupt.jpg"].startswith("nvJPEG could not decode it, and cannot decode")
        assert "not an image Pillow recognizes" in why["s06_text.jpg"]
        # the GPU calls: a sample that could not be read or is not an image is left out; a
        # batch is decoded again only for the samples the host decoded after nvJPEG refused
        # them (here the JPEG with a trailer, after the truncated and the corrupt one failed)
        calls = [(c["n"], c["raw"], c["status"]) for c in gpu.made[-1].calls]
        assert calls == [(4, [1, 3], [0] * 4), (3, [], [NO_END, BAD_DATA, NO_END]), (1, [0], [0]),
                         (2, [], [0, 0])]


@pytest.mark.parametrize("source", ["items", "tars", "packed"])
def test_bad_samples_raise_naming_index_and_file(gpu, mixed, source):
    for bad, src in mixed["pairs"][source].items():
        errors = []
        for device in ("cpu", None):
            loader = ImageLoader(src, 2, size=8, shuffle=False, device=device)
            k = 1
            assert loader.source.name(k).endswith(bad)
            with pytest.raises(ImageDecodeError) as e:
                collect(loader)
            assert loader.stats()["decoder"] == ("host" if device == "cpu" else "gpu")
            loader.close()
            prefix = f"ImageLoader: sample {k} ({loader.source.name(k)}): "
            assert str(e.value).startswith(prefix), (str(e.value), prefix)
            errors.append(re.sub(r" at 0x[0-9a-f]+", "", str(e.value)[len(prefix):]))  # a BytesIO's address
        # the GPU path's reason: how the sample came to the host decoder, then the host's words
        if bad == "missing.jpg":
            assert all(x.startswith("cannot be read ([Errno 2]") for x in errors), errors
        else:
            assert errors[1].endswith(errors[0]), errors


INJECTED = {1: "nvJPEG could not parse its header", 2: "nvJPEG could not decode it",
            3: "nvJPEG does not support it", 4: "its size differs from its header's",
            5: "no end-of-image marker (cut short, or data after the image)"}


@pytest.mark.parametrize("source", ["folder", "packed"])
def test_injected_statuses_go_to_the_host_decoder(gpu, data, source):
    """Samples nvJPEG refuses (each status) are decoded by the host and handed back through raw=:
    the batches are the host path's."""
    loader = ImageLoader(data[source], 6, size=8, seed=1, device="cpu")
    victims = {int(i): st for i, st in zip(loader.indices(0)[[0, 4, 7, 11, 17]], (1, 2, 3, 4, 5))}
    blobs = {digest(loader.source.read_one(i)): st for i, st in victims.items()}
    loader.close()
    gpu.inject = staticmethod(lambda data, call: blobs.get(digest(data), 0))
    for train in (True, False):
        kw = dict(size=8, seed=1, train=train, shuffle=True)
        want, _ = host_run(data[source], 6, **kw)
        got, s = gpu_run(data[source], 6, **kw)
        same(got, want)
        assert s["host_decoded_reasons"] == {INJECTED[st]: 1 for st in (1, 2, 3, 4, 5)}
        assert s["host_decoded"] == 5 and s["skipped"] == 0 and s["samples"] == 18
        calls = gpu.made[-1].calls
        # each batch with a victim was decoded twice: the victims' second time through raw=
        assert [len(c["raw"]) for c in calls] == [0, 2, 0, 2, 0, 1]
        assert [sorted(x for x in c["status"] if x) for c in calls] == [[1, 2], [], [3, 4], [], [5], []]


def test_a_failure_on_the_retry_is_an_error_naming_the_sample(gpu, data):
    """A sample nvJPEG decoded in a batch's first call but not in its retry (the retry holds
    the host-decoded samples): an ImageDecodeError naming it, even with on_error='skip'."""
    loader = ImageLoader(data["packed"], 6, size=8, device="cpu", shuffle=False)
    first, second = (digest(loader.source.read_one(i)) for i in (0, 1))
    loader.close()
    gpu.inject = staticmethod(lambda d, call: {(first, 0): 2, (second, 1): 2}.get((digest(d), call), 0))
    with ImageLoader(data["packed"], 6, size=8, shuffle=False, on_error="skip") as loader:
        with pytest.raises(ImageDecodeError, match=r"sample 1 \(.*\): the GPU decoder failed on a retry \(status 2\)"):
            collect(loader)


def test_a_batch_whose_every_sample_fails_is_empty(gpu, mixed):
    items = mixed["items"]
    by_name = {os.path.basename(p): (p, lab) for p, lab in items}
    bad = [by_name[n] for n in BAD] + [by_name["missing.jpg"]]
    good = by_name["s00_good.jpg"]
    src = [good, bad[0], bad[1], bad[2], bad[3], bad[0], good]
    for dtype, layout in (("float32", "NCHW"), ("uint8", "NHWC")):
        kw = dict(size=8, shuffle=False, on_error="skip", dtype=dtype, layout=layout)
        loader = ImageLoader(src, 1, **kw)
        got = collect(loader)
        empty = (0, 3, 8, 8) if layout == "NCHW" else (0, 8, 8, 3)
        assert [b["image"].shape[0] for b in got] == [1, 0, 0, 0, 0, 0, 1]
        assert all(b["image"].shape == empty and b["image"].dtype == np.dtype(dtype) for b in got[1:6])
        assert all(b["label"].shape == (0,) and b["label"].dtype == np.int64 for b in got[1:6])
        assert loader.stats()["skipped"] == 5
        # no GPU call for a batch of a file that is not an image or one that is missing
        assert [c["n"] for c in gpu.made[-1].calls] == [1, 1, 1, 1, 1]
        loader.close()
        want, _ = host_run(src, 1, **kw)
        same(got, want)
        # and whole batches of them: the GPU call of the samples that read, then nothing kept
        want, _ = host_run(src[1:6], 5, **kw)
        got, s = gpu_run(src[1:6], 5, **kw)
        same(got, want)
        assert got[0]["image"].shape == empty and s["skipped"] == 5
        assert [(c["n"], c["status"]) for c in gpu.made[-1].calls] == [(3, [NO_END, BAD_DATA, NO_END])]


# ---- lifecycle ----

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


@pytest.mark.parametrize("source", ["folder", "packed"])
def test_close_mid_epoch_with_the_reader_busy(gpu, data, source, capfd):
    threads0 = _baseline(data)
    loader = ImageLoader(data[source], 3, size=8, workers=2)
    src = loader.source
    real_read = src.read
    entered, release = threading.Event(), threading.Event()

    def slow_read(idx):
        if len(gpu.made) and len(gpu.made[0].calls) >= 1:  # from the second batch's read on
            entered.set()
            release.wait(20)
        return real_read(idx)

    src.read = slow_read
    it = iter(loader)
    first = arrays(next(it))
    assert first["image"].shape == (3, 3, 8, 8)
    assert entered.wait(20), "the reader never started the next batch"
    assert _image_threads() == ["pl-image-read_0"]
    timer = threading.Timer(0.5, release.set)  # the read returns while close() waits for it
    timer.start()
    loader.close()
    timer.join()
    assert loader.closed and gpu.made[0].closed
    assert _image_threads() == []
    assert _settle(threads0) <= threads0
    with pytest.raises(ValueError, match="closed"):
        next(loader)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


def test_close_mid_epoch_frees_everything(gpu, data):
    """Closed after its first batch, many times: no thread, decoder or mapping left."""
    threads0 = _baseline(data)
    for k in range(4):
        loader = ImageLoader(data["packed" if k % 2 else "tars"], 2, size=8, workers=2)
        it = iter(loader)
        next(it)
        loader.close()
        assert loader.source.region is None and gpu.made[-1].closed
    assert _image_threads() == []
    assert _settle(threads0) <= threads0


@pytest.mark.parametrize("k", ["1", "3"])
def test_resume_mid_epoch_is_exact(gpu, data, monkeypatch, k):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", k)
    kw = dict(size=8, seed=9, dtype="uint8")
    for source in ("folder", "packed"):
        whole, _ = gpu_run(data[source], 4, **kw)
        a = ImageLoader(data[source], 4, **kw)
        it = iter(a)
        first = [arrays(next(it)) for _ in range(2)]
        state = a.state_dict()
        a.close()
        assert state["position"] == 8
        b = ImageLoader(data[source], 4, **kw)
        b.load_state_dict(state)
        same(first + collect(b), whole)
        assert b.stats()["decoder"] == "gpu" and b.stats()["samples"] == 10
        nxt = collect(b)  # the next epoch, whole
        ref = ImageLoader(data[source], 4, device="cpu", **kw)
        ref.set_epoch(1)
        same(nxt, collect(ref))
        ref.close()
        b.close()


def test_memory_stays_flat_over_epochs(gpu, data):
    loader = ImageLoader(data["packed"], 6, size=8, dtype="uint8")
    peaks = []
    for _ in range(5):
        collect(loader)
        peaks.append(loader.stats()["pinned_bytes_peak"])
    # a high-water mark: at most the prefetcher's depth (3) and the batch handed out, each
    # 1,200 bytes here (rounded up by the pool), the same bound in the last epoch as the first
    assert max(peaks) <= 4 * 2048
    assert loader.stats()["gpu_decoder"]["batches"] == 15
    loader.close()


def test_shards_and_drop_last_as_the_host_path(gpu, data):
    for rank in (0, 1):
        kw = dict(size=8, seed=4, rank=rank, world_size=2, drop_last=True, dtype="uint8")
        want, _ = host_run(data["tars"], 4, **kw)
        got, s = gpu_run(data["tars"], 4, **kw)
        same(got, want)
        assert [len(b["label"]) for b in got] == [4, 4] and s["samples"] == 8


def test_errors_then_a_new_epoch(gpu, mixed, data, tmp_path):
    """An epoch that raised leaves the loader usable: the next iteration begins that epoch again
    and meets the same sample; a mapped file cut on disk between epochs is the read's error, as
    on the host path."""
    import shutil
    src = mixed["pairs"]["packed"]["s05_corrupt.jpg"]
    loader = ImageLoader(src, 2, size=8, shuffle=False)
    for _ in range(2):
        with pytest.raises(ImageDecodeError, match=r"sample 1 \(.*s05_corrupt\.jpg\): nvJPEG could not decode it"):
            collect(loader)
        assert loader.stats()["epoch"] == 0 and loader.stats()["samples"] == 0
    assert _image_threads() == ["pl-image-read_0"]
    loader.close()
    packed = str(tmp_path / "packed")
    shutil.copytree(data["packed"], packed)
    loader = ImageLoader(packed, 4, size=8)
    assert len(collect(loader)) == 5  # a whole epoch: nothing is being read when the file is cut
    with open(os.path.join(packed, "data.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="data.bin was truncated on disk while loading"):
        collect(loader)
    assert loader.stats()["decoder"] == "gpu"
    loader.close()
    assert _image_threads() == []


def test_a_host_image_past_what_the_gpu_call_takes(gpu, tmp_path):
    """decode() takes host-decoded images of at most 65535 a side (raw=, jpeg_decoder.c); a
    wider PNG is cropped and resized on the host and handed over as its output window: the
    host path's values, not an error for the whole batch."""
    wide = np.ascontiguousarray(np.tile(photo(3, 100, 0), (1, 700, 1)))  # 3 x 70,000
    (tmp_path / "wide.png").write_bytes(_png(wide))
    (tmp_path / "tall.png").write_bytes(_png(np.ascontiguousarray(wide.transpose(1, 0, 2))))
    (tmp_path / "good.jpg").write_bytes(jpeg(photo(30, 40, 1)))
    items = [(str(tmp_path / n), k) for k, n in enumerate(("good.jpg", "wide.png", "tall.png"))]
    for train in (True, False):
        kw = dict(size=(8, 10), train=train, shuffle=False, dtype="uint8", on_error="skip")
        want, hs = host_run(items, 3, **kw)
        got, s = gpu_run(items, 3, **kw)
        same(got, want)
        assert got[0]["label"].tolist() == [0, 1, 2] and s["host_decoded_reasons"] == {"not a JPEG": 2}
        (call,) = gpu.made[-1].calls
        assert call["raw"] == [1, 2] and call["status"] == [0, 0, 0]


# ---- several decoders on threads (Note [decoder threads] in pinloader/_image_epochs.py) ----

@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("source", ["folder", "tars", "packed"])
def test_decoder_threads_give_the_host_paths_batches(gpu, data, monkeypatch, source, k):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", str(k))
    for train in (True, False):
        kw = dict(size=(12, 14), seed=5, train=train, dtype="float32")
        want, hs = host_run(data[source], 4, **kw)
        got, s = gpu_run(data[source], 4, **kw)
        same(got, want)
        assert s["samples"] == hs["samples"] == 18 and s["skipped"] == 0
        assert s["gpu_decoder"]["decoders"] == k
        assert s["gpu_decoder"]["batches"] == 5 and s["gpu_decoder"]["cuda"] == 18
        # batch b went to decoder b % k, and the loader's close() closed every one
        assert len(gpu.made) == k and all(d.closed for d in gpu.made)
        assert [len(d.calls) for d in gpu.made] == [len(range(j, 5, k)) for j in range(k)]
        # on the decoder threads, which call CUDA as the producer does: each ignores the graph
        # captures other threads begin (Note [the producer and graph captures] in
        # src/py/pf_producer.c), as the producer does for itself
        calls = [c for d in gpu.made for c in d.calls]
        assert all(c["thread"].startswith("pl-image-decode") and c["capture_local"] for c in calls)
        gpu.made.clear()


def test_decoder_threads_skip_and_raise_as_one_decoder_does(gpu, mixed, monkeypatch):
    """The same samples skipped, counted and host-decoded; with on_error='raise' the same first
    error, after the same batches (a later batch's error, met first on another thread, waits
    for its turn)."""
    seen = {}
    for k in ("1", "3"):
        monkeypatch.setenv("PINLOADER_JPEG_DECODERS", k)
        got, s = gpu_run(mixed["packed"], 2, size=(10, 12), seed=3, shuffle=False, on_error="skip")
        names = sorted(_member(x["name"]) for x in s["skipped_samples"])
        delivered, error = [], None
        with ImageLoader(mixed["packed"], 2, size=8, shuffle=False) as loader:
            try:
                for b in loader:
                    delivered.append(arrays(b)["label"].tolist())
            except ImageDecodeError as e:
                error = str(e)
        seen[k] = (got, s["skipped"], names, s["host_decoded_reasons"], delivered, error)
    same(seen["1"][0], seen["3"][0])
    assert seen["1"][1:] == seen["3"][1:] and seen["1"][5] is not None


def test_close_mid_epoch_with_decoder_threads(gpu, data, monkeypatch):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")
    threads0 = _baseline(data)
    for k in range(4):
        loader = ImageLoader(data["packed" if k % 2 else "folder"], 2, size=8, workers=2)
        it = iter(loader)
        next(it)  # the next batches' decodes are under way on the other threads
        loader.close()
        assert len(gpu.made) == 3 and all(d.closed for d in gpu.made)
        gpu.made.clear()
    assert _image_threads() == []
    assert _settle(threads0) <= threads0


def test_a_decoder_that_cannot_be_made_leaves_the_others(gpu, data, monkeypatch):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")

    def two_at_most(device, libraries=()):
        if len(FakeJpegDecoder.made) >= 2:
            raise RuntimeError("JpegDecoder: out of device memory for a workspace")
        return FakeJpegDecoder(device, libraries=libraries)

    monkeypatch.setattr(_C, "JpegDecoder", two_at_most)
    want, _ = host_run(data["packed"], 4, size=8, seed=1)
    got, s = gpu_run(data["packed"], 4, size=8, seed=1)
    same(got, want)
    assert s["gpu_decoder"]["decoders"] == 2 and s["gpu_decoder"]["batches"] == 5


def test_two_decoders_by_default(gpu, data, monkeypatch):
    monkeypatch.delenv("PINLOADER_JPEG_DECODERS")
    got, s = gpu_run(data["packed"], 4, size=8, seed=1)
    assert s["gpu_decoder"]["decoders"] == 2 and s["gpu_decoder"]["batches"] == 5
    assert len(gpu.made) == 2


# digits other than ASCII's pass str.isdigit(): int() takes "٣" and "３" (refused: no silent
# conversion) but not "²" or "⑦"; and past 4,300 digits int() refuses even ASCII ones
@pytest.mark.parametrize("text", ["0", "9", "two", "-1", "1.5", "2 3", "²", "⑦", "٣", "３", "long"])
def test_a_bad_decoder_count_is_refused_where_the_loader_is_made(data, monkeypatch, text):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "0" * 5000 + "2" if text == "long" else text)
    with pytest.raises(ValueError, match="PINLOADER_JPEG_DECODERS must be an integer from 1 to 8"):
        ImageLoader(data["packed"], 4, size=8, device="cpu")


def test_close_while_an_epoch_makes_its_decoders(gpu, data, monkeypatch, capfd):
    """close() on another thread while the producer makes the epoch's extra decoders (slow on a
    GPU, so close() detaches the producer): every decoder made is closed and no decoder or
    reader thread is left, once the producer's epoch ends."""
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")
    threads0 = _baseline(data)
    gpu.made.clear()
    entered, release = threading.Event(), threading.Event()

    def slow(device, libraries=()):
        if len(FakeJpegDecoder.made) >= 1:  # the extra decoders, made on the producer thread
            entered.set()
            release.wait(20)
        return FakeJpegDecoder(device, libraries=libraries)

    monkeypatch.setattr(_C, "JpegDecoder", slow)
    loader = ImageLoader(data["packed"], 2, size=8)
    iter(loader)
    assert entered.wait(20), "the producer never began the epoch"
    timer = threading.Timer(0.5, release.set)  # the decoder is made while close() runs
    timer.start()
    loader.close()
    timer.join()
    assert _settle(threads0) <= threads0
    assert _image_threads() == []
    assert len(gpu.made) >= 2 and all(d.closed for d in gpu.made), [d.closed for d in gpu.made]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


def test_decoder_threads_record_the_first_skipped_samples_in_order(gpu, mixed, monkeypatch):
    """stats()["skipped_samples"] holds the first samples skipped in the batches' order, as one
    decoder gives them, even when a later batch's decode, on another thread, skips first (here
    batch 2's decode waits until batch 3 has skipped its sample)."""
    kw = dict(size=8, shuffle=False, on_error="skip")
    got = {}
    for k in ("1", "3"):
        monkeypatch.setenv("PINLOADER_JPEG_DECODERS", k)
        with ImageLoader(mixed["packed"], 2, **kw) as loader:
            runner = loader._runner
            corrupt = next(i for i in range(len(loader.source))
                           if loader.source.name(i).endswith("s05_corrupt.jpg"))
            late = digest(loader.source.read_one(corrupt))

            def after_batch_3(data, call):
                if digest(data) == late:  # batch 2's: wait for batch 3's skip (s06_text.jpg)
                    deadline = time.monotonic() + 20
                    while runner.counts["skipped"] < 1 and time.monotonic() < deadline:
                        time.sleep(0.005)
                return 0

            gpu.inject = staticmethod(after_batch_3 if k == "3" else (lambda data, call: 0))
            collect(loader)
            got[k] = loader.stats()["skipped_samples"]
    assert [_member(x["name"]) for x in got["1"]] == ["s04_truncated.jpg", "s05_corrupt.jpg", "s06_text.jpg"]
    assert got["3"] == got["1"]


def test_fork_while_a_decoder_thread_counts(data):
    """fork() while a decoder thread of the parent holds the lock on the counts (it counts a
    batch): the child's epoch, on its own threads, does not wait for ever on that lock."""
    code = textwrap.dedent("""
    import os, sys, threading, time, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
    sys.path.insert(0, "tests")
    from pinloader import ImageLoader, _C
    import test_image_loader_gpu_logic as T
    _C.JpegDecoder, _C.cuda_available = T.FakeJpegDecoder, lambda: True
    os.environ["PINLOADER_JPEG_DECODERS"] = "2"
    """) + WAIT_CHILD.format(timeout=30.0, poll=0.01) + textwrap.dedent("""
    L = ImageLoader(sys.argv[1], 4, size=8, seed=1)
    want = [T.arrays(b)["label"].tolist() for b in L]
    assert L.stats()["decoder"] == "gpu" and L.stats()["gpu_decoder"]["decoders"] == 2
    held, done = threading.Event(), threading.Event()

    def counting():  # as a decoder thread in _Runner.count() at the moment of fork
        with L._runner.lock:
            held.set()
            done.wait(60)

    t = threading.Thread(target=counting)
    t.start()
    assert held.wait(30)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            L.set_epoch(0)
            try:  # the parent's prefetcher refuses (tests/test_image_loader.py's fork test)
                next(iter(L))
            except RuntimeError as e:
                assert "fork" in str(e), e
            L.set_epoch(0)  # then a new one, and new decoder threads
            got = [T.arrays(b)["label"].tolist() for b in L]
            code = 0 if got == want else 3
        finally:
            os._exit(code)
    status = wait_child(pid)
    done.set()
    t.join()
    assert status == 0, status
    L.close()
    print("OK")
    """)
    p = run_py(code, timeout=120, argv=[data["packed"]])
    assert p.returncode == 0 and "OK" in p.stdout, describe(p)
