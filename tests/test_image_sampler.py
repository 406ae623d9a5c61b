"""The ImageLoader's crop sampler (pinloader/_image_ops.py, Note [image parameters]): the
counter-based draws, torchvision's RandomResizedCrop.get_params algorithm, its fallback, and
the evaluation resize and center crop."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pinloader import _image_ops as ops


def tv_get_params(height, width, scale, ratio, u):
    """torchvision.transforms.RandomResizedCrop.get_params, line for line, with its torch draws
    replaced by the uniforms u (four per try: area, log-ratio, top, left)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for t in range(10):
        target_area = area * (scale[0] + u[4 * t] * (scale[1] - scale[0]))
        aspect_ratio = math.exp(log_ratio[0] + u[4 * t + 1] * (log_ratio[1] - log_ratio[0]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(math.floor(u[4 * t + 2] * (height - h + 1)))
            j = int(math.floor(u[4 * t + 3] * (width - w + 1)))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    w, h = max(1, w), max(1, h)  # pinloader's one change: never an empty box
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def test_draws_are_a_function_of_seed_epoch_and_index():
    idx = np.arange(1000, dtype=np.int64)
    a = ops.draws(7, 3, idx)
    assert a.shape == (1000, ops.DRAWS)
    assert (a >= 0).all() and (a < 1).all()
    # the same key gives the same draws, alone or in any batch, in any order
    assert np.array_equal(ops.draws(7, 3, idx[::-1])[::-1], a)
    assert np.array_equal(ops.draws(7, 3, np.array([517]))[0], a[517])
    for other in (ops.draws(8, 3, idx), ops.draws(7, 4, idx), ops.draws(7, 3, idx + 1)):
        assert not np.isclose(other, a).all(axis=1).any()
    # roughly uniform, and independent across draws
    assert abs(a.mean() - 0.5) < 0.01
    assert abs(np.corrcoef(a[:, 0], a[:, 1])[0, 1]) < 0.1
    # seeds are taken modulo 2**64, like ArrayLoader's
    assert np.array_equal(ops.draws(-1, 0, idx[:5]), ops.draws(2**64 - 1, 0, idx[:5]))


@pytest.mark.parametrize("scale,ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 0.9), (0.2, 5.0)),
                                         ((0.9, 1.0), (2.0, 3.0)), ((1.0, 1.0), (1.0, 1.0))])
def test_crop_boxes_are_torchvisions_algorithm(scale, ratio):
    rng = np.random.default_rng(0)
    hw = rng.integers(1, 700, size=(400, 2))
    hw[:5] = [[1, 1], [1, 600], [600, 1], [2, 3], [500, 500]]
    u = ops.draws(1, 0, np.arange(len(hw)))
    got = ops.crop_boxes(hw, u, scale, ratio)
    for r in range(len(hw)):
        H, W = (int(x) for x in hw[r])
        want = tv_get_params(H, W, scale, ratio, u[r])
        assert tuple(got[r]) == want, (H, W, scale, ratio)
        top, left, h, w = want
        assert 0 <= top and top + h <= H and 0 <= left and left + w <= W and h > 0 and w > 0


def test_fallback_is_the_central_box():
    # a square image, crops that must be at least 2x wider than tall and cover it all: no try fits
    u = ops.draws(0, 0, np.arange(4))
    got = ops.crop_boxes(np.array([[100, 100]] * 4), u, (1.0, 1.0), (2.0, 3.0))
    assert (got == [25, 0, 50, 100]).all()
    got = ops.crop_boxes(np.array([[100, 400]]), u[:1], (1.0, 1.0), (0.25, 0.5))
    assert got.tolist() == [[0, 175, 100, 50]]
    got = ops.crop_boxes(np.array([[100, 150]]), u[:1], (2.0, 2.0), (1.0, 2.0))  # too large an area
    assert got.tolist() == [[0, 0, 100, 150]]


def test_crops_follow_the_distribution():
    n = 20000
    hw = np.array([[500, 500]] * n)
    u = ops.draws(5, 1, np.arange(n))
    box = ops.crop_boxes(hw, u, (0.08, 1.0), (3 / 4, 4 / 3))
    frac = box[:, 2] * box[:, 3] / (500 * 500)
    aspect = box[:, 3] / box[:, 2]
    assert frac.min() > 0.07 and frac.max() <= 1.0
    assert aspect.min() > 0.7 and aspect.max() < 1.4
    # log-uniform aspect ratios: the median near 1; areas of the accepted tries skew small
    assert abs(np.median(np.log(aspect))) < 0.02
    assert 0.4 < np.median(frac) < 0.6
    # corners uniform over the room left
    rel = box[:, 0] / np.maximum(500 - box[:, 2], 1)
    assert abs(np.median(rel) - 0.5) < 0.03
    p = ops.train_params(hw, u, (224, 224), (0.08, 1.0), (3 / 4, 4 / 3), True)
    assert abs(p[:, 8].mean() - 0.5) < 0.02
    assert (p[:, 4:6] == 224).all() and (p[:, 6:8] == 0).all()
    assert not ops.train_params(hw[:10], u[:10], (224, 224), (0.08, 1.0), (3 / 4, 4 / 3), False)[:, 8].any()


def test_eval_params_are_resize_then_center_crop():
    def tv(h, w, resize, size):
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = resize, int(resize * long / short)
        rw, rh = (new_short, new_long) if w <= h else (new_long, new_short)
        return rh, rw, int(round((rh - size[0]) / 2.0)), int(round((rw - size[1]) / 2.0))

    hw = np.array([[375, 500], [500, 333], [256, 256], [300, 301], [1, 1000], [4000, 3000]])
    for size, resize in [((224, 224), 256), ((32, 48), 60)]:
        p = ops.eval_params(hw, size, resize)
        for r, (h, w) in enumerate(hw):
            rh, rw, oy, ox = tv(int(h), int(w), resize, size)
            rh, rw = max(rh, size[0]), max(rw, size[1])
            oy, ox = int(round((rh - size[0]) / 2.0)), int(round((rw - size[1]) / 2.0))
            assert p[r].tolist() == [0, 0, h, w, rh, rw, oy, ox, 0]


def test_jpeg_header_reader():
    from image_helpers import jpeg, photo
    from PIL import Image
    import io
    a = photo(37, 53, 0)
    assert ops.jpeg_info(jpeg(a)) == (37, 53, 3)
    assert ops.jpeg_info(jpeg(a, progressive=True)) == (37, 53, 3)
    assert ops.jpeg_info(jpeg(a[..., 0])) == (37, 53, 1)
    buf = io.BytesIO()
    Image.fromarray(a).convert("CMYK").save(buf, format="JPEG")
    assert ops.jpeg_info(buf.getvalue()) == (37, 53, 4)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    assert ops.jpeg_info(buf.getvalue()) is None
    assert ops.image_info(buf.getvalue()) == (37, 53, 0)
    good = jpeg(a)
    for bad in (b"", b"\xff\xd8", good[:20], b"\xff\xd8\xff\xd9", b"not an image"):
        assert ops.jpeg_info(bad) is None
    with pytest.raises(ValueError, match="not an image"):
        ops.image_info(b"not an image")


def test_native_header_reader_agrees_with_python():
    from image_helpers import jpeg, photo
    from pinloader import _C
    rng = np.random.default_rng(0)
    good = [jpeg(photo(int(h), int(w), i)) for i, (h, w) in enumerate(rng.integers(1, 80, (6, 2)))]
    blobs = list(good) + [b"", b"\xff", b"\xff\xd8", b"\xff\xd8\xff\xd9", b"\xff\xd8\xff\xc0\x00\x02"]
    for _ in range(300):  # cut and corrupted headers
        b = bytearray(good[int(rng.integers(len(good)))][:int(rng.integers(0, 700))])
        for _ in range(int(rng.integers(0, 4))):
            if b:
                b[int(rng.integers(len(b)))] = int(rng.integers(256))
        blobs.append(bytes(b))
    lengths = np.array([len(b) for b in blobs], np.int64)
    offsets = np.zeros(len(blobs), np.int64)
    offsets[1:] = np.cumsum(lengths)[:-1]
    base = np.frombuffer(b"".join(blobs) + b"\0", np.uint8)
    got = _C.jpeg_info(base, offsets, lengths)
    for k, b in enumerate(blobs):
        want = ops.jpeg_info(b)
        assert tuple(got[k]) == (want if want is not None else (-1, -1, -1)), k
    with pytest.raises(ValueError, match="outside"):
        _C.jpeg_info(base, offsets + 10**6, lengths)
    with pytest.raises(ValueError, match="outside"):
        _C.jpeg_info(base, offsets, lengths - 10**6)
    with pytest.raises(ValueError, match="differ"):
        _C.jpeg_info(base, offsets, lengths[:-1])


def test_native_file_reader(tmp_path):
    import os
    from pinloader import _C
    paths = []
    for k, size in enumerate([0, 1, 5000, 123]):
        p = tmp_path / f"f{k}"
        p.write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
        paths.append(str(p))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    paths += [str(tmp_path / "missing"), str(tmp_path), str(fifo)]
    for threads in (1, 3, 64):
        data, off, ln, err = _C.read_files(paths, threads)
        for k in range(4):
            with open(paths[k], "rb") as f:
                assert data[off[k]:off[k] + ln[k]].tobytes() == f.read()
            assert err[k] == 0
        assert err[4] == 2 and err[5] == -1 and err[6] == -1 and (ln[4:] == 0).all()
    data, off, ln, err = _C.read_files([], 4)
    assert len(off) == 0 and data.size == 1
    with pytest.raises(ValueError, match="threads"):
        _C.read_files(paths, 0)
    with pytest.raises(ValueError):
        _C.read_files(["a\0b"], 1)


def test_native_file_mapping(tmp_path):
    from pinloader import _C
    blobs = [b"a" * 10, b"", bytes(range(256)) * 40, b"z"]
    paths = []
    for k, b in enumerate(blobs):
        p = tmp_path / f"f{k}"
        p.write_bytes(b)
        paths.append(str(p))
    region, starts = _C.map_files(paths)
    assert not region.flags.writeable and region.dtype == np.uint8
    for b, s in zip(blobs, starts):
        assert region[s:s + len(b)].tobytes() == b
    assert (np.diff(starts) >= 0).all() and (starts % 4096 == 0).all()
    # bytes past a file's end, in its last page, are zeros (not the next file's)
    assert not region[starts[0] + 10:starts[0] + 100].any()
    region2, starts2 = _C.map_files([])
    assert region2.shape == (0,) and starts2.shape == (0,)
    with pytest.raises(FileNotFoundError):
        _C.map_files([str(tmp_path / "missing")])
    with pytest.raises(OSError, match="not a regular file"):
        _C.map_files([str(tmp_path)])
    del region  # unmapped with its last view


def _tar_bytes(fmt, members):
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            elif kind == "link":
                info.type = tarfile.SYMTYPE
                info.linkname = "x" * 50
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _scan(blob):
    from pinloader import _C
    names, cols = _C.tar_scan(np.frombuffer(blob, np.uint8))
    out, start = [], 0
    for end, off, size in cols.tolist():
        out.append((names[start:end].decode("utf-8", "surrogateescape"), off, size))
        start = end
    return out


@pytest.mark.parametrize("fmt", ["USTAR_FORMAT", "GNU_FORMAT", "PAX_FORMAT"])
def test_tar_scan_agrees_with_tarfile(fmt):
    import io
    import tarfile
    long_dir = "d" * 120 + "/sub"
    members = [("a.jpg", b"x" * 700, "file"), ("a.cls", b"3", "file"), ("empty.txt", b"", "file"),
               ("dir", b"", "dir"), (f"{long_dir}/k.jpg", b"y" * 513, "file"),
               ("lnk", b"", "link"), ("b" * 95 + ".cls", b"12", "file")]
    if fmt != "USTAR_FORMAT":
        members += [("z" * 180 + ".jpg", b"z" * 1024, "file")]
    if fmt == "PAX_FORMAT":
        members += [("caf\u00e9/\u00e9t\u00e9.jpg", b"w" * 10, "file")]
    blob = _tar_bytes(getattr(tarfile, fmt), members)
    with tarfile.open(fileobj=io.BytesIO(blob)) as t:
        want = [(m.name, m.offset_data, m.size) for m in t if m.isfile()]
    assert _scan(blob) == want
    assert len(want) == len([m for m in members if m[2] == "file"])


def test_tar_scan_refuses_malformed_archives_without_crashing():
    import tarfile
    from pinloader import _C
    blob = _tar_bytes(tarfile.PAX_FORMAT, [("a" * 150 + ".jpg", b"q" * 3000, "file"), ("a.cls", b"1", "file")])
    assert _scan(b"") == [] and _scan(bytes(1024)) == []
    with pytest.raises(ValueError, match="checksum"):
        _scan(b"not a tar" * 100)
    with pytest.raises(ValueError, match="past the end"):
        _scan(blob[:2000])
    for cut in (1500, 1024, 100):
        with pytest.raises(ValueError, match="truncated tar"):
            _scan(blob[:cut])
    rng = np.random.default_rng(0)
    for _ in range(400):  # corrupted and cut archives: an error or members inside the bytes
        b = bytearray(blob[:int(rng.integers(0, len(blob) + 1))])
        for _ in range(int(rng.integers(0, 6))):
            if b:
                b[int(rng.integers(len(b)))] = int(rng.integers(256))
        try:
            got = _scan(bytes(b))
        except ValueError:
            continue
        for _, off, size in got:
            assert 0 <= off and off + size <= len(b)
    with pytest.raises(TypeError):
        _C.tar_scan(42)
