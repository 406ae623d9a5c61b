"""ImageLoader on the host backend (pinloader/image_loader.py): every source gives the same
batches, the values are Pillow's computation written out independently (tests/image_helpers.py),
resume and sharding are ArrayLoader's, and bad input is a clear error or a counted skip."""
from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

import pinloader
from pinloader import ImageDecodeError, ImageLoader

from image_helpers import jpeg, make_sources, photo, reference

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_sources(str(tmp_path_factory.mktemp("images")), per_shard=7)


def host(loader):
    """A batch's arrays on the host."""
    return [{k: np.from_dlpack(v).copy() for k, v in b.items()} for b in loader]


def run(source, **kw):
    kw.setdefault("device", "cpu")
    with ImageLoader(source, kw.pop("batch_size", 5), **kw) as loader:
        return host(loader)


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_every_source_gives_the_same_batches(data):
    kw = dict(size=24, seed=11)
    want = run(data["folder"], **kw)
    assert len(want) == 4 and sum(len(b["label"]) for b in want) == 18
    same(run(data["items"], **kw), want)
    same(run(data["tars"], **kw), want)
    same(run(data["tars"][0], **kw), run(data["items"][:7], **kw))
    same(run(data["packed"], **kw), want)


def test_labels_are_imagefolders(data):
    with ImageLoader(data["folder"], 4, device="cpu", shuffle=False) as loader:
        assert loader.classes == ["a_cat", "b_dog", "c_eel"]
        labels = np.concatenate([b["label"] for b in host(loader)])
    assert labels.tolist() == [lab for _, lab in data["items"]]
    assert labels.tolist() == sorted(labels.tolist())


