"""The epoch plan of an ArrayLoader (pinloader/array_loader.py): which items each rank takes in
an epoch, in what order, and the epoch's batches the loader's prefetcher places in its structure
(AsyncPrefetcher's structure=): a RowBatches, whose batches the prefetcher makes in C without
the GIL (Note [native epochs] in src/py/gather.c), or, where a file-mapped source's file cannot
be opened for its size check, a generator of tuples of RowGather leaves. Shared by the loader
and by the resumed epoch (pinloader/_resume.py), which both build on it; it imports neither."""
from __future__ import annotations

import bisect
import mmap
import os
import stat
import threading
from typing import Any, Iterator

import numpy as np

from ._C import Registration, RowBatches, RowGather, _epoch_table, permutation


def _base_chain(arr: Any) -> Iterator[Any]:
    base = getattr(arr, "base", None)
    for _ in range(16):
        if base is None:
            return
        yield base
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else None


def _is_mapped(src: Any) -> bool:
    """True for np.memmap / np.load(mmap_mode=...) arrays and mmap objects."""
    if isinstance(src, (mmap.mmap, np.memmap)):
        return True
    return isinstance(src, np.ndarray) and any(isinstance(b, mmap.mmap) for b in _base_chain(src))


def _mapping_bytes(src: Any) -> int:
    """Size of the memory mapping under ``src`` (0 when it is not memory-mapped)."""
    if isinstance(src, mmap.mmap):
        return len(src)
    if isinstance(src, np.ndarray):
        for b in _base_chain(src):
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
    RowBatches' size checks (Note [native epochs] in src/py/gather.c). Closed with its last
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


def _open_mapped_files(plan: _Plan) -> dict[str, tuple[_MappedFile | None, mmap.mmap | _MappedName, int, str]]:
    """Per file-mapped leaf (by path): a _MappedFile of the very file it maps (_open_matching:
    a name now naming another file, a FIFO or nothing at all gives None), and the mapping, the
    file size it needs and the file's name (_file_mapping). Opened once per loader, one
    descriptor per file."""
    found: dict[str, tuple[tuple[mmap.mmap | _MappedName, int, str], int | None]] = {}
    for path, src, _, _ in plan.leaves:
        fm = _file_mapping(src)
        if fm is not None:
            if isinstance(fm[0], _MappedName):
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


