"""Hostile image datasets, one case each (tests/test_fuzz_images.py found them): tar shards that
``_C.tar_scan`` must read as ``tarfile`` does or refuse, packed datasets with hand-edited .npy
files, and resumed packs over an edited or damaged ``progress.txt``."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import numpy as np
import pytest

from pinloader import _C
from pinloader._image_pack import pack
from pinloader._image_sources import ImageSourceError, make_source

pytestmark = pytest.mark.hostile


# ---- tar shards ----------------------------------------------------------------------------------

def header(name: str, size: int = 0, type: bytes = tarfile.REGTYPE) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.type = type
    return ti.tobuf(tarfile.GNU_FORMAT)[-512:]  # the member's own header (no long-name blocks)


def data(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 512)


def scan(shard: bytes) -> list[tuple[str, int, int]]:
    names, cols = _C.tar_scan(np.frombuffer(shard, np.uint8))
    out, e0 = [], 0
    for end, off, size in cols.tolist():
        out.append((names[e0:end].decode(), off, size))
        e0 = end
    return out


def tarfile_reads(shard: bytes) -> list[tuple[str, int, int]]:
    with tarfile.open(fileobj=io.BytesIO(shard)) as t:
        return [(m.name, m.offset_data, m.size) for m in t.getmembers() if m.isreg()]


def pax(records: dict[str, str]) -> bytes:
    body = b""
    for k, v in records.items():
        rec = f" {k}={v}\n".encode()
        n = len(rec) + 1
        n = len(rec) + len(str(n + len(str(n)) - 1))
        body += str(n).encode() + rec
    return body


END = b"\0" * 1024


def test_a_pax_size_is_the_next_members_not_that_of_a_long_name_between():
    # 'x' (size=5) then 'L' then the member: the long name keeps its own size
    rec = pax({"size": "5"})
    long = b"n" * 120 + b"\0"
    shard = (header("././@PaxHeader", len(rec), tarfile.XHDTYPE) + data(rec)
             + header("././@LongLink", len(long), tarfile.GNUTYPE_LONGNAME) + data(long)
             + header("short.jpg", 0) + data(b"abcde") + END)
    assert scan(shard) == tarfile_reads(shard) == [("n" * 120, 2560, 5)]


def test_a_directory_has_no_data_blocks_whatever_its_size_field_says():
    for d in (header("adir", 512, tarfile.DIRTYPE), header("old/", 512, tarfile.AREGTYPE),
              header("alink", 512, tarfile.SYMTYPE)):
        shard = d + header("a.jpg", 3) + data(b"xyz") + END
        assert scan(shard) == tarfile_reads(shard) == [("a.jpg", 1024, 3)]


def test_the_first_of_two_long_names_names_the_member_as_in_tarfile():
    one, two = b"first" * 30 + b"\0", b"second" * 30 + b"\0"
    shard = (header("././@LongLink", len(one), tarfile.GNUTYPE_LONGNAME) + data(one)
             + header("././@LongLink", len(two), tarfile.GNUTYPE_LONGNAME) + data(two)
             + header("x.jpg", 1) + data(b"z") + END)
    assert scan(shard) == tarfile_reads(shard) == [("first" * 30, 2560, 1)]


def test_a_long_name_ends_at_its_first_nul_and_must_have_one():
    name = b"abc\0def\0"
    shard = header("././@LongLink", len(name), tarfile.GNUTYPE_LONGNAME) + data(name) + header("x.jpg") + END
    assert scan(shard) == tarfile_reads(shard) == [("abc", 1536, 0)]
    name = b"n" * 100  # no NUL within its size
    shard = header("././@LongLink", len(name), tarfile.GNUTYPE_LONGNAME) + data(name) + header("x.jpg") + END
    with pytest.raises(ValueError, match="at byte 0: a GNU long name is not NUL-terminated"):
        _C.tar_scan(np.frombuffer(shard, np.uint8))


# ---- packed datasets -----------------------------------------------------------------------------

def packed(root, offsets=(0, 3, 5), labels=(0, 1), sizes=None, meta=None):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "data.bin"), "wb") as f:
        f.write(b"abcde")
    np.save(os.path.join(root, "offsets.npy"), np.asarray(offsets))
    np.save(os.path.join(root, "labels.npy"), np.asarray(labels))
    if sizes is not None:
        np.save(os.path.join(root, "sizes.npy"), np.asarray(sizes))
    with open(os.path.join(root, "meta.json"), "w") as f:
        json.dump(meta or {"format": "pinloader.packed", "version": 1, "count": 2}, f)
    return str(root)


@pytest.mark.parametrize("kw, match", [
    ({"offsets": np.array([0, 1.5, 5])}, "offsets.npy must be a 1-d array of integers, got float64"),
    ({"offsets": np.array([0, 3, -2**63])}, "offsets.npy does not describe data.bin"),
    ({"offsets": np.array([0, 2**63 + 3, 5], np.uint64)}, "offsets.npy holds 9223372036854775811, past int64"),
    ({"labels": np.array([[0, 1]] * 2)}, "labels.npy must be a 1-d array of integers"),
    ({"labels": np.array([0, 2**64 - 1], np.uint64)}, "labels.npy holds 18446744073709551615, past int64"),
    ({"labels": np.array([0.0, 1.0])}, "labels.npy must be a 1-d array of integers, got float64"),
    ({"sizes": np.array([[4, 0, 3], [4, 4, 3]])}, r"sizes.npy row 0 is \(4, 0, 3\)"),
    ({"sizes": np.array([[4, 4, 3]])}, r"sizes.npy must be an \(2, 3\) array of integers"),
    ({"sizes": np.array([[4.0, 4, 3], [4, 4, 3]])}, "sizes.npy must be an"),
    ({"meta": {"format": "pinloader.packed", "classes": 7}}, "classes must be a list of names"),
    ({"meta": {"format": "pinloader.packed", "count": 3}}, "meta.json counts 3 samples, labels.npy has 2"),
])
def test_hand_edited_packed_files_are_refused_by_name(tmp_path, kw, match):
    root = packed(tmp_path / "p", **kw)
    with pytest.raises(ImageSourceError, match=match):
        make_source(root)


def test_a_packed_npy_that_numpy_cannot_load_is_named(tmp_path):
    root = packed(tmp_path / "p")
    with open(os.path.join(root, "labels.npy"), "wb") as f:
        f.write(b"\x93NUMPY garbage")
    with pytest.raises(ImageSourceError, match="labels.npy cannot be read"):
        make_source(root)


def test_packed_sizes_of_minus_ones_or_real_sizes_are_taken(tmp_path):
    src = make_source(packed(tmp_path / "p", sizes=np.array([[-1, -1, -1], [7, 9, 0]], np.int64)))
    try:
        assert src.hw.dtype == np.int32 and src.hw.tolist() == [[-1, -1, -1], [7, 9, 0]]
        base, offs, lens, _ = src.read(np.arange(2))
        assert [bytes(base[o:o + n]) for o, n in zip(offs.tolist(), lens.tolist())] == [b"abc", b"de"]
    finally:
        src.close()


# ---- resumed packs -------------------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "src"
    blobs = [b"\xff\xd8 one", b"\xff\xd8 two two", b"\xff\xd8 3"]
    for k, b in enumerate(blobs):
        os.makedirs(root / f"c{k % 2}", exist_ok=True)
        (root / f"c{k % 2}" / f"{k}.jpg").write_bytes(b)
    return str(root)


def stopped_pack(folder, dest, progress: str | bytes):
    """A folder as a pack stopped after its first chunk leaves it, with ``progress`` instead
    of its progress.txt."""
    ref = dest + ".ref"
    pack(folder, ref, workers=1, quiet=True)
    os.makedirs(dest)
    src = make_source(ref)
    with open(os.path.join(dest, "data.bin"), "wb") as f:
        f.write(bytes(src.region[:int(src.offsets[-1] + src.lengths[-1])]))
    src.close()
    names = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    with open(os.path.join(dest, "source.json"), "w") as f:
        json.dump({"count": 3, "names_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest()}, f)
    with open(os.path.join(dest, "progress.txt"), "wb") as f:
        f.write(progress.encode() if isinstance(progress, str) else progress)


@pytest.mark.parametrize("progress, match", [
    (b"0 6 0 -1 -1 -1\n\xc3\xa9\n", "progress.txt is not a progress file"),
    ("0 6 0 -1 -1 -1\n7 4 0 -1 -1 -1\n", "progress.txt line 2 is not a progress line"),
    ("0 6 0 -1 -1 -1\nx 4 0 -1 -1 -1\n", "progress.txt line 2 is not a progress line"),
    ("0 6 0 9223372036854775808 4 3\n", "progress.txt line 1 is not a progress line"),
    ("0 6 0 5 0 3\n", "progress.txt line 1 is not a progress line"),
    ("0 0 0 -1 -1 -1\n", r"progress.txt line 1 gives sample 0 \(c0/0.jpg\) 0 bytes, the source 6"),
])
def test_a_resume_over_an_edited_progress_file_is_refused(folder, tmp_path, progress, match):
    dest = str(tmp_path / "dest")
    stopped_pack(folder, dest, progress)
    with pytest.raises(ValueError, match=match):
        pack(folder, dest, workers=1, quiet=True)


def test_a_damaged_source_json_is_named(folder, tmp_path):
    dest = str(tmp_path / "dest")
    stopped_pack(folder, dest, "")
    with open(os.path.join(dest, "source.json"), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match="source.json is damaged"):
        pack(folder, dest, workers=1, quiet=True)


def test_a_cut_progress_line_is_dropped_before_the_next_lines_are_appended(folder, tmp_path, monkeypatch):
    # a pack stopped inside a progress line, resumed, stopped again, resumed: the lines appended
    # after the cut one must not join it
    dest = str(tmp_path / "dest")
    stopped_pack(folder, dest, "0 6 0 -1 -1 -1\n6 1")
    import pinloader._image_pack as ip
    monkeypatch.setattr(ip, "CHUNK", 1)
    real = ip._read
    calls = []

    def dies(src, i):
        calls.append(i)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(src, i)

    monkeypatch.setattr(ip, "_read", dies)
    with pytest.raises(KeyboardInterrupt):
        pack(folder, dest, workers=1, quiet=True)
    with open(os.path.join(dest, "progress.txt")) as f:
        assert f.read().split("\n")[:2] == ["0 6 0 -1 -1 -1", "6 4 0 -1 -1 -1"]
    monkeypatch.setattr(ip, "_read", real)
    assert pack(folder, dest, workers=1, quiet=True) == 3
    src = make_source(dest)
    try:
        base, offs, lens, _ = src.read(np.arange(3))
        got = [bytes(base[o:o + n]) for o, n in zip(offs.tolist(), lens.tolist())]
        assert got == [b"\xff\xd8 one", b"\xff\xd8 3", b"\xff\xd8 two two"]
    finally:
        src.close()


# ---- labels, headers and arguments ---------------------------------------------------------------

def test_a_label_past_int64_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"source\[1\]: the label 9223372036854775808 does not fit in int64"):
        make_source([("a.jpg", 0), ("b.jpg", 2**63)])
    shard = str(tmp_path / "s.tar")
    with tarfile.open(shard, "w") as t:
        for name, blob in (("k.jpg", b"\xff\xd8"), ("k.cls", b"99999999999999999999")):
            ti = tarfile.TarInfo(name)
            ti.size = len(blob)
            t.addfile(ti, io.BytesIO(blob))
    with pytest.raises(ImageSourceError, match=r"k.cls holds b'99999999999999999999', which does not fit in int64"):
        make_source(shard)


def png_header(w: int, h: int) -> bytes:
    import struct
    import zlib

    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def test_an_image_too_large_for_pillow_is_a_value_error():
    from pinloader import _image_ops as ops
    with pytest.raises(ValueError, match="not an image Pillow recognizes.*exceeds limit"):
        ops.image_info(png_header(100000, 100000))


@pytest.mark.parametrize("kw, err, match", [
    ({"resize": 2**31}, ValueError, "resize must be at most 16384"),
    ({"mean": (0.5, float("nan"), 0.5), "std": (1, 1, 1)}, ValueError, "three finite numbers"),
    ({"mean": (0.5, 0.5, 0.5), "std": (1, float("inf"), 1)}, ValueError, "three finite numbers"),
    ({"mean": (0.5, 0.5, 0.5), "std": (1, 0, 1)}, ValueError, "std positive"),
    ({"mean": 5, "std": (1, 1, 1)}, TypeError, "mean and std must be three numbers each"),
    ({"mean": ("a", 1, 1), "std": (1, 1, 1)}, TypeError, "mean and std must be three numbers each"),
    ({"mean": (1, 1), "std": (1, 1)}, ValueError, "three finite numbers"),
])
def test_image_loader_refuses_bad_resize_mean_and_std(kw, err, match):
    from pinloader import ImageLoader
    with pytest.raises(err, match=match):
        ImageLoader([("a.jpg", 0)], 1, device="cpu", **kw)


@pytest.mark.parametrize("bs", [65536, 2**40])
def test_a_batch_larger_than_one_gpu_decode_call_is_refused_on_every_backend(bs):
    from pinloader import ImageLoader
    with pytest.raises(ValueError, match=f"batch_size must be at most 65535, got {bs}"):
        ImageLoader([("a.jpg", 0)], bs, device="cpu")


class _ClearsTheList:
    """A path whose __fspath__ empties the list it is in (user code run while paths encode)."""

    def __init__(self, paths: list, path: str) -> None:
        self.paths, self.path = paths, path

    def __fspath__(self) -> str:
        self.paths.clear()
        return self.path


def test_reading_paths_whose_fspath_changes_their_list(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"abc")
    for read in (lambda p: _C.read_files(p, 2), _C.map_files):
        paths: list = []
        paths.extend([_ClearsTheList(paths, str(f)), str(f), str(f)])
        got = read(paths)
        starts = got[1]
        assert len(starts) == 3 and bytes(got[0][int(starts[2]):int(starts[2]) + 3]) == b"abc"


def test_a_long_thin_image_is_refused_before_its_resize_is_allocated():
    # 1 x 65500 pixels: Resize(256) would make it 256 x 16.8M (12.9 GB of RGB)
    from PIL import Image

    from pinloader import _image_ops as ops
    buf = io.BytesIO()
    Image.new("RGB", (65500, 1)).save(buf, format="JPEG")
    p = ops.eval_params(np.array([[1, 65500]]), (224, 224), 256)[0]
    with pytest.raises(ValueError, match="resizing the 1 x 65500 image to 256 x 16768000 is past Pillow's"):
        ops.host_decode(buf.getvalue(), p, (224, 224), (1, 65500))


def test_a_solaris_extended_header_names_its_member_as_a_pax_one():
    rec = pax({"path": "long/" + "s" * 120 + ".jpg"})
    shard = header("././@PaxHeader", len(rec), b"X") + data(rec) + header("short.jpg", 2) + data(b"ab") + END
    assert scan(shard) == tarfile_reads(shard) == [("long/" + "s" * 120 + ".jpg", 1536, 2)]


def test_a_shard_member_named_twice_is_refused(tmp_path):
    shard = str(tmp_path / "s.tar")
    with tarfile.open(shard, "w") as t:
        for name, blob in (("k.jpg", b"\xff\xd8"), ("k.cls", b"1"), ("k.jpg", b"\xff\xd8 other")):
            ti = tarfile.TarInfo(name)
            ti.size = len(blob)
            t.addfile(ti, io.BytesIO(blob))
    with pytest.raises(ImageSourceError, match="k.jpg appears twice in the shard"):
        make_source(shard)


def test_a_member_with_an_empty_name_first():
    # its name field starts with NUL: no name bytes to copy before any were stored
    shard = header("\0x.jpg", 1) + data(b"z") + header("y.jpg", 1) + data(b"w") + END
    assert scan(shard) == [("", 512, 1), ("y.jpg", 1536, 1)]


@pytest.mark.hostile
@pytest.mark.parametrize("data", [b"plain text, not an image", b"", b"GIF89a"])
def test_not_an_image_is_named_by_its_first_bytes_not_an_object_address(data):
    from pinloader import _image_ops
    with pytest.raises(ValueError, match="not an image Pillow recognizes") as ei:
        _image_ops.image_info(data)
    assert "object at 0x" not in str(ei.value) and "BytesIO" not in str(ei.value)
    assert (repr(data[:8]) if data else "empty") in str(ei.value)
