"""Where :class:`pinloader.ImageLoader` reads encoded images from: an ``ImageFolder`` tree, a
list of (path, label), WebDataset-style tar shards, or a packed dataset
(``python -m pinloader pack``).

Every source gives, for an int64 array of sample indices, the samples' encoded bytes as ragged
rows of one C-contiguous uint8 buffer (``read(indices) -> (base, offsets, lengths)``), their
labels, a name for error messages (``name(i)``), and a cache of image sizes (``hw``: int32
(N, 3) height, width, components; -1 where not known yet) that the loader fills from the
headers as it first meets each sample. Packed data and tar shards are mapped next to each other
as one region (Note [one region of files] in src/py/image_host.c): ``read`` returns the region
itself and the samples' offsets in it, without copying, whatever shards a batch draws from.

Packed format (a directory; every file opens with NumPy alone):

* ``data.bin``: the encoded images, one after the other;
* ``offsets.npy``: int64 (N + 1,): sample i is ``data.bin[offsets[i]:offsets[i + 1]]``;
* ``labels.npy``: int64 (N,);
* ``sizes.npy``: int32 (N, 3): height, width, components from each header (-1: not known);
* ``meta.json``: ``{"format": "pinloader.packed", "version": 1, "count": N, "classes": [...]}``;
* ``names.txt``: each sample's source path (relative to the packed folder or tar), one a line.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from . import _C

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
TAR_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")
PACKED_FORMAT = "pinloader.packed"
PACKED_VERSION = 1


class ImageSourceError(ValueError):
    """A source that cannot be read as a dataset (empty, missing labels, malformed)."""


_INT64 = (-2**63, 2**63 - 1)  # labels are int64


def _unknown_sizes(n: int) -> np.ndarray:
    return np.full((n, 3), -1, np.int32)


def _ragged(chunks: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.array([len(c) for c in chunks], np.int64)
    offsets = np.zeros(len(chunks), np.int64)
    if len(chunks) > 1:
        np.cumsum(lengths[:-1], out=offsets[1:])
    base = np.frombuffer(b"".join(chunks), np.uint8) if chunks else np.zeros(0, np.uint8)
    if base.size == 0:
        base = np.zeros(1, np.uint8)  # a buffer to point into even when every sample is empty
    return base, offsets, lengths


class FileSource:
    """Images in files, one per sample (a folder or a list of paths)."""

    kind = "files"

    def __init__(self, paths: list[str], labels: np.ndarray, classes: list[str] | None = None) -> None:
        self.paths = paths
        self.labels = labels
        self.classes = classes
        self.hw = _unknown_sizes(len(paths))
        self.threads = 8  # file reader threads per batch (file reads wait on storage, not CPU)

    def __len__(self) -> int:
        return len(self.paths)

    def name(self, i: int) -> str:
        return self.paths[int(i)]

    def read_one(self, i: int) -> bytes:
        """Sample i's file, read as ``read`` reads it: a FIFO or a device under an image's name
        is an OSError, never a blocking open."""
        path = self.paths[int(i)]
        data, _, lengths, errs = _C.read_files([path], 1)
        e = int(errs[0])
        if e:
            raise OSError(e, os.strerror(e), path) if e > 0 else OSError("not a regular file")
        out: bytes = data[:int(lengths[0])].tobytes()
        return out

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        """The files of ``idx`` in one buffer, read by native threads without the GIL (Note
        [file reader threads] in src/py/image_host.c), and {position in idx: why} for those
        that could not be read (their length -1)."""
        data, offsets, lengths, errs = _C.read_files([self.paths[int(i)] for i in idx], self.threads)
        fails: dict[int, str] = {}
        for k in np.flatnonzero(errs):
            e = int(errs[k])
            fails[int(k)] = ("cannot be read (not a regular file)" if e < 0 else
                             f"cannot be read ([Errno {e}] {os.strerror(e)})")
            lengths[k] = -1
        return data, offsets, lengths, fails

    def close(self) -> None:
        pass


def folder_source(root: str) -> FileSource:
    """torchvision's ImageFolder: class folders sorted by name, labels their positions, files
    with IMG_EXTENSIONS (any case) found recursively, sorted, symlinks followed; a class folder
    without such files is an error, as there."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise ImageSourceError(f"ImageLoader: {root} is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        # Note [resumable pack] in pinloader/_image_pack.py
        if os.path.exists(os.path.join(root, "progress.txt")):
            raise ImageSourceError(f"ImageLoader: {root} is an unfinished pack (progress.txt, no "
                                   "meta.json): run `python -m pinloader pack` again to finish it")
        raise ImageSourceError(f"ImageLoader: {root} has no class folders (ImageFolder layout: "
                               "root/<class>/<image>)")
    paths: list[str] = []
    labels: list[int] = []
    for c, name in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            for fname in sorted(files):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.join(dirpath, fname))
                    labels.append(c)
    if not paths:
        raise ImageSourceError(f"ImageLoader: no image files ({', '.join(IMG_EXTENSIONS)}) under "
                               f"{root}'s class folders")
    # a class without images would be a label no sample has, and would shift the labels of the
    # classes after it: torchvision's ImageFolder refuses it (allow_empty=False)
    empty = sorted(set(classes) - {classes[c] for c in set(labels)})
    if empty:
        raise ImageSourceError(f"ImageLoader: no image files in the class folders {', '.join(empty)} of "
                               f"{root} (torchvision's ImageFolder refuses them too; image files end with "
                               f"{', '.join(IMG_EXTENSIONS)})")
    return FileSource(paths, np.array(labels, np.int64), classes)


