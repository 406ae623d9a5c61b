"""ImageLoader's GPU path (pinloader/_image_epochs.py: Runner._gpu_epoch, _gpu_batch, _raw,
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

import os
import re
import threading

import numpy as np
import pytest

from pinloader import ImageDecodeError, ImageLoader, _C

from image_helpers import jpeg, photo

Image = pytest.importorskip("PIL.Image")
from image_gpu_fakes import (  # the fixtures gpu, data and mixed among them
    BAD, BAD_DATA, NO_END, _baseline, _image_threads, _member, _png, _settle, arrays, collect,
    data, digest, gpu, gpu_run, host_run, mixed, same)


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


def test_flipped_evaluation_crops_as_the_host_path(gpu, data):
    kw = dict(size=(12, 14), seed=5, train=False, flip=True, dtype="uint8", resize=16)
    want, _ = host_run(data["packed"], 5, **kw)
    got, _ = gpu_run(data["packed"], 5, **kw)
    same(got, want)
    with ImageLoader(data["packed"], 5, **kw) as loader:  # and some of them are flipped
        assert 0 < loader.params(0, range(18))[:, 8].sum() < 18


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
    def broken(device, libraries=(), **options):
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


# ---- sizes that do not match the image: the host path's rule on the GPU path ----

def _packed_with_sizes(tmp_path, fill):
    from image_helpers import make_folder
    from pinloader._image_pack import pack
    src = make_folder(str(tmp_path / "folder"), n_per_class=2)
    dest = tmp_path / "p"
    pack(src, str(dest), quiet=True)
    sizes = np.load(dest / "sizes.npy")
    sizes[0, :2] = fill  # sample 0's recorded size is wrong (sizes.npy, or a file replaced since)
    np.save(dest / "sizes.npy", sizes)
    return str(dest)


@pytest.mark.parametrize("fill", [5, 1000])  # a box that fits the real image, and one that does not
def test_a_recorded_size_that_is_not_the_images_fails_on_the_gpu_path_as_on_the_host(gpu, tmp_path, fill):
    root = _packed_with_sizes(tmp_path, fill)
    want = (rf"sample 0 .*: decoded to \d+ x \d+, not the {fill} x {fill} its crop was drawn for "
            r"\(the packed sizes.npy's, or its header's when the file was first read\)")
    for device in ("cpu", None):  # the host path, then the GPU path (the fake decoder)
        with ImageLoader(root, 3, size=8, device=device, shuffle=False) as loader:
            with pytest.raises(ImageDecodeError, match=want):
                collect(loader)


def test_a_recorded_size_that_is_not_the_images_is_skipped_alike_on_both_paths(gpu, tmp_path):
    root = _packed_with_sizes(tmp_path, 5)
    host, hs = host_run(root, 3, size=8, shuffle=False, on_error="skip")
    dev, ds = gpu_run(root, 3, size=8, shuffle=False, on_error="skip")
    same(host, dev)
    assert hs["skipped"] == ds["skipped"] == 1
    assert hs["skipped_samples"][0]["index"] == ds["skipped_samples"][0]["index"] == 0
