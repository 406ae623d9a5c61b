"""Fuzz target: the host-side image code that parses untrusted files never crashes, and never lies.

* ``_C.jpeg_info``: Pillow-made JPEGs (gray, RGB, CMYK, progressive) mutated (bytes flipped,
  inserted, cut; frame headers with huge or zero dimensions and 0 or 255 components;
  zero-length segments; segment lengths past the end). Each sample is the last bytes of an
  exactly-sized buffer (an over-read is an ASan error) and the first bytes of another followed
  by junk; both must give what pinloader/_image_ops.py's jpeg_info gives for the sample alone.
* ``_C.tar_scan``: ``tarfile``-made shards (ustar, GNU long names, pax) mutated (bytes flipped
  with the checksum fixed or not, sizes past the end, octal and base-256 sizes overflowing or
  negative, pax records with bad lengths, long names without terminators, cuts). A shard is
  read or refused with a ValueError naming the byte; what is read must lie inside the shard
  and be what ``tarfile`` reads. WebDataset shards (``key.jpg`` with ``key.cls`` holding random
  text) so mutated are refused by ``make_source`` naming the shard, or read with each image's
  bytes and label exactly.
* Packed datasets with hand-edited ``offsets.npy``/``labels.npy``/``sizes.npy``/``meta.json``
  (wrong dtypes, shapes, negative or overlapping offsets, lengths past the end): refused with an
  ImageSourceError naming the file, or read with every sample's bytes and label exactly those
  of the files.
* Resumed packs over a hand-edited ``progress.txt``: refused with a ValueError naming the file,
  or a packed dataset whose samples are exactly the source's.
* ``_C.read_files`` and ``_C.map_files`` over random lists of regular files (empty, one byte,
  page-sized and not), a folder, a FIFO, links, a missing path, ``/dev/null``, bytes and PathLike
  paths, a path with a NUL byte and a non-path: each file's bytes exactly, or its error.
* ImageLoader (host decoder, ``on_error="skip"``) over folders and packed datasets of mutated
  JPEGs: each sample decoded or skipped with its reason.

Every example runs in this process; CI runs this module under the ASan build (.ci/run). The
number of examples comes from ``PINLOADER_FUZZ_EXAMPLES`` (150 by default); the counts tried
are printed in the terminal summary (tests/conftest.py reads TRIED_IMAGES).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import shutil
import tarfile
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from pinloader import _C
from pinloader import _image_ops as ops
from pinloader._image_pack import pack
from pinloader._image_sources import ImageSourceError, make_source

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("PINLOADER_FUZZ_EXAMPLES", "150"))
LOG = os.environ.get("PINLOADER_FUZZ_LOG")  # where to write each example before it runs

# Read by tests/conftest.py for the terminal summary.
TRIED_IMAGES = {"jpeg": 0, "tar": 0, "tar_read": 0, "packed": 0, "packed_read": 0, "resume": 0,
                "resume_done": 0, "files": 0, "wds": 0, "wds_read": 0, "loader": 0}

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                    print_blob=True)
FILE_SETTINGS = settings(SETTINGS, max_examples=max(20, EXAMPLES // 4))


def log(what):
    if LOG:
        with open(LOG, "w") as f:
            f.write(repr(what) + "\n")


def exact(data: bytes) -> np.ndarray:
    """``data`` in a heap buffer of exactly its size (a read past its end is an ASan error)."""
    a = np.empty(max(len(data), 1), np.uint8)
    a[:len(data)] = np.frombuffer(data, np.uint8)
    return a[:len(data)] if data else a[:0]


# ---- JPEG headers --------------------------------------------------------------------------------

def _jpegs() -> list[bytes]:
    rng = np.random.default_rng(3)
    out = []
    for mode, kw in (("RGB", {}), ("L", {}), ("CMYK", {}), ("RGB", {"progressive": True}),
                     ("RGB", {"subsampling": 0, "quality": 50})):
        bands = len(mode)
        arr = rng.integers(0, 255, (int(rng.integers(1, 40)), int(rng.integers(1, 40)), bands), np.uint8)
        im = Image.fromarray(arr[..., 0] if bands == 1 else arr, mode)
        buf = io.BytesIO()
        im.save(buf, format="JPEG", **kw)
        out.append(buf.getvalue())
    return out


JPEGS = _jpegs()


def _sof_at(b: bytes) -> int:
    """The offset of the first frame header's marker (the Pillow JPEGs have one)."""
    i = 2
    while True:
        m = b[i + 1]
        if 0xC0 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC):
            return i
        i += 2 + ((b[i + 2] << 8) | b[i + 3])


