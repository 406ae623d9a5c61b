"""The files under memory-mapped sources, for the ArrayLoader's checks of their size (Note
[truncated mappings] in pinloader/_epoch_plan.py) and its read-ahead: which sources are mapped
and how large their mappings are, the file each maps and the size it needs (file_mapping, by
the mmap a source holds or, where its owners hide it, by its address in /proc/self/maps), and
read-only descriptors of those very files (open_mapped_files), which a RowBatches checks with
fstat() (Note [native epochs] in src/py/row_batches.c). Reads /proc/self/maps; knows nothing of
epochs or loaders."""
from __future__ import annotations

import bisect
import mmap
import os
import stat
from typing import Any, Iterable, Iterator

import numpy as np


def base_chain(arr: Any) -> Iterator[Any]:
    base = getattr(arr, "base", None)
    for _ in range(16):
        if base is None:
            return
        yield base
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else None


def is_mapped(src: Any) -> bool:
    """True for np.memmap / np.load(mmap_mode=...) arrays and mmap objects."""
    if isinstance(src, (mmap.mmap, np.memmap)):
        return True
    return isinstance(src, np.ndarray) and any(isinstance(b, mmap.mmap) for b in base_chain(src))


def mapping_bytes(src: Any) -> int:
    """Size of the memory mapping under ``src`` (0 when it is not memory-mapped)."""
    if isinstance(src, mmap.mmap):
        return len(src)
    if isinstance(src, np.ndarray):
        for b in base_chain(src):
            if isinstance(b, mmap.mmap):
                try:
                    return len(b)
                except ValueError:  # closed
                    return 0
    return 0


def _maps_entry(addr: int) -> tuple[int, str] | None:
    """(file offset of ``addr``, path) from /proc/self/maps, or None."""
    parts = _maps_lines([addr]).get(addr)
    if parts is None:
        return None
    try:
        return int(parts[2], 16) + addr - int(parts[0].partition("-")[0], 16), parts[5].strip()
    except ValueError:
        return None


