"""``python -m pinloader pack SRC DEST``: write a packed image dataset (the format is in
pinloader/_image_sources.py) from an ImageFolder tree or WebDataset tar shards.

Note [resumable pack]
Samples are appended in chunks: a chunk's bytes go to ``data.bin`` and are flushed to storage,
then one line per sample (offset, length, label, height, width, components) goes to
``progress.txt``, flushed too. A pack stopped at any point (Ctrl-C, a crash, a full disk) left
a ``progress.txt`` whose complete lines describe bytes that are in ``data.bin``: the next run
over the same source reads those lines, cuts ``data.bin`` back to where the last one ends and
goes on from the next sample, once ``source.json`` (the source's sample count and a hash of its
file names in order, written when the pack began) shows that the source is still the same.
The .npy files and ``meta.json`` are written only at the end,
``meta.json`` last (through a rename), so a folder with ``meta.json`` is always complete.
Encoded bytes are copied as they are: a corrupt image is packed too (its size -1), and the
loader reports it when it meets it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import _image_ops as ops
from ._image_sources import PACKED_FORMAT, PACKED_VERSION, FileSource, MappedSource, make_source

CHUNK = 256
# what a pack writes in its folder before meta.json, source.json first (Note [resumable pack])
_OWN_FILES = frozenset({"data.bin", "progress.txt", "source.json", "offsets.npy", "labels.npy",
                        "sizes.npy", "names.txt", "meta.json.tmp"})


def _info(data: Any) -> tuple[int, int, int]:
    try:
        return ops.image_info(data)
    except ValueError:
        return -1, -1, -1


def _read(src: Any, i: int) -> tuple[bytes, tuple[int, int, int]]:
    try:
        data = bytes(src.read_one(i))
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(f"{src.name(i)}: {e}") from None
    return data, _info(data)


def _name(src: Any, root: str, i: int) -> str:
    if isinstance(src, FileSource):
        try:
            return str(os.path.relpath(src.paths[i], root))
        except ValueError:
            return str(src.paths[i])
    return str(src.name(i))


def _load_progress(path: str) -> list[tuple[int, ...]]:
    """The complete lines of progress.txt (Note [resumable pack]), each checked: the samples'
    bytes one after the other from 0, sizes as the loader's cache holds them. A line that is not
    so (the file edited or damaged) is a ValueError: resuming from it would pack wrong offsets.
    An incomplete last line (a write cut short) is cut off the file, so that the lines appended
    next start on a line of their own."""
    rows: list[tuple[int, ...]] = []
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except FileNotFoundError:
        return rows
    except UnicodeDecodeError as e:
        raise ValueError(f"pack: {path} is not a progress file ({e}); remove its folder to start over") from None
    end = 0
    for k, line in enumerate(text.split("\n")[:-1]):  # the last piece has no newline: incomplete or empty
        parts = line.split()
        try:
            row = tuple(int(x) for x in parts)
        except ValueError:
            row = ()
        ok = len(row) == 6 and row[0] == end and row[1] >= 0 and (
            row[3:] == (-1, -1, -1) or (1 <= row[3] < 2**31 and 1 <= row[4] < 2**31 and 0 <= row[5] <= 255))
        if not ok:
            raise ValueError(f"pack: {path} line {k + 1} is not a progress line after the ones before it "
                             f"({line[:80]!r}); remove its folder to start over")
        rows.append(row)
        end += row[1]
    keep = text.rfind("\n") + 1
    if keep < len(text):
        os.truncate(path, keep)
    return rows


class _Progress:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.t0 = time.monotonic()
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def show(self, done: int, nbytes: int, start: int, final: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not final and (done >= self.total or now - self.last < (0.2 if self.tty else 10.0)):
            return
        self.last = now
        rate = (done - start) / max(now - self.t0, 1e-9)
        width = 30
        fill = int(width * done / max(self.total, 1))
        bar = "#" * fill + "." * (width - fill)
        msg = (f"pack [{bar}] {done}/{self.total} images, {nbytes / 1e6:.1f} MB, "
               f"{rate:.0f} img/s")
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + msg, end=end, file=sys.stderr, flush=True)


def pack(src_path: str | list[str], dest: str, workers: int | None = None, quiet: bool = False) -> int:
    """Pack ``src_path`` (an ImageFolder tree or tar shard(s)) into the folder ``dest``;
    resumable (Note [resumable pack]). Returns the number of samples."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"pack: workers must be an int >= 1, got {workers!r}")
        if workers < 1:
            raise ValueError(f"pack: workers must be an int >= 1, got {workers!r}")
    src = make_source(src_path)
    if isinstance(src, MappedSource) and src.kind == "packed":
        raise ValueError(f"pack: {src_path} is already a packed dataset")
    n = len(src)
    if isinstance(src, FileSource) and isinstance(src_path, (str, os.PathLike)):
        # a folder made there would be a class of the tree (with no images) for every later read
        top, where = os.path.realpath(src_path), os.path.realpath(dest)
        if os.path.commonpath([top, where]) == top:
            src.close()
            raise ValueError(f"pack: {dest} is inside the image folder {src_path}: choose a folder "
                             "outside it")
    os.makedirs(dest, exist_ok=True)
    if os.path.exists(os.path.join(dest, "meta.json")):
        raise ValueError(f"pack: {dest} already holds a packed dataset (meta.json); choose another "
                         "folder or remove it")
    entries = set(os.listdir(dest))
    # a stopped pack's folder holds its source.json or progress.txt; anything else there is not
    # the pack's, and its files would replace any of the same name
    stopped = bool(entries & {"source.json", "progress.txt"})
    others = sorted(entries - _OWN_FILES if stopped else entries)
    if others:
        raise ValueError(f"pack: {dest} holds other files than a stopped pack's ({', '.join(others[:5])}"
                         f"{', ...' if len(others) > 5 else ''}): choose an empty or new folder")
    data_path = os.path.join(dest, "data.bin")
    prog_path = os.path.join(dest, "progress.txt")
    # the source as this pack saw it: a resumed pack must see the same samples in the same order
    root = os.fspath(src_path) if isinstance(src_path, (str, os.PathLike)) else ""
    digest = hashlib.sha256("\n".join(_name(src, root, i) for i in range(n)).encode("utf-8", "replace"))
    ident = {"count": n, "names_sha256": digest.hexdigest()}
    ident_path = os.path.join(dest, "source.json")
    if os.path.exists(prog_path) and os.path.exists(ident_path):
        try:
            with open(ident_path, encoding="utf-8") as f:
                seen = json.load(f)
        except ValueError as e:
            raise ValueError(f"pack: {ident_path} is damaged ({e}); remove {dest} to start over") from None
        if seen != ident:
            raise ValueError(f"pack: {dest} holds part of a pack of another source (its files or "
                             f"their order differ from {src_path}'s); remove {dest} to start over")
    else:
        with open(ident_path, "w", encoding="utf-8") as f:
            json.dump(ident, f)
    rows = _load_progress(prog_path)
    labels = np.asarray(src.labels, np.int64)
    if len(rows) > n or any(r[2] != labels[k] for k, r in enumerate(rows)):
        raise ValueError(f"pack: {prog_path} describes another source (its samples or labels differ "
                         f"from {src_path}'s); remove {dest} to start over")
    for k, r in enumerate(rows):  # each sample packed whole (its bytes are not read back)
        want = int(src.lengths[k]) if isinstance(src, MappedSource) else os.path.getsize(src.paths[k])
        if r[1] != want:
            raise ValueError(f"pack: {prog_path} line {k + 1} gives sample {k} ({_name(src, root, k)}) "
                             f"{r[1]} bytes, the source {want}; remove {dest} to start over")
    end = rows[-1][0] + rows[-1][1] if rows else 0
    mode = "r+b" if os.path.exists(data_path) else "wb"
    with open(data_path, mode) as data, open(prog_path, "a", encoding="ascii") as prog:
        if os.fstat(data.fileno()).st_size < end:
            raise ValueError(f"pack: {data_path} is shorter than {prog_path} says; remove {dest} to "
                             "start over")
        data.truncate(end)
        data.seek(end)
        bar = _Progress(n, quiet)
        start = len(rows)
        nw = workers or min(32, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=nw, thread_name_prefix="pl-pack") as pool:
            k = start
            while k < n:
                hi = min(n, k + CHUNK)
                got = list(pool.map(lambda i: _read(src, i), range(k, hi)))
                lines = []
                for j, (blob, (h, w, c)) in enumerate(got):
                    data.write(blob)
                    lines.append(f"{end} {len(blob)} {int(labels[k + j])} {h} {w} {c}\n")
                    rows.append((end, len(blob), int(labels[k + j]), h, w, c))
                    end += len(blob)
                data.flush()
                os.fsync(data.fileno())
                prog.write("".join(lines))
                prog.flush()
                os.fsync(prog.fileno())
                k = hi
                bar.show(k, end, start)
        bar.show(n, end, start, final=True)
    table = np.array(rows, np.int64).reshape(-1, 6)
    offsets = np.zeros(n + 1, np.int64)
    offsets[1:] = table[:, 0] + table[:, 1]
    np.save(os.path.join(dest, "offsets.npy"), offsets)
    np.save(os.path.join(dest, "labels.npy"), table[:, 2].copy())
    np.save(os.path.join(dest, "sizes.npy"), table[:, 3:6].astype(np.int32))
    with open(os.path.join(dest, "names.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(_name(src, root, i).replace("\n", " ") for i in range(n)))
    meta = {"format": PACKED_FORMAT, "version": PACKED_VERSION, "count": n,
            "classes": list(src.classes) if getattr(src, "classes", None) else None,
            "source": os.path.abspath(os.fspath(src_path)) if isinstance(src_path, (str, os.PathLike)) else None}
    tmp = os.path.join(dest, "meta.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(dest, "meta.json"))
    os.remove(prog_path)
    os.remove(ident_path)
    src.close()
    return n


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def add_parser(sub: Any, fmt: Any) -> None:
    p = sub.add_parser("pack", formatter_class=fmt,
                       help="pack an image folder or tar shards into one file for ImageLoader",
                       description="Write SRC's images (an ImageFolder tree: SRC/<class>/<image>, or "
                                   "WebDataset .tar shards) into DEST as one data file with int64 "
                                   "offsets and labels (.npy). Parallel; a stopped pack resumes "
                                   "where it stopped when run again.")
    p.add_argument("src", nargs="+", help="the folder, or the .tar shard(s)")
    p.add_argument("dest", help="the packed dataset's folder (created)")
    p.add_argument("--workers", type=_positive, default=None, help="reader threads (default: the CPUs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: Any) -> int:
    src = args.src[0] if len(args.src) == 1 else list(args.src)
    try:
        n = pack(src, args.dest, workers=args.workers, quiet=args.quiet)
    except (ValueError, TypeError, OSError) as e:  # the sources' and the folder's errors
        print(f"pinloader pack: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npinloader pack: interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    if not args.quiet:
        print(f"packed {n} images into {args.dest}", file=sys.stderr)
    return 0