@st.composite
def jpeg_samples(draw):
    b = bytearray(draw(st.sampled_from(JPEGS)))
    sof = _sof_at(bytes(b))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "cut", "dims", "comps", "zeroseg",
                                     "longseg", "fill", "restart", "soi_only"]))
        n = len(b)
        if n == 0:
            break
        if kind == "flip":
            at = draw(st.integers(0, min(n - 1, sof + 40)))
            b[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            at = draw(st.integers(0, min(n, sof + 40)))
            b[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif kind == "delete":
            at = draw(st.integers(0, min(n - 1, sof + 40)))
            del b[at:at + draw(st.integers(1, 8))]
        elif kind == "cut":
            del b[draw(st.integers(0, min(n, sof + 20))):]
        elif kind == "dims" and sof + 9 <= n:
            b[sof + 5:sof + 9] = draw(st.sampled_from([b"\x00\x00\x00\x00", b"\xff\xff\xff\xff",
                                                       b"\x00\x01\x00\x01", b"\x00\x00\x01\x00",
                                                       b"\x80\x00\x80\x00"]))
        elif kind == "comps" and sof + 10 <= n:
            b[sof + 9] = draw(st.sampled_from([0, 2, 4, 255]))
        elif kind == "zeroseg":
            at = draw(st.integers(2, max(2, min(n, sof))))
            b[at:at] = bytes([0xFF, draw(st.integers(0xE0, 0xEF)), 0, draw(st.sampled_from([0, 1, 2]))])
        elif kind == "longseg":
            at = draw(st.integers(2, max(2, min(n, sof))))
            b[at:at] = bytes([0xFF, 0xFE, 0xFF, 0xFF])
        elif kind == "fill":
            at = draw(st.integers(2, max(2, min(n, sof))))
            b[at:at] = b"\xff" * draw(st.integers(1, 6))
        elif kind == "restart":
            at = draw(st.integers(2, max(2, min(n, sof))))
            b[at:at] = bytes([0xFF, draw(st.sampled_from([0x01, 0xD0, 0xD7, 0xD9, 0xDA, 0xC4, 0xC8, 0xCC, 0x00]))])
        elif kind == "soi_only":
            b = bytearray(b"\xff\xd8" + draw(st.binary(max_size=16)))
            sof = 2
    return bytes(b)


def expected_info(sample: bytes):
    got = ops.jpeg_info(sample)
    return (-1, -1, -1) if got is None else got


@SETTINGS
@given(sample=jpeg_samples(), junk=st.binary(max_size=16))
def test_jpeg_info_of_mutated_headers_reads_only_the_sample(sample, junk):
    log(("jpeg", sample, junk))
    TRIED_IMAGES["jpeg"] += 1
    want = expected_info(sample)
    if want[0] != -1:
        assert want[0] >= 1 and want[1] >= 1 and 0 <= want[2] <= 255
    # the sample at the end of an exact buffer, then at the start of one followed by junk
    pad = b"\xff" * 5
    base = exact(pad + sample)
    got = _C.jpeg_info(base, np.array([len(pad)], np.int64), np.array([len(sample)], np.int64))
    assert got.dtype == np.int32 and got.shape == (1, 3)
    assert tuple(got[0].tolist()) == want
    base = exact(sample + junk)
    got = _C.jpeg_info(base, np.array([0, len(sample)], np.int64), np.array([len(sample), len(junk)], np.int64))
    assert tuple(got[0].tolist()) == want
    assert tuple(got[1].tolist()) == expected_info(junk)


def test_jpeg_info_of_pillow_jpegs_is_pillows():
    for b in JPEGS:
        with Image.open(io.BytesIO(b)) as im:
            want = (im.size[1], im.size[0], len(im.getbands()))
        assert tuple(_C.jpeg_info(exact(b), np.array([0]), np.array([len(b)]))[0].tolist()) == want


@SETTINGS
@given(n=st.integers(0, 40), offs=st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=3),
       lens=st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=3))