def list_source(items: Sequence[tuple[Any, int]]) -> FileSource:
    paths: list[str] = []
    labels: list[int] = []
    for k, item in enumerate(items):
        try:
            p, lab = item
        except (TypeError, ValueError):
            raise TypeError(f"ImageLoader: source[{k}] must be a (path, label) pair, got {item!r}") from None
        if isinstance(lab, bool) or not isinstance(lab, (int, np.integer)):
            raise TypeError(f"ImageLoader: source[{k}]: the label must be an int, got {lab!r}")
        if not _INT64[0] <= int(lab) <= _INT64[1]:
            raise ValueError(f"ImageLoader: source[{k}]: the label {int(lab)} does not fit in int64")
        paths.append(os.fspath(p))
        labels.append(int(lab))
    if not paths:
        raise ImageSourceError("ImageLoader: the list of images is empty")
    return FileSource(paths, np.array(labels, np.int64))


class MappedSource:
    """Samples as ragged rows of mapped files (packed data, tar shards), all the files mapped
    next to each other as one region (Note [one region of files] in src/py/image_host.c):
    sample i is ``region[offsets[i]:offsets[i] + lengths[i]]``, in file ``file_of[i]``. Every
    batch, of any files, is one buffer without a copy."""

    def __init__(self, kind: str, file_names: list[str], file_of: np.ndarray, offsets: np.ndarray,
                 lengths: np.ndarray, labels: np.ndarray, names: list[str],
                 hw: np.ndarray | None = None, classes: list[str] | None = None,
                 mapping: tuple[np.ndarray, np.ndarray, list[int]] | None = None) -> None:
        """``offsets``: within each sample's own file. ``mapping``: the files' region, where
        each begins in it and their sizes when mapped, if the caller mapped them already."""
        self.kind = kind
        self.file_names = file_names
        if mapping is None:
            sizes = [os.path.getsize(f) for f in file_names]
            region, starts = _C.map_files(file_names)
        else:
            region, starts, sizes = mapping
        self.region: np.ndarray | None = region
        self.mapped = np.array(sizes, np.int64)
        self.file_of = file_of
        self.offsets = offsets + starts[file_of]
        self.lengths = lengths
        ends = offsets + lengths
        if len(ends) and (ends > self.mapped[file_of]).any():
            k = int(np.flatnonzero(ends > self.mapped[file_of])[0])
            raise ImageSourceError(f"ImageLoader: {file_names[int(file_of[k])]} is shorter than its "
                                   f"index says (sample {k} ends at byte {int(ends[k])})")
        self.labels = labels
        self.names = names
        self.classes = classes
        self.hw = hw if hw is not None else _unknown_sizes(len(labels))

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, i: int) -> str:
        i = int(i)
        return f"{self.file_names[int(self.file_of[i])]}: {self.names[i]}"

    def _check(self, files: Any) -> np.ndarray:
        """The region, once the files about to be read are found no shorter than when they were
        mapped (a read past a file's end would fault: the check narrows that to one batch)."""
        region = self.region
        if region is None:
            raise ValueError("ImageLoader: the source is closed")
        for f in np.atleast_1d(files):
            f = int(f)
            try:
                now = os.stat(self.file_names[f]).st_size
            except OSError as e:
                raise ImageSourceError(f"ImageLoader: {self.file_names[f]} can no longer be read ({e})") from None
            if now < self.mapped[f]:
                raise ImageSourceError(f"ImageLoader: {self.file_names[f]} was truncated on disk while "
                                       f"loading: it is now {now} bytes, {int(self.mapped[f])} are mapped "
                                       "(the dataset was rewritten or cut short under the loader)")
        return region

    def read_one(self, i: int) -> bytes:
        """Sample i's bytes, copied at once after the check (its decode may come later)."""
        i = int(i)
        region = self._check(self.file_of[i])
        o = int(self.offsets[i])
        return region[o:o + int(self.lengths[i])].tobytes()

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
        idx = np.asarray(idx, np.int64)
        region = self._check(np.unique(self.file_of[idx]))
        return region, self.offsets[idx], self.lengths[idx], {}

    def close(self) -> None:
        self.region = None  # unmapped once no batch in flight reads it