class _MappedFile:
    """A read-only descriptor of a file that a source maps, matched to the mapping, for the
    RowBatches' size checks (Note [native epochs] in src/py/row_batches.c). Closed with its last
    reference, never earlier: a RowBatches may outlive the loader that opened it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _maps_lines(addrs: list[int]) -> dict[int, list[str]]:
    """For each address, the /proc/self/maps line of the mapping holding it, split into its six
    fields (range, permissions, file offset, device, inode, path); one read of the file."""
    out: dict[int, list[str]] = {}
    want = sorted(set(addrs))
    if not want:
        return out
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) != 6:
                    continue
                lo_s, _, hi_s = parts[0].partition("-")
                lo, hi = int(lo_s, 16), int(hi_s, 16)
                i = bisect.bisect_left(want, lo)  # want is sorted: O(log n) per line
                while i < len(want) and want[i] < hi:
                    out[want[i]] = parts
                    i += 1
    except (OSError, ValueError, IndexError):
        pass
    return out


def open_mapped_files(leaves: Iterable[tuple[str, Any, Any, Any]]
                       ) -> dict[str, tuple[_MappedFile | None, mmap.mmap | MappedName, int, str]]:
    """Per file-mapped leaf (by path) of ``leaves`` (a plan's ``(path, source, mapped, shape)``):
    a _MappedFile of the very file it maps (_open_matching: a name now naming another file, a
    FIFO or nothing at all gives None), and the mapping, the file size it needs and the file's
    name (file_mapping). Opened once per loader, one descriptor per file."""
    found: dict[str, tuple[tuple[mmap.mmap | MappedName, int, str], int | None]] = {}
    for path, src, _, _ in leaves:
        fm = file_mapping(src)
        if fm is not None:
            if isinstance(fm[0], MappedName):
                found[path] = (fm, fm[0].addr)
                continue
            try:
                found[path] = (fm, np.frombuffer(fm[0], dtype=np.uint8).ctypes.data)
            except (ValueError, TypeError, BufferError):
                found[path] = (fm, None)
    lines = _maps_lines([a for _, a in found.values() if a is not None])
    keys = {path: _maps_key(lines.get(addr)) if addr is not None else None for path, (_, addr) in found.items()}
    names: dict[tuple[int, int, int], str] = {}
    for path, ((_, _, name), _) in found.items():
        if (key := keys[path]) is not None:
            names.setdefault(key, name)
    by_file = _open_matching(names)
    return {path: (by_file.get(key) if (key := keys[path]) is not None else None, m, need, name)
            for path, ((m, need, name), _) in found.items()}


def _maps_key(parts: list[str] | None) -> tuple[int, int, int] | None:
    """(device major, minor, inode) of a /proc/self/maps line split by _maps_lines."""
    if parts is None:
        return None
    try:
        major, _, minor = parts[3].partition(":")
        return int(major, 16), int(minor, 16), int(parts[4])
    except ValueError:
        return None


_PROBES_PER_READ = 128  # files probed per read of /proc/self/maps (each probe holds a descriptor)


def _open_matching(names: dict[tuple[int, int, int], str]) -> dict[tuple[int, int, int], _MappedFile]:
    """Per ``key``: a descriptor of the file at ``names[key]`` if it is the file whose mapping
    /proc/self/maps names by ``key`` (absent otherwise). Each descriptor's own file is mapped for
    a moment (one page) and its line in /proc/self/maps compared with ``key``: both lines come
    from the same kernel code, so they agree on any file system. A stat() does not: on a btrfs
    subvolume (and on overlayfs with some kernels) st_dev is not the device /proc/self/maps
    shows, and a stat() match refused every such file (each epoch then took the GIL per batch).
    Files are probed _PROBES_PER_READ at a time, with one read of /proc/self/maps each time: a
    read per file cost O(files x mappings), 24 s for 3,000 mapped files, and a probe's mmap
    holds a second descriptor until it is closed."""
    items = list(names.items())
    out: dict[tuple[int, int, int], _MappedFile] = {}
    for i in range(0, len(items), _PROBES_PER_READ):
        out.update(_probe_files(items[i:i + _PROBES_PER_READ]))
    return out


def _probe_files(items: list[tuple[tuple[int, int, int], str]]) -> dict[tuple[int, int, int], _MappedFile]:
    probes: dict[tuple[int, int, int], tuple[_MappedFile, mmap.mmap, int]] = {}
    try:
        for key, name in items:
            try:
                if not stat.S_ISREG(os.stat(name).st_mode):
                    continue  # a FIFO or a device now has the name: never opened
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
            except (OSError, ValueError, TypeError):
                continue  # gone, unreadable, or out of descriptors: the generator checks instead
            f = _MappedFile(fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                probe = mmap.mmap(fd, 1, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                continue  # emptied (nothing to map) or not mappable: the generator checks instead
            try:
                view = np.frombuffer(probe, dtype=np.uint8)
                addr = view.ctypes.data
                del view  # the buffer export, before the mapping closes
            except BaseException:
                probe.close()
                raise
            probes[key] = (f, probe, addr)
        lines = _maps_lines([addr for _, _, addr in probes.values()])
        return {key: f for key, (f, _, addr) in probes.items() if _maps_key(lines.get(addr)) == key}
    finally:
        for _, probe, _ in probes.values():
            probe.close()


def _owners(src: Any) -> Iterator[Any]:
    """``src`` and what it views: array bases, and the object under a memoryview."""
    for _ in range(32):
        yield src
        if isinstance(src, np.ndarray):
            src = src.base
        elif isinstance(src, memoryview):
            try:
                src = src.obj
            except ValueError:  # released
                return
        else:
            return
        if src is None:
            return


class MappedName:
    """A file mapped under a source that hides its mmap (a torch tensor made by
    ``torch.from_numpy`` over a memmap, ``torch.from_file``), found by address in
    /proc/self/maps: what file_mapping gives in place of the mmap. ``size()`` stats the file by
    name, for the generator's check; ``addr`` is the source's first byte."""

    __slots__ = ("name", "addr")

    def __init__(self, name: str, addr: int) -> None:
        self.name, self.addr = name, addr

    def size(self) -> int:
        return os.stat(self.name).st_size


def _byte_bounds(src: Any) -> tuple[int, int] | None:
    """[lo, hi) of the bytes ``src`` spans, read through DLPack (None: not readable so)."""
    if not hasattr(src, "__dlpack__"):
        return None
    try:
        a = np.from_dlpack(src)
        bounds = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None) or \
            getattr(np, "byte_bounds")  # NumPy 1.x
        lo, hi = bounds(a)
    except Exception:  # noqa: BLE001 -- not an array NumPy reads: the loader reports it elsewhere
        return None
    return (int(lo), int(hi)) if hi > lo else None


def _mapped_by_address(src: Any) -> tuple[MappedName, int, str] | None:
    """The file mapping under a source whose owners hide it: the mapping /proc/self/maps gives
    for its bytes (one mapping of a named file that still exists), the file size its last byte
    needs, and the file's name."""
    bounds = _byte_bounds(src)
    if bounds is None:
        return None
    lo, hi = bounds
    lines = _maps_lines([lo, hi - 1])
    parts = lines.get(lo)
    if parts is None or lines.get(hi - 1) is not parts:
        return None  # not mapped, or over several mappings
    name = parts[5].strip()
    try:
        inode = int(parts[4])
        start = int(parts[0].partition("-")[0], 16)
        need = int(parts[2], 16) + hi - start
    except ValueError:
        return None
    if not inode or not name.startswith("/") or name.endswith(" (deleted)"):
        return None  # anonymous memory, or a file no name reaches any more
    return MappedName(name, lo), need, name


def file_mapping(src: Any) -> tuple[mmap.mmap | MappedName, int, str] | None:
    """The file mapping under ``src``: (its mmap, the file size it needs, the file's name), or
    None when ``src`` maps no file (Note [truncated mappings] in pinloader/_epoch_plan.py). A source whose owners hide the
    mmap is found by address instead (_mapped_by_address)."""
    owners = list(_owners(src))
    m = next((b for b in owners if isinstance(b, mmap.mmap)), None)
    if m is None:
        last = owners[-1]
        if isinstance(last, (bytes, bytearray)) or (isinstance(last, np.ndarray) and last.base is None):
            return None  # memory NumPy or Python allocated: no file under it
        return _mapped_by_address(src)
    try:
        if m.closed or len(m) == 0:
            return None
        m.size()  # an anonymous mapping has no file: OSError
    except (OSError, ValueError):
        return None
    mm = next((b for b in _owners(src) if isinstance(b, np.memmap) and getattr(b, "_mmap", None) is m), None)
    if mm is not None and isinstance(getattr(mm, "offset", None), int):
        start = mm.offset - mm.offset % mmap.ALLOCATIONGRANULARITY
        return m, start + len(m), str(mm.filename)
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    where = _maps_entry(addr)
    start, name = where if where is not None else (0, "(unknown file)")
    return m, start + len(m), name