class _MappedName:
    """A file mapped under a source that hides its mmap (a torch tensor made by
    ``torch.from_numpy`` over a memmap, ``torch.from_file``), found by address in
    /proc/self/maps: what _file_mapping gives in place of the mmap. ``size()`` stats the file by
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


def _mapped_by_address(src: Any) -> tuple[_MappedName, int, str] | None:
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
    return _MappedName(name, lo), need, name


def _file_mapping(src: Any) -> tuple[mmap.mmap | _MappedName, int, str] | None:
    """The file mapping under ``src``: (its mmap, the file size it needs, the file's name), or
    None when ``src`` maps no file. Note [truncated mappings]. A source whose owners hide the
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


class _Plan:
    """What an epoch's generator needs; shared by the loader and the prefetcher's source (the
    source must not reference the loader, which holds the prefetcher)."""

    epoch = 0
    cache: tuple[int, np.ndarray] | None = None
    ahead: _AheadOrder | None = None  # the next epoch's order, being made (Note [orders made ahead])
    native = True  # RowBatches where it can be (False: the generator; for tests)
    source_kind = ""  # the last epoch's: "native" (a RowBatches) or "generator"
    source_reason = ""  # why the generator, when it was
    files: dict[str, Any] | None = None  # _open_mapped_files, made at the first native epoch
    leaves: list[Any] = []
    regs: dict[str, Registration] = {}  # leaf path -> its registration for the device gather
    dtypes: dict[str, Any] = {}  # leaf path -> the source's dtype when the loader was made
    batch_size = n_batches = num_rows = num_items = num_samples = rank = seed = 0
    world_size = 1
    window: int | None = None
    shuffle = drop_last = False


def _order(plan: _Plan, epoch: int) -> np.ndarray:
    """The rank's item order of an epoch: see the module documentation."""
    cache = plan.cache
    if cache is not None and cache[0] == epoch:
        return cache[1]
    order = _take_ahead(plan, epoch)
    if order is None:
        order = _make_order(plan, epoch)
    plan.cache = (epoch, order)
    return order


def _make_order(plan: _Plan, epoch: int) -> np.ndarray:
    """The order _order caches, made from the plan's settings only (a thread of its own may
    make it: Note [orders made ahead])."""
    n, L = plan.num_items, plan.window
    spare = 0 if L is None else plan.num_rows - n * L
    if plan.shuffle:
        phase, order = permutation(n, plan.seed, epoch, spare)
    else:
        phase, order = 0, np.arange(n, dtype=np.int64)
    world, count = plan.world_size, plan.num_samples
    if world > 1 and count:
        # Items rank, rank + world, ... of the epoch's order padded by wrapping around to its
        # start (or cut) to num_samples * world items: item j of that is order[j % n]. Only
        # the rank's own num_samples positions are made, whatever world_size is.
        if count == 1:
            pos = np.array([plan.rank % n], dtype=np.int64)
        else:  # world < n here, so the positions stay below 2 * n
            pos = np.arange(count, dtype=np.int64) * world + plan.rank
            if pos[-1] >= n:
                pos %= n
        order = order[pos]
    else:
        order = order[:count]
    if L is not None:
        order = phase + order * L
    # read-only, and read in place by the batches' RowGathers (Note [epoch row tables] in
    # src/py/gather.c); the unsharded order of plain rows is permutation()'s own table
    return _epoch_table(order)


# Note [orders made ahead]
# An epoch's order is a permutation of all its items (Note [epoch permutation] in
# src/py/gather.c), made when the epoch begins, in time linear in the items (tens of
# milliseconds for millions of rows, one random access each). The prefetcher's producer stops at an epoch's end until the next iter() (Note [epochs] in
# src/py/prefetcher.c), so a loop across epochs would wait that long for the next epoch's first
# batch, every epoch: for a short epoch of small rows, longer than the batches themselves take.
# So once an epoch has begun, the order of the epoch that follows it by default (the next one;
# a set_epoch() to it, as DistributedSampler users call it, names the same) is made on a
# thread of its own (permutation() releases the GIL), and _order takes it from there: at once
# if it is done, else after waiting for the rest of it. The order is a pure function of the
# plan's settings and the epoch; the job copies both (the settings, and _order_key to match
# them by) and is used only by a plan of the same settings (the resumed epoch's plan, a copy with other sharding, makes its
# own). Orders of fewer than _AHEAD_MIN_ITEMS items are made in place (a thread costs more
# than they do). A forked child never waits for a thread of its parent (it does not exist
# there): it makes the order itself. A job that failed (out of memory) leaves the order to be
# made, and its error raised, where it is needed. Memory: while the next epoch's order is made
# the current one is still read, two tables of 8 bytes an item.
_AHEAD_MIN_ITEMS = 1 << 16


def _order_key(plan: _Plan, epoch: int) -> tuple[Any, ...]:
    return (epoch, plan.num_items, plan.num_rows, plan.window, plan.shuffle, plan.seed,
            plan.world_size, plan.rank, plan.num_samples)


class _AheadOrder:
    """An epoch's order being made on a thread of its own (Note [orders made ahead])."""

    def __init__(self, plan: _Plan, epoch: int) -> None:
        self.key = _order_key(plan, epoch)
        self.pid = os.getpid()
        self.order: np.ndarray | None = None
        # the settings _make_order reads, as they are now (no sources, no tables)
        settings = _Plan()
        for name in ("num_items", "num_rows", "window", "shuffle", "seed", "world_size", "rank",
                     "num_samples"):
            setattr(settings, name, getattr(plan, name))
        self.thread = threading.Thread(target=self._run, args=(settings, epoch), name="pl-epoch-order",
                                       daemon=True)

    def _run(self, settings: _Plan, epoch: int) -> None:
        try:
            self.order = _make_order(settings, epoch)
        except BaseException:  # noqa: BLE001 -- made again where it is needed, which raises
            self.order = None


def prepare_order(plan: _Plan, epoch: int) -> None:
    """Start making ``epoch``'s order on a thread of its own (Note [orders made ahead])."""
    if plan.num_items < _AHEAD_MIN_ITEMS:
        return
    key = _order_key(plan, epoch)
    job = plan.ahead
    if (job is not None and job.key == key and job.pid == os.getpid()) or \
            (plan.cache is not None and plan.cache[0] == epoch):
        return
    job = _AheadOrder(plan, epoch)
    try:
        job.thread.start()
    except RuntimeError:  # no thread to be had: the order is made when it is needed
        return
    plan.ahead = job


def _take_ahead(plan: _Plan, epoch: int) -> np.ndarray | None:
    """The order of ``epoch`` made ahead for this plan, waiting for its thread if needed; None
    when there is none (or it failed)."""
    job = plan.ahead
    if job is None or job.key != _order_key(plan, epoch):
        return None
    if job.pid != os.getpid():  # the thread was the parent's (a fork() since)
        plan.ahead = None
        return None
    job.thread.join()  # interruptible: a Ctrl-C leaves the job for the next attempt
    plan.ahead = None
    return job.order


class _Epochs:
    """The re-iterable source given to the AsyncPrefetcher: each iter() is one epoch."""

    def __init__(self, plan: _Plan) -> None:
        self._plan = plan

    def __len__(self) -> int:
        return self._plan.n_batches

    def __iter__(self) -> Iterator[Any]:
        return _epoch_batches(self._plan, self._plan.epoch)


def _check_shape(path: str, src: Any, shape: tuple[int, ...]) -> None:
    """Raise a clear error if the source no longer has the shape the loader was made for."""
    try:
        now = RowGather(src, ()).source_shape
    except Exception as e:
        raise ValueError(f"{path}: the source can no longer be read ({e})") from None
    if now != shape:
        raise ValueError(f"{path}: the source changed shape from {shape} to {now} under the "
                         "ArrayLoader (resized or replaced while loading)")


def _truncated(path: str, m: mmap.mmap | _MappedName, need: int, name: str) -> ValueError:
    try:
        now = f"{m.size()} bytes"
    except (OSError, ValueError) as e:
        now = f"unreadable ({e})"
    return ValueError(f"{path}: the memory-mapped file {name} was truncated on disk while "
                      f"loading: it is now {now}, the mapping needs {need} (the dataset was "
                      "rewritten or cut short under the ArrayLoader)")


def _row_gather(plan: _Plan, path: str, src: Any, shape: tuple[int, ...], rows: Any,
                ahead: Any = None) -> RowGather:
    """A RowGather of ``rows`` of ``src`` (with ``ahead`` read ahead), with the leaf's
    registration: its own view of the source, checked against the shape and dtype the loader
    was made with. Over no rows, it is a RowBatches' probe."""
    try:
        g = RowGather(src, rows, plan.window, ahead, plan.regs.get(path))
    except (IndexError, ValueError, TypeError, BufferError) as e:
        _check_shape(path, src, shape)
        raise type(e)(f"{path}: {e}") from None
    if g.source_shape != shape:
        _check_shape(path, src, shape)
    if g.dtype != plan.dtypes[path]:
        raise ValueError(f"{path}: the source changed dtype from {plan.dtypes[path]} to "
                         f"{g.dtype} under the ArrayLoader")
    return g


def _epoch_batches(plan: _Plan, epoch: int, resumed: tuple[np.ndarray, int] | None = None) -> Iterator[Any]:
    """The epoch's batches: a RowBatches (Note [native epochs] in src/py/gather.c), or the
    generator where a mapped file cannot be opened for its size check. A source found changed
    or cut short is the first batch's error, as the generator reports it, not iter()'s.
    ``resumed``: the resumed epoch's order and batch count (pinloader/_resume.py), in place of
    the whole epoch's."""
    if not plan.native:
        plan.source_kind, plan.source_reason = "generator", "native epochs turned off"
        return _epoch_generator(plan, epoch, resumed)
    plan.source_kind, plan.source_reason = "native", ""
    try:
        order, n_batches = resumed or (_order(plan, epoch), plan.n_batches)
        if plan.files is None:
            plan.files = _open_mapped_files(plan)
        leaves: list[tuple[str, RowGather, bool, Any, int, str | None]] = []
        for path, src, mapped, shape in plan.leaves:
            file, need, name = None, 0, None
            if path in plan.files:
                file, m, need, name = plan.files[path]
                if file is None:
                    plan.source_kind = "generator"
                    plan.source_reason = (f"{path}: the file it maps ({name}) could not be opened for its "
                                          "size check (renamed, deleted or unreadable): each batch takes the GIL")
                    return _epoch_generator(plan, epoch, resumed)
                try:
                    now = os.fstat(file.fileno()).st_size
                except OSError:
                    now = -1
                if now < need:
                    raise _truncated(path, m, need, name)
            probe = _row_gather(plan, path, src, shape, np.empty(0, np.int64))
            leaves.append((path, probe, mapped, file, need, name))
        return RowBatches(leaves, order, plan.batch_size, n_batches)
    except Exception as e:  # noqa: BLE001 -- raised by the first next(), as the generator did
        return _raise_at_first_batch(e)


def _raise_at_first_batch(e: Exception) -> Iterator[Any]:
    raise e
    yield  # a generator


def _epoch_generator(plan: _Plan, epoch: int, resumed: tuple[np.ndarray, int] | None = None) -> Iterator[Any]:
    # Note [truncated mappings]
    # Rows of a mapping past the end of its file fault with SIGBUS when a staging thread reads
    # them, which kills the process: another job may rewrite or cut the dataset at any time.
    # Before each batch is read, each file-mapped leaf's file size is checked against the end of
    # its mapping (one fstat), and a shorter file is an error naming the leaf and the file. A
    # RowBatches checks it in C, on a descriptor _open_mapped_files matched to the mapping
    # (Note [native epochs] in src/py/gather.c); this generator, used where no such descriptor
    # can be had, checks it with mmap.size() before the batch's RowGathers exist. A file cut
    # while a batch is being staged, after its check, is not caught: the check narrows the
    # window to one batch.
    order, n_batches = resumed or (_order(plan, epoch), plan.n_batches)
    bs = plan.batch_size
    any_mapped = any(mapped for _, _, mapped, _ in plan.leaves)
    files = [(path, *fm) for path, src, _, _ in plan.leaves
             if (fm := _file_mapping(src)) is not None]
    for b in range(n_batches):
        for path, m, need, name in files:
            try:
                ok = m.size() >= need
            except (OSError, ValueError):
                ok = False
            if not ok:
                raise _truncated(path, m, need, name)
        lo = b * bs
        rows = order[lo:lo + bs]
        # Note [read-ahead] in src/py/gather.c: the next batch's rows (the first batch's own too)
        ahead = order[(lo + bs if b else lo):lo + 2 * bs] if any_mapped else None
        leaves = [_row_gather(plan, path, src, shape, rows, ahead if mapped else None)
                  for path, src, mapped, shape in plan.leaves]
        yield tuple(leaves)  # placed in the loader's structure by the prefetcher (structure=)