def test_jpeg_info_refuses_samples_outside_the_base(n, offs, lens):
    log(("jpeg_args", n, offs, lens))
    base = exact(JPEGS[0][:n])
    o, ln = np.array(offs, np.int64), np.array(lens, np.int64)
    inside = len(offs) == len(lens) and all(a >= 0 and b >= 0 and a + b <= n for a, b in zip(offs, lens))
    if inside:
        got = _C.jpeg_info(base, o, ln)
        assert got.shape == (len(offs), 3)
        for k, (a, b) in enumerate(zip(offs, lens)):
            assert tuple(got[k].tolist()) == expected_info(JPEGS[0][a:a + b])
    else:
        with pytest.raises(ValueError, match="jpeg_info: (sample|offsets and lengths)"):
            _C.jpeg_info(base, o, ln)


def test_jpeg_info_refuses_offsets_it_cannot_read_as_int64():
    base = exact(JPEGS[0])
    for bad in (np.array([0.5]), np.array([[0]]), np.array(0), np.array([2**63], np.uint64), "x", None,
                [1.5], ["1"], [True], [2**63]):
        with pytest.raises(ValueError, match="offsets must be a 1-d array of integers"):
            _C.jpeg_info(base, bad, np.array([1]))


# ---- tar shards ----------------------------------------------------------------------------------

def _shard(fmt: int, names: list[str], sizes: list[int], extra: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        if extra:
            d = tarfile.TarInfo("adir")
            d.type = tarfile.DIRTYPE
            t.addfile(d)
            s = tarfile.TarInfo("alink.jpg")
            s.type = tarfile.SYMTYPE
            s.linkname = "x" * (120 if fmt != tarfile.USTAR_FORMAT else 50)
            t.addfile(s)
        for k, (nm, sz) in enumerate(zip(names, sizes)):
            ti = tarfile.TarInfo(nm)
            ti.size = sz
            t.addfile(ti, io.BytesIO(bytes((k + j) % 251 for j in range(sz))))
    return buf.getvalue()


def _fix_checksum(b: bytearray, h: int) -> None:
    if h + 512 > len(b):
        return
    b[h + 148:h + 156] = b" " * 8
    s = sum(b[h:h + 512])
    b[h + 148:h + 156] = b"%06o\0 " % s


def _headers(b: bytes) -> list[int]:
    """Where tarfile's headers are in an unmutated shard."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(b)) as t:
        for m in t.getmembers():
            out.append(m.offset)
            # the extended headers before it (pax or GNU long name blocks)
            p = m.offset
            out.extend(q for q in range(p, m.offset_data - 512 + 1, 512))
    return sorted(set(out))


name_part = st.text(st.characters(min_codepoint=0x2D, max_codepoint=0x7A, blacklist_characters="./\\"),
                    min_size=1, max_size=12)


@st.composite
def tar_samples(draw):
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    k = draw(st.integers(1, 4))
    names = []
    for j in range(k):
        stem = draw(name_part)
        if fmt != tarfile.USTAR_FORMAT and draw(st.booleans()):
            stem = stem + "/" + "d" * draw(st.integers(90, 200)) + "/" + stem
        names.append(f"{stem}{j}.{draw(st.sampled_from(['jpg', 'cls', 'txt']))}")
    sizes = [draw(st.integers(0, 700)) for _ in names]
    b = bytearray(_shard(fmt, names, sizes, draw(st.booleans())))
    heads = _headers(bytes(b))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "size_octal", "size_b256", "size_big", "pax_len", "pax_size",
                                     "longname", "cut", "insert", "type", "magic", "checksum", "random"]))
        h = draw(st.sampled_from(heads))
        if h + 512 > len(b):
            continue
        fix = True
        if kind == "flip":
            at = h + draw(st.integers(0, 511))
            b[at] = draw(st.integers(0, 255))
            fix = draw(st.booleans())
        elif kind == "size_octal":
            b[h + 124:h + 136] = draw(st.sampled_from([b"77777777777\0", b"-0000000001\0", b"00000001000 ",
                                                       b"0000000 001\0", b"           \0", b"\0" * 12,
                                                       b"0o000000017\0", b"88888888888\0"]))
        elif kind == "size_b256":
            first = draw(st.sampled_from([0x80, 0x81, 0xFF, 0xC0]))
            rest = draw(st.binary(min_size=11, max_size=11))
            b[h + 124:h + 136] = bytes([first]) + rest
        elif kind == "size_big":
            b[h + 124:h + 136] = b"%011o\0" % draw(st.integers(0, 8**11 - 1))
        elif kind == "pax_len":
            # a pax record's decimal length made wrong (too short, too long, zero, huge)
            data = bytes(b[h + 512:h + 1024])
            sp = data.find(b" ")
            if 0 < sp < 20:
                new = draw(st.sampled_from([b"0", b"1", b"3", b"99999", b"9" * 19, b"99999999999999999999"]))
                b[h + 512:h + 512 + sp] = new
            fix = False
        elif kind == "pax_size":
            rec = draw(st.sampled_from([b"size=-1", b"size=", b"size=99999999999999999999",
                                        b"size=18446744073709551616", b"size=1e3", b"path=", b"pat"]))
            body = b" " + rec + b"\n"
            ln = len(body) + 2
            b[h + 512:h + 512 + ln] = b"%d" % ln + body
        elif kind == "longname":
            # a long name's (or pax data's) bytes with no terminator, or with a NUL inside
            try:
                size = int(bytes(b[h + 124:h + 135]).strip(b"\0 ") or b"0", 8)
            except ValueError:
                size = 0
            size = min(size, len(b) - h - 512)
            b[h + 512:h + 512 + size] = b"n" * size
            if size > 2 and draw(st.booleans()):
                b[h + 512 + draw(st.integers(0, size - 1))] = 0
            fix = False
        elif kind == "cut":
            del b[draw(st.integers(0, len(b))):]
            fix = False
        elif kind == "insert":
            at = draw(st.integers(0, len(b)))
            b[at:at] = draw(st.binary(min_size=1, max_size=600))
            fix = False
        elif kind == "type":
            # not 'g': tarfile applies a global header's path and size to every member after
            # it, which tar_scan (as GNU tar and WebDataset writers) leaves aside
            b[h + 156] = draw(st.sampled_from(b"0123456xX LKS7\0"))
        elif kind == "magic":
            b[h + 257:h + 265] = draw(st.sampled_from([b"ustar\x0000", b"ustar  \0", b"\0" * 8]))
        elif kind == "random":
            # a header of random bytes with a small octal size and a right checksum
            b[h:h + 512] = draw(st.binary(min_size=512, max_size=512))
            b[h + 124:h + 136] = b"%011o\0" % draw(st.integers(0, 2048))
        elif kind == "checksum":
            b[h + 148:h + 156] = draw(st.sampled_from([b"\xff" * 8, b"9999999\0", b"       \0", b"-1\0\0\0\0\0\0"]))
            fix = False
        if fix:
            _fix_checksum(b, h)
    return bytes(b)


def tarfile_members(b: bytes):
    """tarfile's regular files (name, data offset, size), or None when tarfile refuses the
    shard or stops early at a header it cannot read (it ignores what follows)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(b), mode="r:") as t:
            out = []
            while True:
                m = t.next()
                if m is None:
                    break
                if m.isreg() and m.type != tarfile.GNUTYPE_SPARSE:  # sparse files: not indexed
                    out.append((m.name, m.offset_data, m.size))
            return out, t.offset
    except (tarfile.TarError, ValueError, EOFError, UnicodeError):
        return None