def _load(root: str, name: str) -> np.ndarray:
    try:
        a = np.load(os.path.join(root, name), allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ImageSourceError(f"ImageLoader: {root}: {name} cannot be read ({e})") from None
    if not isinstance(a, np.ndarray):
        raise ImageSourceError(f"ImageLoader: {root}: {name} is not one .npy array")
    return a


def _int_vector(root: str, name: str) -> np.ndarray:
    """A 1-d integer .npy array as int64: any other dtype or shape, or a uint64 value past
    int64, is refused rather than converted."""
    a = _load(root, name)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise ImageSourceError(f"ImageLoader: {root}: {name} must be a 1-d array of integers, got "
                               f"{a.dtype} of shape {a.shape}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ImageSourceError(f"ImageLoader: {root}: {name} holds {int(a.max())}, past int64")
    return a.astype(np.int64, copy=False)


def _sizes(root: str, n: int) -> np.ndarray:
    """sizes.npy as int32 (n, 3): each row (-1, -1, -1) or a height and width >= 1 and
    components in 0..255, as the loader's size cache holds them (crops are drawn from them)."""
    s = _load(root, "sizes.npy")
    if s.dtype.kind not in "iu" or s.shape != (n, 3):
        raise ImageSourceError(f"ImageLoader: {root}: sizes.npy must be an ({n}, 3) array of integers, "
                               f"got {s.dtype} of shape {s.shape}")
    if s.size and (int(s.max()) > np.iinfo(np.int32).max or int(s.min()) < -1):
        raise ImageSourceError(f"ImageLoader: {root}: sizes.npy holds values outside -1..2**31-1")
    s = s.astype(np.int32)
    known = (s[:, 0] >= 1) & (s[:, 1] >= 1) & (s[:, 2] >= 0) & (s[:, 2] <= 255)
    bad = np.flatnonzero(~(known | (s == -1).all(1)))
    if len(bad):
        k = int(bad[0])
        raise ImageSourceError(f"ImageLoader: {root}: sizes.npy row {k} is {tuple(s[k].tolist())} "
                               "(need a height and width >= 1 and 0..255 components, or -1s)")
    return s


def packed_source(root: str) -> MappedSource:
    root = os.fspath(root)
    try:
        with open(os.path.join(root, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ImageSourceError(f"ImageLoader: {root} is not a packed dataset (meta.json: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != PACKED_FORMAT:
        raise ImageSourceError(f"ImageLoader: {root}/meta.json is not a {PACKED_FORMAT} file")
    version = meta.get("version", 1)  # (written since the first version; hand-made folders may lack it)
    if version != PACKED_VERSION or isinstance(version, bool):
        raise ImageSourceError(f"ImageLoader: {root}/meta.json: format version {version!r}, this "
                               f"pinloader reads version {PACKED_VERSION}")
    classes = meta.get("classes")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
        raise ImageSourceError(f"ImageLoader: {root}/meta.json: classes must be a list of names, got {classes!r:.80}")
    bounds = _int_vector(root, "offsets.npy")
    labels = _int_vector(root, "labels.npy")
    n = len(labels)
    if bounds.shape != (n + 1,) or n == 0:
        raise ImageSourceError(f"ImageLoader: {root}: offsets.npy has shape {bounds.shape}, "
                               f"labels.npy {n} samples (need N + 1 offsets, N >= 1)")
    if meta.get("count", n) != n:
        raise ImageSourceError(f"ImageLoader: {root}: meta.json counts {meta['count']!r:.40} samples, "
                               f"labels.npy has {n}")
    data_path = os.path.join(root, "data.bin")
    size = os.path.getsize(data_path)
    # compared, not subtracted: a difference of int64 offsets can wrap around
    if bounds[0] != 0 or (bounds[1:] < bounds[:-1]).any() or bounds[-1] > size:
        raise ImageSourceError(f"ImageLoader: {root}: offsets.npy does not describe data.bin "
                               f"({size} bytes)")
    hw = None
    if os.path.exists(os.path.join(root, "sizes.npy")):
        hw = _sizes(root, n)
    names_path = os.path.join(root, "names.txt")
    names = [f"sample {i}" for i in range(n)]
    if os.path.exists(names_path):
        with open(names_path, encoding="utf-8", errors="replace") as f:
            got = f.read().split("\n")[:n]
        if len(got) == n:
            names = got
    return MappedSource("packed", [data_path], np.zeros(n, np.int64), bounds[:-1].copy(),
                        np.diff(bounds), labels, names, hw, classes)


def _wds_key(name: str) -> tuple[str, str]:
    """WebDataset's split: the key is the path up to the first dot of the file name."""
    d, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (d + "/" + stem if d else stem), ext.lower()


def tar_source(shards: Sequence[str]) -> MappedSource:
    """WebDataset-style shards: each sample ``key.jpg`` (or another image extension) with
    ``key.cls`` (its label as decimal text); a ``key.cls`` without an image member is an
    error, other keys' members are not samples. The shards are mapped as one region and each one's
    headers are read in place, once, in C (``_C.tar_scan``: ustar, pax and GNU long names)."""
    names_f = [os.fspath(x) for x in shards]
    try:
        sizes = [os.path.getsize(f) for f in names_f]
        region, starts = _C.map_files(names_f)
    except OSError as e:
        raise ImageSourceError(f"ImageLoader: cannot open the tar shards ({e})") from None
    file_of: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    labels: list[int] = []
    names: list[str] = []
    for f, shard in enumerate(names_f):
        lo = int(starts[f])
        view = region[lo:lo + sizes[f]]
        try:
            blob, cols = _C.tar_scan(view)
        except ValueError as e:
            raise ImageSourceError(f"ImageLoader: cannot read the tar shard {shard} ({e})") from None
        samples: dict[str, dict[str, tuple[int, int, str]]] = {}
        end0 = 0
        for end, off, size in cols.tolist():
            name = blob[end0:end].decode("utf-8", "surrogateescape")
            end0 = end
            key, ext = _wds_key(name)
            group = samples.setdefault(key, {})
            if ext in group:  # the later would silently replace the earlier
                raise ImageSourceError(f"ImageLoader: {shard}: {name} appears twice in the shard "
                                       f"({group[ext][2]} first)")
            group[ext] = (off, size, name)
        for key, s in samples.items():
            img = next((s[e] for e in TAR_IMAGE_EXTS if e in s), None)
            if img is None:
                if "cls" in s:  # a labelled sample the loader would leave out without a word
                    raise ImageSourceError(
                        f"ImageLoader: {shard}: {key}.cls labels no image (its members: "
                        f"{', '.join(sorted(m[2] for m in s.values()))}; images are "
                        f"{', '.join('.' + e for e in TAR_IMAGE_EXTS)})")
                continue  # not a sample: a shard's other members
            if "cls" not in s:
                raise ImageSourceError(f"ImageLoader: {shard}: {img[2]} has no label ({key}.cls)")
            o, n, _ = s["cls"]
            text = view[o:o + n].tobytes()
            try:
                lab = int(text.decode("ascii").strip())
            except (UnicodeDecodeError, ValueError):
                raise ImageSourceError(f"ImageLoader: {shard}: {key}.cls is not an integer label "
                                       f"({text[:40]!r})") from None
            if not _INT64[0] <= lab <= _INT64[1]:
                raise ImageSourceError(f"ImageLoader: {shard}: {key}.cls holds {text[:40]!r}, which "
                                       "does not fit in int64")
            file_of.append(f)
            offsets.append(img[0])
            lengths.append(img[1])
            labels.append(lab)
            names.append(img[2])
    if not labels:
        raise ImageSourceError(f"ImageLoader: no images in the tar shards {names_f}")
    return MappedSource("tar", names_f, np.array(file_of, np.int64), np.array(offsets, np.int64),
                        np.array(lengths, np.int64), np.array(labels, np.int64), names,
                        mapping=(region, starts, sizes))


def _is_packed(root: str) -> bool:
    """A folder is a packed dataset when it holds a meta.json, unless it is an ImageFolder tree
    with a meta.json of its own: one that does not say it is a packed dataset's, beside class
    folders."""
    path = os.path.join(root, "meta.json")
    if not os.path.exists(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if isinstance(meta, dict) and meta.get("format") == PACKED_FORMAT:
            return True
    except (OSError, ValueError):
        pass
    with os.scandir(root) as entries:
        return not any(e.is_dir() for e in entries)


def make_source(source: Any) -> Any:
    """The source object for ImageLoader's ``source`` argument: a folder (ImageFolder layout,
    or a packed dataset when it holds meta.json: _is_packed), a tar shard or a list of them, or a list of
    (path, label) pairs."""
    if isinstance(source, (FileSource, MappedSource)):
        return source
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isdir(p):
            if _is_packed(p):
                return packed_source(p)
            return folder_source(p)
        if p.endswith(".tar") and os.path.isfile(p):
            return tar_source([p])
        if not os.path.exists(p):
            raise FileNotFoundError(f"ImageLoader: {p} does not exist")
        raise ImageSourceError(f"ImageLoader: {p} is neither a folder nor a .tar shard")
    try:
        items = list(source)
    except TypeError:
        raise TypeError(f"ImageLoader: source must be a folder, tar shard(s) or a list of (path, "
                        f"label), not {type(source).__name__}") from None
    if items and all(isinstance(x, (str, os.PathLike)) for x in items):
        odd = [os.fspath(x) for x in items if not os.fspath(x).endswith(".tar")]
        if odd:
            raise TypeError(f"ImageLoader: a list of paths must be .tar shards (WebDataset), got "
                            f"{odd[0]!r}; give images as (path, label) pairs")
        return tar_source(items)
    return list_source(items)