@pytest.mark.parametrize("train", [True, False])
def test_values_are_pillows(data, train):
    size = (24, 20)
    loader = ImageLoader(data["folder"], 6, device="cpu", size=size, seed=3, train=train, resize=30)
    order = loader.indices(0)
    batches = host(loader)
    got = np.concatenate([b["image"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    for k, i in enumerate(order):
        path, lab = data["items"][i]
        with open(path, "rb") as f:
            blob = f.read()
        p = loader.params(0, [i])[0]
        if not train:
            assert p[8] == 0 and tuple(p[:2]) == (0, 0)
        np.testing.assert_allclose(got[k], reference(blob, p, size), rtol=0, atol=1e-6)
        assert labels[k] == lab
    loader.close()


def test_flips_and_crops_vary_but_repeat(data):
    a = run(data["packed"], size=16, seed=1, shuffle=False)
    b = run(data["packed"], size=16, seed=1, shuffle=False)
    c = run(data["packed"], size=16, seed=2, shuffle=False)
    same(a, b)
    assert not np.array_equal(a[0]["image"], c[0]["image"])
    loader = ImageLoader(data["packed"], 4, device="cpu", size=16)
    p = loader.params(0, np.arange(18))
    assert 0 < p[:, 8].sum() < 18
    assert len({tuple(r[:4]) for r in p}) > 10
    assert not np.array_equal(p, loader.params(1, np.arange(18)))
    loader.close()


@pytest.mark.parametrize("dtype", ["uint8", "float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_dtypes_and_layouts(data, dtype, layout):
    torch = pytest.importorskip("torch") if dtype == "bfloat16" else None
    size = (12, 14)
    loader = ImageLoader(data["packed"], 6, device="cpu", size=size, dtype=dtype, layout=layout, seed=4)
    base = run(data["packed"], batch_size=6, size=size, seed=4, dtype="uint8")
    for b, ref in zip(loader, base):
        img = b["image"]
        if dtype == "bfloat16":
            t = torch.from_dlpack(img)
            assert t.dtype == torch.bfloat16
            got = t.float().numpy()
        else:
            got = np.from_dlpack(img)
            assert got.dtype == np.dtype(dtype)
        n = len(ref["label"])
        want_shape = (n, 3, *size) if layout == "NCHW" else (n, *size, 3)
        assert got.shape == want_shape
        if layout == "NHWC":
            got = got.transpose(0, 3, 1, 2)
        u8 = ref["image"].astype(np.float32)
        if dtype == "uint8":
            np.testing.assert_array_equal(got, ref["image"])
            continue
        want = u8 * (1 / (255 * np.array([0.229, 0.224, 0.225]))).astype(np.float32)[:, None, None] \
            + (-np.array([0.485, 0.456, 0.406]) / np.array([0.229, 0.224, 0.225])).astype(np.float32)[:, None, None]
        tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 2e-2}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    loader.close()


def test_mean_none_gives_unit_range_and_keys(data):
    (b, *_) = run(data["packed"], size=8, mean=None, std=None, keys=("x", "y"), batch_size=18)
    assert set(b) == {"x", "y"}
    assert b["x"].min() >= 0 and b["x"].max() <= 1 and b["x"].max() > 0.5


def test_resume_mid_epoch_is_exact(data):
    kw = dict(size=8, seed=9, device="cpu")
    whole = host(ImageLoader(data["packed"], 4, **kw))
    a = ImageLoader(data["packed"], 4, **kw)
    it = iter(a)
    first = [{k: np.from_dlpack(v).copy() for k, v in next(it).items()} for _ in range(2)]
    state = a.state_dict()
    a.close()
    assert state["format"] == "pinloader.ImageLoader" and state["position"] == 8
    b = ImageLoader(data["packed"], 4, **kw)
    b.load_state_dict(state)
    same(first + host(b), whole)
    # the next epoch follows as usual
    nxt = host(b)
    same(nxt, host(_at_epoch(ImageLoader(data["packed"], 4, **kw), 1)))
    b.close()
    with pytest.raises(ValueError, match="not an ImageLoader state"):
        ImageLoader(data["packed"], 4, **kw).load_state_dict(dict(state, format="pinloader.ArrayLoader"))
    with pytest.raises(ValueError, match="seed"):
        ImageLoader(data["packed"], 4, size=8, seed=10, device="cpu").load_state_dict(state)


def _at_epoch(loader, e):
    loader.set_epoch(e)
    return loader


def test_sharding_and_elastic_resume(data):
    kw = dict(size=8, seed=5, device="cpu")
    shards = [ImageLoader(data["packed"], 3, rank=r, world_size=2, **kw) for r in range(2)]
    idx = [np.asarray(s.indices(0)) for s in shards]
    assert len(set(idx[0]) & set(idx[1])) == 0 and sorted(np.concatenate(idx)) == list(range(18))
    labels = [np.concatenate([b["label"] for b in host(s)]) for s in shards]
    items = data["items"]
    for r in range(2):
        assert labels[r].tolist() == [items[i][1] for i in idx[r]]
    # two ranks took one batch each; one rank resumes the rest
    for s in shards:
        s.set_epoch(0)
        next(iter(s))
    state = shards[0].state_dict()
    assert state["position"] == 6 and state["epoch"] == 0
    one = ImageLoader(data["packed"], 3, rank=0, world_size=1, **kw)
    one.load_state_dict(state)
    rest = np.concatenate([b["label"] for b in host(one)])
    full = np.asarray(one.indices(0))
    assert set(full[:6]) == set(idx[0][:3]) | set(idx[1][:3])
    assert rest.tolist() == [items[i][1] for i in full[6:]]
    assert one.indices_after(0, 6).tolist() == full[6:].tolist()
    for s in shards + [one]:
        s.close()


def test_torch_door(data):
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt
    loader = ImageLoader(data["packed"], 5, size=8, device="cpu")
    got = list(pt.prefetch(loader))
    assert all(isinstance(b["image"], torch.Tensor) and b["image"].shape[1:] == (3, 8, 8) for b in got)
    assert sum(len(b["label"]) for b in got) == 18
    loader.close()


def test_odd_images(tmp_path):
    """Grayscale, CMYK, PNG, palette, 1x1 and a 20,000-pixel-wide image all decode."""
    a = photo(40, 50, 0)
    blobs = {"gray.jpg": jpeg(a[..., 0]), "prog.jpg": jpeg(a, progressive=True), "one.jpg": jpeg(a[:1, :1]),
             "wide.jpg": jpeg(photo(16, 20000, 1)), "tall.jpg": jpeg(photo(20000, 8, 2))}
    buf = io.BytesIO()
    Image.fromarray(a).convert("CMYK").save(buf, format="JPEG")
    blobs["cmyk.jpg"] = buf.getvalue()
    for name, mode in (("img.png", "RGB"), ("pal.png", "P"), ("rgba.png", "RGBA")):
        buf = io.BytesIO()
        Image.fromarray(a).convert(mode).save(buf, format="PNG")
        blobs[name] = buf.getvalue()
    items = []
    for k, (name, blob) in enumerate(sorted(blobs.items())):
        p = tmp_path / name
        p.write_bytes(blob)
        items.append((str(p), k))
    for train in (True, False):
        loader = ImageLoader(items, 4, size=(10, 12), device="cpu", train=train, shuffle=False, dtype="uint8")
        got = np.concatenate([b["image"] for b in host(loader)])
        assert got.shape == (len(items), 3, 10, 12)
        for k, (path, _) in enumerate(items):
            with open(path, "rb") as f:
                ref = reference(f.read(), loader.params(0, [k])[0], (10, 12), dtype="uint8")
            np.testing.assert_array_equal(got[k], ref, err_msg=path)
        g = got[[k for k, (p, _) in enumerate(items) if p.endswith("gray.jpg")][0]]
        assert (g[0] == g[1]).all()
        loader.close()


def _corrupt_set(tmp_path):
    a = photo(30, 30, 0)
    good = jpeg(a)
    items = []
    for k, blob in enumerate([good, good[: len(good) // 2], b"not an image", b"", good]):
        p = tmp_path / f"s{k}.jpg"
        p.write_bytes(blob)
        items.append((str(p), k))
    items.append((str(tmp_path / "missing.jpg"), 5))
    return items


def test_bad_samples_raise_naming_index_and_file(tmp_path):
    items = _corrupt_set(tmp_path)
    for k in (1, 2, 3, 5):
        sub = [items[0], items[k]]
        loader = ImageLoader(sub, 2, size=8, device="cpu", shuffle=False)
        with pytest.raises(ImageDecodeError, match=rf"sample 1 \(.*{os.path.basename(sub[1][0])}\)"):
            host(loader)
        loader.close()


def test_bad_samples_skipped_and_counted(tmp_path):
    items = _corrupt_set(tmp_path)
    loader = ImageLoader(items, 3, size=8, device="cpu", shuffle=False, on_error="skip")
    got = host(loader)
    assert [b["label"].tolist() for b in got] == [[0], [4]]
    s = loader.stats()
    assert s["skipped"] == 4 and s["samples"] == 2 and s["decoder"] == "host"
    assert sorted(x["index"] for x in s["skipped_samples"]) == [1, 2, 3, 5]
    assert any("missing.jpg" in x["name"] for x in s["skipped_samples"])
    assert loader.state_dict()["epoch"] == 1
    loader.close()
    # a batch whose samples were all skipped is an empty batch, on both paths; it still counts
    # for the resume
    for gpu in (False, True):
        loader = ImageLoader(items, 2, size=8, device="cpu", shuffle=False, on_error="skip")
        if gpu:
            fake_gpu(loader)
        it = iter(loader)
        first = next(it)
        assert np.from_dlpack(first["label"]).tolist() == [0]
        empty = next(it)
        assert np.from_dlpack(empty["image"]).shape == (0, 3, 8, 8)
        assert loader.state_dict()["position"] == 4
        assert np.from_dlpack(next(it)["label"]).tolist() == [4]
        with pytest.raises(StopIteration):
            next(it)
        loader.close()


def test_source_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class folders"):
        ImageLoader(str(tmp_path / "empty"), 2)
    (tmp_path / "empty" / "cls").mkdir()
    (tmp_path / "empty" / "cls" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="no image files"):
        ImageLoader(str(tmp_path / "empty"), 2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageLoader(str(tmp_path / "nowhere"), 2)
    with pytest.raises(ValueError, match="empty"):
        ImageLoader([], 2)
    with pytest.raises(TypeError, match=r"must be .tar shards.*\(path, label\) pairs"):
        ImageLoader(["a.jpg", "b.jpg"], 2)
    with pytest.raises(TypeError, match="label must be an int"):
        ImageLoader([("a.jpg", "cat")], 2)
    t = tmp_path / "nolabel.tar"
    with tarfile.open(t, "w") as tf:
        blob = jpeg(photo(10, 10, 0))
        info = tarfile.TarInfo("k1.jpg")
        info.size = len(blob)
        tf.addfile(info, io.BytesIO(blob))
    with pytest.raises(ValueError, match=r"k1.jpg has no label \(k1.cls\)"):
        ImageLoader(str(t), 2)
    items = [(str(t), 0)]
    for bad in (dict(dtype="int8"), dict(layout="CHW"), dict(on_error="ignore"), dict(decoder="cpu"),
                dict(size=0), dict(scale=(0.5, 0.1)), dict(keys=("a", "a")), dict(mean=(0.5,) * 3, std=None)):
        with pytest.raises((ValueError, TypeError)):
            ImageLoader(items, 2, **bad)


def test_mapped_sources_are_one_region_and_check_truncation(data, tmp_path):
    import shutil
    tar = ImageLoader(data["tars"], 4, device="cpu")
    src = tar.source
    base, offs, lens, fails = src.read(np.array([0, 7, 17]))  # three shards, no copy
    assert base is src.region and not fails
    for k, i in enumerate([0, 7, 17]):
        with open(data["items"][i][0], "rb") as f:
            assert base[offs[k]:offs[k] + lens[k]].tobytes() == f.read()
    tar.close()
    packed = str(tmp_path / "packed")
    shutil.copytree(data["packed"], packed)
    loader = ImageLoader(packed, 4, size=8, device="cpu")
    host(loader)  # a whole epoch: nothing is being read when the file is cut
    with open(os.path.join(packed, "data.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="data.bin was truncated on disk while loading"):
        host(loader)
    loader.close()


def test_gpu_decoder_refused_without_a_gpu(data):
    if pinloader.cuda_available():
        pytest.skip("a CUDA device is present: the GPU decoder may be had")
    loader = ImageLoader(data["packed"], 4, decoder="gpu")
    with pytest.raises(RuntimeError, match="decoder='gpu'"):
        iter(loader)
    loader.close()
    loader = ImageLoader(data["packed"], 4, size=8)
    next(iter(loader))
    assert loader.stats()["decoder"] == "host" and "no CUDA device" in loader.stats()["decoder_reason"]
    loader.close()


def test_close_mid_epoch_and_memory_flat(data):
    import threading
    for _ in range(3):
        loader = ImageLoader(data["folder"], 2, size=8, device="cpu", workers=3)
        it = iter(loader)
        next(it)
        loader.close()
        assert loader.closed
        with pytest.raises(ValueError, match="closed"):
            next(loader)
    # the loader's decoder threads are gone (threading.active_count() would also count the
    # entries Python 3.11 keeps for every native producer thread that ran Python code, one per
    # thread id, never removed)
    assert [t.name for t in threading.enumerate() if t.name.startswith("pl-image")] == []
    loader = ImageLoader(data["packed"], 6, size=8, device="cpu")
    peaks = []
    for e in range(6):
        host(loader)
        peaks.append(loader.stats()["pinned_bytes_peak"])
    # at most the prefetcher's depth (3) and the batch handed out, each about 5 KiB here: the
    # same bound in the last epoch as in the first, nothing accumulates
    assert max(peaks) <= 4 * 5120
    loader.close()


class FakeGpuDecoder:
    """JpegDecoder.decode's contract (src/py/jpeg_decoder.c) computed with Pillow: per-sample
    statuses (1 no JPEG header, 2 bad data, 3 not 1 or 3 components, 4 box outside), raw=
    images resampled, failed samples zero. Lets the host backend run the loader's GPU path."""

    def __init__(self):
        self.calls = []

    def decode(self, base, offsets, lengths, params, size, scale, bias, dtype, channels_last, raw=None):
        from pinloader import _image_ops as ops
        n = len(offsets)
        # what the real decode() checks (src/py/jpeg_decoder.c)
        assert 1 <= n <= 65535
        assert np.asarray(offsets).dtype == np.asarray(lengths).dtype == np.int64
        assert params.dtype == np.int32 and params.shape == (n, 9) and params.flags.c_contiguous
        assert set(np.unique(params[:, 8])) <= {0, 1}
        memoryview(base)  # a buffer
        for k, v in (raw or {}).items():
            assert type(k) is int and 0 <= k < n
            assert v.dtype == np.uint8 and v.ndim == 3 and v.shape[2] == 3 and v.flags.c_contiguous
        self.calls.append((n, sorted(raw or {})))
        u8 = np.zeros((n, size[0], size[1], 3), np.uint8)
        status = np.zeros(n, np.int32)
        for i in range(n):
            try:
                if raw and i in raw:
                    img = raw[i]
                else:
                    data = bytes(base[offsets[i]:offsets[i] + lengths[i]])
                    info = ops.jpeg_info(data)
                    if info is None:
                        status[i] = 1
                        continue
                    if info[2] not in (1, 3):
                        status[i] = 3
                        continue
                    img = ops.decode_rgb(data)
                top, left, h, w = (int(x) for x in params[i][:4])
                if top + h > img.shape[0] or left + w > img.shape[1]:
                    status[i] = 4
                    continue
                u8[i] = ops.resample(img, params[i], size)
            except ValueError:
                status[i] = 2
        out = u8.astype(np.float32) * np.float32(scale) + np.float32(bias) if dtype != "uint8" else u8
        if dtype == "float16":
            out = out.astype(np.float16)
        if not channels_last:
            out = np.ascontiguousarray(out.transpose(0, 3, 1, 2))
        return out, status

    def info(self):
        return {"calls": len(self.calls)}

    def close(self):
        pass


def fake_gpu(loader):
    fake = FakeGpuDecoder()
    loader._runner.decoder = fake
    loader._decoder_kind = "gpu"
    loader._decoder_key = (str(loader._device), False)  # the settings it serves
    return fake


@pytest.mark.parametrize("source", ["packed", "folder", "tars"])
def test_gpu_path_logic_on_the_host(data, source):
    """The GPU path's batching, headers, parameters and labels, with Pillow standing in for
    nvJPEG: the same batches as the host path, exactly."""
    for train in (True, False):
        kw = dict(size=(16, 20), seed=6, train=train, device="cpu")
        g = ImageLoader(data[source], 4, **kw)
        fake = fake_gpu(g)
        got = host(g)
        st = g.stats()
        assert st["decoder"] == "gpu" and len(fake.calls) == 5
        assert st["decode_call_s"] > 0 and st["producer_wait_s"] >= 0
        same(got, run(data[source], batch_size=4, **kw))
        g.close()


def test_gpu_path_sends_what_nvjpeg_refuses_to_the_host(tmp_path):
    a = photo(40, 50, 0)
    blobs = [jpeg(a), b"", jpeg(a)[:200], b"junk"]
    buf = io.BytesIO()
    Image.fromarray(a).convert("CMYK").save(buf, format="JPEG")
    blobs.append(buf.getvalue())
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    blobs.append(buf.getvalue())
    blobs.append(jpeg(a[..., 0]))
    items = []
    for k, blob in enumerate(blobs):
        p = tmp_path / f"s{k}.jpg"
        p.write_bytes(blob)
        items.append((str(p), k))
    items.append((str(tmp_path / "gone.jpg"), 7))
    kw = dict(size=8, shuffle=False, device="cpu", on_error="skip", dtype="uint8")
    g = ImageLoader(items, 8, **kw)
    fake = fake_gpu(g)
    got = host(g)
    want = run(items, batch_size=8, **kw)
    same(got, want)
    assert got[0]["label"].tolist() == [0, 4, 5, 6]
    s = g.stats()
    assert s["skipped"] == 4 and s["host_decoded"] == 2
    assert s["host_decoded_reasons"] == {"a JPEG of 4 components": 1, "not a JPEG": 1}
    # the first call had the samples that read as images (the CMYK and PNG ones as raw=), the
    # second only the kept samples
    assert fake.calls == [(5, [2, 3]), (4, [1, 2])]
    g.close()
    g = ImageLoader(items, 8, **dict(kw, on_error="raise"))
    fake_gpu(g)
    with pytest.raises(ImageDecodeError, match=r"sample 1 \(.*s1\.jpg\)"):
        host(g)
    g.close()


def test_gpu_path_retries_what_nvjpeg_fails_on(data, monkeypatch):
    """A sample nvJPEG fails on (status 2) but Pillow decodes goes through raw= on a retry."""
    g = ImageLoader(data["packed"], 6, size=8, seed=1, device="cpu")
    fake = fake_gpu(g)
    real = fake.decode

    def flaky(base, offsets, lengths, params, *a, **kw):
        out, status = real(base, offsets, lengths, params, *a, **kw)
        if not kw.get("raw") and not (len(a) > 5 and a[5]):
            status[0] = 2
        return out, status

    fake.decode = flaky
    got = host(g)
    same(got, run(data["packed"], batch_size=6, size=8, seed=1))
    assert g.stats()["host_decoded_reasons"] == {"nvJPEG could not decode it": 3}
    g.close()


def test_static_batches_through_the_torch_door(data):
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt
    loader = ImageLoader(data["packed"], 5, size=8, seed=2, device="cpu")
    want = run(data["packed"], batch_size=5, size=8, seed=2)
    door = pt.prefetch(loader, static=True)
    ptrs, rows = set(), []
    for b, ref in zip(door, want):
        ptrs.add(b["image"].data_ptr())
        n = door.valid_rows
        rows.append(n)
        np.testing.assert_array_equal(b["image"][:n].numpy(), ref["image"])
    assert len(ptrs) == 1 and rows == [5, 5, 5, 3]
    assert loader.stats()["decoder"] == "host"
    loader.close()


def test_doors_made_per_epoch_and_switched(data):
    """Note [doors over a loader] holds for ImageLoader too: a door made once per epoch, doors
    with other options taking turns with plain iterations, each epoch the batches of its own
    epoch number; a door over a closed loader says closed."""
    pytest.importorskip("torch")
    import pinloader.torch as pt
    kw = dict(size=8, seed=3, device="cpu")
    loader = ImageLoader(data["packed"], 5, **kw)

    def labels(batches):
        return [np.asarray(b["label"]).tolist() for b in batches]

    want = {}
    for ep in range(4):
        ref = ImageLoader(data["packed"], 5, **kw)
        ref.set_epoch(ep)
        want[ep] = labels(host(ref))
        ref.close()
    assert want[0] != want[1]
    for ep in range(3):  # a door per epoch
        loader.set_epoch(ep)
        assert labels(pt.prefetch(loader)) == want[ep]
    loader.set_epoch(3)
    got = []
    for b in pt.prefetch(loader, static=True):  # another door's options for this epoch only
        got.append(b["label"][: loader.valid_rows].tolist())
    assert got == want[3]
    loader.set_epoch(1)
    assert labels(host(loader)) == want[1]  # a plain iteration: the loader's own settings
    loader.close()
    with pytest.raises(ValueError, match="closed"):
        pt.prefetch(loader)


def test_fork_child_gets_a_clear_error_then_works(data):
    """A loader made before fork(): in the child, its running prefetcher refuses with a clear
    error; the next iteration starts a new one (and new decoder threads) that works."""
    from helpers import describe, run_py
    code = f"""
import os, numpy as np, pinloader
L = pinloader.ImageLoader({data["packed"]!r}, 4, size=8, device="cpu", seed=1)
it = iter(L)
next(it)
want = [np.from_dlpack(b["label"]).tolist() for b in pinloader.ImageLoader({data["packed"]!r}, 4, size=8,
        device="cpu", seed=1)]
import time
deadline = time.monotonic() + 30
while L.stats()["queued"] < 3 and time.monotonic() < deadline:
    time.sleep(0.01)  # fork once the producer is idle (its queue full): no thread mid-allocation
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = []
    try:
        next(it)
        out.append("no error")
    except RuntimeError as e:
        out.append("fork" if "fork" in str(e) else str(e))
    L.set_epoch(0)
    got = [np.from_dlpack(b["label"]).tolist() for b in L]
    out.append("same" if got == want else repr((got, want)))
    os.write(w, ";".join(out).encode())
    os._exit(0)
os.close(w)
msg = os.read(r, 4096).decode()
os.waitpid(pid, 0)
print(msg)
left = 0
while True:  # the parent's epoch goes on: its other four batches
    try:
        next(it)
    except StopIteration:
        break
    left += 1
print("parent", left)
"""
    p = run_py(code, timeout=120)
    assert p.returncode == 0, describe(p)
    assert p.stdout.split() == ["fork;same", "parent", "4"], describe(p)


def test_epochs_out_of_range_are_refused(data):
    loader = ImageLoader(data["packed"], 5, size=8, device="cpu")
    for bad in (-1, 2**63):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            loader.set_epoch(bad)
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            loader.indices(bad)
    with pytest.raises(TypeError, match="epoch must be an int"):
        loader.set_epoch(1.0)
    loader.close()


def test_the_decode_error_is_named_by_its_public_module_and_pickles():
    import pickle
    err = pinloader.ImageDecodeError("ImageLoader: sample 3 (a.jpg): not an image")
    assert type(err).__module__ == "pinloader.image_loader"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is pinloader.ImageDecodeError and back.args == err.args


def test_rank_world_from_the_environment_and_errors_name_image_loader(data, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with ImageLoader(data["packed"], 3, device="cpu") as L:
        assert (L.rank, L.world_size) == (1, 2)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match=r"^ImageLoader: RANK / WORLD_SIZE environment variables are not integers"):
        ImageLoader(data["packed"], 3, device="cpu")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"^ImageLoader: rank must be < world_size, got rank=2, world_size=2"):
        ImageLoader(data["packed"], 3, device="cpu")
    with pytest.raises(TypeError, match=r"ImageLoader\(\) got an unexpected keyword argument 'max_pined_bytes' "
                                        r"\(did you mean 'max_pinned_bytes'\?\)"):
        ImageLoader(data["packed"], 3, device="cpu", rank=0, world_size=1, max_pined_bytes=1)