@SETTINGS
@given(shard=tar_samples())
def test_tar_scan_of_mutated_shards_reads_inside_and_agrees_with_tarfile(shard):
    log(("tar", shard))
    TRIED_IMAGES["tar"] += 1
    try:
        names, cols = _C.tar_scan(exact(shard))
    except ValueError as e:
        assert str(e).startswith("tar_scan: at byte "), str(e)
        return
    TRIED_IMAGES["tar_read"] += 1
    assert cols.dtype == np.int64 and cols.ndim == 2 and cols.shape[1] == 3
    ends = cols[:, 0]
    assert (np.diff(ends) >= 0).all() and (len(ends) == 0 or ends[-1] == len(names))
    assert (cols[:, 1] >= 0).all() and (cols[:, 2] >= 0).all() and (cols[:, 1] + cols[:, 2] <= len(shard)).all()
    assert (cols[:, 1] % 512 == 0).all()
    ours = []
    e0 = 0
    for end, off, size in cols.tolist():
        ours.append((names[e0:end].decode("utf-8", "surrogateescape"), off, size))
        e0 = end
    theirs = tarfile_members(shard)
    if theirs is None:
        return  # tarfile refuses fields tar_scan does not read (mode, uid, mtime, ...)
    # tarfile stops without an error at a header it cannot read after the first: what it read
    # before must be what tar_scan read
    members, _ = theirs
    assert ours[:len(members)] == members, f"tar_scan read {ours!r:.500}, tarfile {members!r:.500}"


@st.composite
def wds_shards(draw):
    """WebDataset shards: key.jpg with key.cls holding random text (a label or not), then
    mutated as above."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))) as t:
        for k in range(draw(st.integers(1, 3))):
            key = draw(name_part) + str(k)
            cls = draw(st.one_of(st.integers(-2**70, 2**70).map(lambda v: str(v).encode()),
                                 st.binary(max_size=12), st.just(b" 3\n"), st.just(b"1_0")))
            members = [(f"{key}.jpg", JPEGS[k % len(JPEGS)])]
            if draw(st.integers(0, 4)):
                members.append((f"{key}.cls", cls))
            for name, blob in members:
                ti = tarfile.TarInfo(name)
                ti.size = len(blob)
                t.addfile(ti, io.BytesIO(blob))
    b = bytearray(buf.getvalue())
    heads = _headers(bytes(b))
    for _ in range(draw(st.integers(0, 2))):
        h = draw(st.sampled_from(heads))
        at = h + draw(st.sampled_from([124, 125, 130, 156, 0, 5, 512, 600]))
        if at < len(b):
            b[at] = draw(st.integers(0, 255))
            if draw(st.booleans()):
                _fix_checksum(b, h)
    return bytes(b)


@FILE_SETTINGS
@given(shard=wds_shards())
def test_mutated_webdataset_shards_are_refused_or_read_exactly(shard):
    log(("wds", shard))
    TRIED_IMAGES["wds"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.tar")
        with open(path, "wb") as f:
            f.write(shard)
        try:
            src = make_source(path)
        except ImageSourceError as e:
            assert path in str(e), str(e)
            return
        try:
            TRIED_IMAGES["wds_read"] += 1
            base, offs, lens, _ = src.read(np.arange(len(src)))
            names, cols = _C.tar_scan(exact(shard))
            members, e0 = {}, 0
            for end, off, size in cols.tolist():
                members[names[e0:end].decode("utf-8", "surrogateescape")] = shard[off:off + size]
                e0 = end
            assert src.labels.dtype == np.int64
            for k in range(len(src)):
                name = src.names[k]
                assert bytes(base[int(offs[k]):int(offs[k]) + int(lens[k])]) == members[name]
                cls = members[name.rsplit(".", 1)[0] + ".cls"]
                assert int(src.labels[k]) == int(cls.decode("ascii").strip())
        finally:
            src.close()


def test_tar_scan_of_real_shards_is_tarfiles():
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        long = "p" * 150 + "/" + "q" * 95 if fmt == tarfile.USTAR_FORMAT else "r" * 300
        b = _shard(fmt, ["a.jpg", long + ".jpg", "b.cls"], [3, 1000, 0], True)
        names, cols = _C.tar_scan(exact(b))
        got = []
        e0 = 0
        for end, off, size in cols.tolist():
            got.append((names[e0:end].decode(), off, size))
            e0 = end
        assert got == tarfile_members(b)[0]


# ---- packed datasets -----------------------------------------------------------------------------

PACK_N = 3
PACK_BLOBS = [JPEGS[0], JPEGS[1], b"not an image"]


def _write_packed(root: str, offsets, labels, sizes, meta, data: bytes) -> None:
    with open(os.path.join(root, "data.bin"), "wb") as f:
        f.write(data)
    np.save(os.path.join(root, "offsets.npy"), offsets)
    np.save(os.path.join(root, "labels.npy"), labels)
    if sizes is not None:
        np.save(os.path.join(root, "sizes.npy"), sizes)
    with open(os.path.join(root, "meta.json"), "w") as f:
        f.write(meta)


@st.composite
def packed_specs(draw):
    data = b"".join(PACK_BLOBS)
    good = np.cumsum([0] + [len(x) for x in PACK_BLOBS]).astype(np.int64)
    offsets = good.copy()
    kind = draw(st.sampled_from(["none", "value", "dtype", "shape", "labels", "labels_dtype", "sizes",
                                 "meta", "cut"]))
    labels = np.array([0, 1, 2], np.int64)
    sizes = np.array([[int(x) for x in expected_info(b)] for b in PACK_BLOBS], np.int32)
    sizes = np.where(sizes[:, :1] > 0, sizes, -1).astype(np.int32)
    meta = {"format": "pinloader.packed", "version": 1, "count": PACK_N, "classes": ["a", "b", "c"]}
    if kind == "value":
        k = draw(st.integers(0, PACK_N))
        offsets[k] = draw(st.sampled_from([-1, -2**63, 2**63 - 1, len(data) + 1, 1, int(good[k]) + 1,
                                           int(good[k]) - 1, 0, len(data)]))
    elif kind == "dtype":
        dt = draw(st.sampled_from([np.float64, np.float32, np.int32, np.uint64, np.uint8, np.bool_,
                                   np.complex128, "U5", "datetime64[s]"]))
        if draw(st.booleans()):
            offsets = offsets.astype(np.float64) + 0.5
        offsets = offsets.astype(dt)
    elif kind == "shape":
        offsets = draw(st.sampled_from([offsets[:-1], offsets[:, None], offsets[None], np.array(0),
                                        np.concatenate([offsets, offsets[-1:]]), offsets[:0]]))
    elif kind == "labels":
        labels = draw(st.sampled_from([labels[:-1], labels[:, None], np.array([[0, 1, 2]] * 3), np.array(1),
                                       np.concatenate([labels, labels]), labels[:0],
                                       np.array([-1, 2**63 - 1, -2**63], np.int64)]))
    elif kind == "labels_dtype":
        labels = labels.astype(draw(st.sampled_from([np.float64, np.uint64, np.int8, np.bool_, "U3"])))
        if labels.dtype == np.float64 and draw(st.booleans()):
            labels = labels + 0.5
        if labels.dtype == np.uint64 and draw(st.booleans()):
            labels[0] = 2**64 - 1
    elif kind == "sizes":
        choice = draw(st.sampled_from(["none", "shape", "float", "values"]))
        if choice == "none":
            sizes = None
        elif choice == "shape":
            sizes = sizes[:2]
        elif choice == "float":
            sizes = sizes.astype(np.float64) + 0.5
        else:
            r = draw(st.integers(0, PACK_N - 1))
            sizes[r] = draw(st.sampled_from([(5, 0, 3), (0, 5, 3), (7, -3, 1), (2**31 - 1, 2**31 - 1, 3),
                                             (-1, -1, -1), (4, 4, 300), (4, 4, -2)]))
    elif kind == "meta":
        meta = draw(st.sampled_from([{"format": "pinloader.packed", "count": 3, "classes": 7},
                                     {"format": "pinloader.packed", "count": 4},
                                     {"format": "pinloader.packed", "classes": [1, None]},
                                     {"format": "other"}, [1, 2], "x"]))
    elif kind == "cut":
        data = data[:draw(st.integers(0, len(data)))]
    return offsets, labels, sizes, json.dumps(meta), data


@FILE_SETTINGS
@given(spec=packed_specs())
def test_hostile_packed_datasets_are_refused_or_read_exactly(spec):
    offsets, labels, sizes, meta, data = spec
    log(("packed", spec))
    TRIED_IMAGES["packed"] += 1
    with tempfile.TemporaryDirectory() as root:
        _write_packed(root, offsets, labels, sizes, meta, data)
        try:
            src = make_source(root)
        except ImageSourceError as e:
            assert root in str(e), str(e)
            return
        TRIED_IMAGES["packed_read"] += 1
        try:
            # read: the offsets as written, exact integers, inside data.bin, in order
            n = len(src)
            assert offsets.dtype.kind in "iu" and offsets.shape == (n + 1,)
            assert labels.dtype.kind in "iu" and labels.shape == (n,)
            assert src.labels.dtype == np.int64 and src.labels.tolist() == [int(x) for x in labels]
            base, offs, lens, fails = src.read(np.arange(n))
            assert not fails
            for k in range(n):
                a, b = int(offsets[k]), int(offsets[k + 1])
                assert 0 <= a <= b <= len(data)
                assert bytes(base[int(offs[k]):int(offs[k]) + int(lens[k])]) == data[a:b]
            assert src.hw.dtype == np.int32 and src.hw.shape == (n, 3)
            for h, w, c in src.hw.tolist():
                assert (h, w, c) == (-1, -1, -1) or (h >= 1 and w >= 1 and 0 <= c <= 255), (h, w, c)
            assert src.classes is None or all(isinstance(c, str) for c in src.classes)
        finally:
            src.close()


# ---- resumed packs -------------------------------------------------------------------------------

def _folder(root: str) -> list[bytes]:
    blobs = []
    for c, name in enumerate(("a", "b")):
        os.makedirs(os.path.join(root, name))
        for k in range(3):
            blob = JPEGS[(c * 3 + k) % len(JPEGS)]
            with open(os.path.join(root, name, f"{k}.jpg"), "wb") as f:
                f.write(blob)
            blobs.append(blob)
    return blobs


@st.composite
def progress_texts(draw):
    blobs = [JPEGS[k % len(JPEGS)] for k in range(6)]
    labels = [0, 0, 0, 1, 1, 1]
    rows, end = [], 0
    for b, lab in zip(blobs, labels):
        info = expected_info(b)
        rows.append([end, len(b), lab, *info])
        end += len(b)
    rows = rows[:draw(st.integers(0, 6))]
    sized = set()  # rows whose sizes were edited
    for _ in range(draw(st.integers(0, 3))):
        if not rows:
            break
        r = draw(st.integers(0, len(rows) - 1))
        col = draw(st.integers(0, 5))
        if col >= 3:
            sized.add(r)
        rows[r][col] = draw(st.sampled_from([-1, 0, 1, 10**6, -10**6, 2**63, rows[r][col] + 1, rows[r][col] - 1]))
    text = "".join(" ".join(str(x) for x in row) + "\n" for row in rows)
    if draw(st.booleans()) and text:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["", "x", " ", "\n", "1.5", "\u00e9", "--", "0x10"])) + text[at:]
    data_len = draw(st.sampled_from([None, "exact", "short", "long"]))
    return text, data_len, sorted(sized)


@FILE_SETTINGS
@given(spec=progress_texts())
def test_a_resumed_pack_over_an_edited_progress_file_is_refused_or_exact(spec):
    text, data_len, sized = spec
    log(("resume", spec))
    TRIED_IMAGES["resume"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        dest = os.path.join(tmp, "dest")
        blobs = _folder(src)
        os.makedirs(dest)
        whole = b"".join(blobs)
        # the state a stopped pack leaves: source.json, progress.txt and data.bin
        pack(src, os.path.join(tmp, "ref"), workers=1, quiet=True)
        items = sorted(os.path.relpath(os.path.join(dp, f), src) for dp, _, fs in os.walk(src) for f in fs)
        ident = {"count": 6, "names_sha256": hashlib.sha256("\n".join(items).encode()).hexdigest()}
        with open(os.path.join(dest, "source.json"), "w") as f:
            json.dump(ident, f)
        with open(os.path.join(dest, "progress.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        if data_len is not None:
            n = {"exact": len(whole), "short": len(whole) // 2, "long": len(whole) + 100}[data_len]
            with open(os.path.join(dest, "data.bin"), "wb") as f:
                f.write((whole + b"\0" * 100)[:n])
        try:
            pack(src, dest, workers=1, quiet=True)
        except ValueError as e:
            assert "progress.txt" in str(e) or "data.bin" in str(e), str(e)
            return
        TRIED_IMAGES["resume_done"] += 1
        got = make_source(dest)
        try:
            base, offs, lens, _ = got.read(np.arange(len(got)))
            assert len(got) == 6
            assert [bytes(base[o:o + ln]) for o, ln in zip(offs.tolist(), lens.tolist())] == blobs
            assert got.labels.tolist() == [0, 0, 0, 1, 1, 1]
            for k, b in enumerate(blobs):
                # progress.txt's sizes are taken as written when they are well-formed (checking
                # them would read data.bin back); a wrong one fails its sample's decode clearly
                h, w, c = got.hw[k].tolist()
                if k in sized:
                    assert (h, w, c) == (-1, -1, -1) or (h >= 1 and w >= 1 and 0 <= c <= 255)
                else:
                    assert (h, w, c) == expected_info(b)
        finally:
            got.close()
        shutil.rmtree(dest)


# ---- reading files -------------------------------------------------------------------------------

_FILES: dict[str, bytes | None] = {}  # name -> bytes (regular files) or None (anything else)


def _file_tree() -> tuple[str, dict[str, bytes | None]]:
    if not _FILES:
        root = tempfile.mkdtemp(prefix="pl-fuzz-files-")
        rng = np.random.default_rng(5)
        for k, n in enumerate((0, 1, 511, 4096, 4097, 70000)):
            blob = rng.integers(0, 256, n, np.uint8).tobytes()
            with open(os.path.join(root, f"reg{k}"), "wb") as f:
                f.write(blob)
            _FILES[os.path.join(root, f"reg{k}")] = blob
        os.mkdir(os.path.join(root, "dir"))
        os.mkfifo(os.path.join(root, "fifo"))
        os.symlink(os.path.join(root, "reg3"), os.path.join(root, "link"))
        os.symlink(os.path.join(root, "nowhere"), os.path.join(root, "dangling"))
        _FILES[os.path.join(root, "link")] = _FILES[os.path.join(root, "reg3")]
        for name in ("dir", "fifo", "dangling", "missing"):
            _FILES[os.path.join(root, name)] = None
        _FILES["/dev/null"] = None
        _FILES["_root"] = root.encode()
    return _FILES["_root"].decode(), _FILES  # type: ignore[union-attr]


@st.composite
def path_lists(draw):
    _, files = _file_tree()
    names = sorted(k for k in files if k != "_root")
    out = []
    for _ in range(draw(st.integers(0, 12))):
        p = draw(st.sampled_from(names))
        kind = draw(st.sampled_from(["str", "str", "bytes", "pathlike", "nul", "int"]))
        out.append({"str": p, "bytes": p.encode(), "pathlike": pathlib.Path(p),
                    "nul": p + "\0x", "int": 7}[kind])
    return out


@SETTINGS
@given(paths=path_lists(), threads=st.integers(1, 8))
def test_reading_random_files_gives_their_bytes_or_a_clear_error(paths, threads):
    log(("files", paths, threads))
    TRIED_IMAGES["files"] += 1
    _, files = _file_tree()
    bad_type = any(isinstance(p, int) for p in paths)
    bad_nul = any("\0" in os.fsdecode(os.fspath(p)) for p in paths if not isinstance(p, int))
    want = [None if isinstance(p, int) else files.get(os.fsdecode(os.fspath(p)).split("\0")[0]) for p in paths]
    try:
        data, offsets, lengths, errors = _C.read_files(paths, threads)
    except TypeError:
        assert bad_type
    except ValueError as e:
        assert bad_nul and "null" in str(e)
    else:
        assert not bad_type and not bad_nul
        assert len(offsets) == len(lengths) == len(errors) == len(paths)
        for k, w in enumerate(want):
            o, n = int(offsets[k]), int(lengths[k])
            if w is None:
                assert errors[k] != 0 and n == 0
            else:
                assert errors[k] == 0 and bytes(data[o:o + n]) == w
    try:
        region, starts = _C.map_files(paths)
    except TypeError:
        assert bad_type
    except ValueError as e:
        assert bad_nul and "null" in str(e)
    except OSError:
        assert any(w is None for w in want)
    else:
        assert not bad_type and not bad_nul and all(w is not None for w in want)
        assert not region.flags.writeable
        for k, w in enumerate(want):
            assert bytes(region[int(starts[k]):int(starts[k]) + len(w)]) == w
        del region


# ---- the loader over mutated images --------------------------------------------------------------

def _host_decodes(b: bytes) -> bool:
    """Whether the host decoder takes the sample: Pillow decodes it to the size its header says."""
    try:
        h, w, _ = ops.image_info(b)
        return ops.decode_rgb(b).shape[:2] == (h, w)
    except ValueError:
        return False


@FILE_SETTINGS
@given(samples=st.lists(jpeg_samples(), min_size=1, max_size=6), train=st.booleans(),
       packed=st.booleans())
def test_image_loader_over_mutated_jpegs_decodes_or_skips_each(samples, train, packed):
    # every sample is decoded or skipped with its reason (host decoder), never a crash; the
    # batches' images and skips add up to the samples
    from pinloader import ImageLoader
    log(("loader", samples, train, packed))
    TRIED_IMAGES["loader"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        for k, b in enumerate(samples):
            os.makedirs(os.path.join(tmp, "src", f"c{k % 2}"), exist_ok=True)
            with open(os.path.join(tmp, "src", f"c{k % 2}", f"{k}.jpg"), "wb") as f:
                f.write(b)
        root = os.path.join(tmp, "src")
        if packed:
            pack(root, os.path.join(tmp, "packed"), workers=1, quiet=True)
            root = os.path.join(tmp, "packed")
        loader = ImageLoader(root, 4, train=train, size=16, device="cpu", decoder="host",
                             on_error="skip", workers=2, seed=1)
        try:
            got = 0
            for batch in loader:
                img, lab = np.from_dlpack(batch["image"]), np.from_dlpack(batch["label"])
                assert img.shape[1:] == (3, 16, 16) and np.isfinite(img).all()
                assert len(lab) == img.shape[0]
                got += img.shape[0]
            s = loader.stats()
            assert got + s["skipped"] == len(samples)
            assert got == sum(map(_host_decodes, samples)), s["skipped_samples"]
            assert all(r["reason"] for r in s["skipped_samples"])
        finally:
            loader.close()
