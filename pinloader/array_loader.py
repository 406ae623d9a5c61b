"""ArrayLoader: batches of rows of in-memory or memory-mapped arrays, gathered straight into
pinned memory by the prefetcher's staging threads (or read by a kernel on the GPU straight from
the registered sources) and copied to the device.

The loader is a second kind of *source* for :class:`pinloader.AsyncPrefetcher`, not a second
pipeline: each epoch is a :class:`pinloader._C.RowBatches` (made with the GIL when the epoch
begins), whose batches the prefetcher's producer makes in C without taking the GIL at all
(Note [native epochs] in ``src/py/row_batches.c``): the training thread never lends it the GIL.
The prefetcher places each batch's leaves in the structure of ``arrays`` it captured once
(``structure=``); the staging threads read the rows from the sources into the pinned region
(the only host copy), then the batch is copied to the device like any other.

Sampling (see ``ArrayLoader.indices``)
--------------------------------------
* Items: the rows of the arrays, or with ``windows=L`` the ``W = N // L`` windows of ``L``
  consecutive rows per epoch (``N`` rows in the sources). Window ``k`` of an epoch covers rows
  ``[phase + k*L, phase + (k+1)*L)``; ``phase`` is drawn per epoch in ``[0, N - W*L]``, so the
  window boundaries move from epoch to epoch while windows never overlap within one.
* ``shuffle=True``: the items are visited in the order of a seeded permutation specified in
  ``src/py/epoch_table.c`` (Note [epoch permutation]: SplitMix64 keyed by ``(seed, epoch)``, Lemire's
  unbiased bounded integers, Fisher-Yates), identical on every machine and NumPy version.
  ``shuffle=False``: in order, ``phase = 0``.
* Sharding (``world_size > 1``), as ``torch.utils.data.DistributedSampler`` does: with
  ``drop_last=False`` the epoch's order is padded by wrapping around to its start until it
  divides by ``world_size``; with ``drop_last=True`` its tail is dropped instead. Rank ``r``
  takes items ``r, r + world_size, r + 2*world_size, ...`` of that order: the shards are
  disjoint (up to the padding) and equal in size, and together cover the epoch.
* Batches: consecutive runs of ``batch_size`` items of the rank's shard; ``drop_last=True``
  also drops the last partial batch.
* Epochs: the first iteration is epoch 0 (or the value given to :meth:`ArrayLoader.set_epoch`);
  each later iteration is the next epoch unless ``set_epoch`` was called since.

Resuming (``ArrayLoader.state_dict`` / ``ArrayLoader.load_state_dict``)
-----------------------------------------------------------------------
* Let ``O`` be an epoch's order of its ``n`` items before sharding (the order of the loader
  with ``world_size=1``), and ``P[i] = O[i mod n]`` its cyclic continuation: the loader's
  sharded epoch is ``P[0:S*W]`` dealt round-robin to the ``W`` ranks (``S`` items each;
  ``drop_last=True`` cuts ``P`` at ``S*W <= n`` instead of padding).
* A state records the epoch the next batch comes from and its *position* ``g``: how many items
  of ``P`` the ranks together were handed, counted where the training loop takes the batches
  (batches prefetched but not yet handed out do not count). Each rank counts its own ``c``
  items handed out and records ``g = c*W``: this assumes every rank took as many batches as
  the others, as DistributedDataParallel's lockstep does, so every rank's state holds the same
  position and any one of them (rank 0's) can resume all ranks. Items, not batches, are
  counted, so a state also resumes a loader with another ``batch_size``.
* Resuming at position ``g`` with ``W'`` ranks (``W' = W`` or any other world size): the
  epoch's remaining items are ``P[g:n]`` (``O`` minus the items the ranks took). With
  ``drop_last=False`` they are padded by continuing ``P`` (wrapping around to the epoch's
  first items) to the next multiple of ``W'``; with ``drop_last=True`` they are cut to the
  multiple of ``W'`` below. Rank ``r`` takes items ``r, r + W', r + 2*W', ...`` of that, in
  batches of ``batch_size`` (``drop_last=True`` drops the last partial batch). The shares are
  disjoint up to the padding, equal in size and together cover the remaining items; with
  ``W' = W`` they are exactly what the uninterrupted run would have handed out next, since
  ``P[g:S*W]`` is where its shards were headed. :meth:`ArrayLoader.indices_after` gives a
  rank's share. A position at the epoch's end (``g >= n``) resumes at the next epoch's start.
* The following epochs are sharded as usual (``indices(epoch)``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _C, _device, _resume
from ._C import AsyncPrefetcher, Registration, RowGather, register_rows
from ._epoch_plan import Epochs, Plan, epoch_order
from ._iter_state import IterState
from ._loader_base import EpochLoader, epoch_arg, int_arg, prefetch_opts_arg, rank_world
from ._mapped import base_chain, is_mapped, mapping_bytes

__all__ = ["ArrayLoader"]

_DEFAULT_DEPTH = 3  # a third batch in flight lets loader-bound large batches reach the DMA ceiling
_GATHER_MODES = ("auto", "host", "device")
# gather="auto" reads items of at least this many bytes with the device gather (the kernel
# over registered host memory) and smaller ones with the host gather. From this size on the
# device gather moves more bytes per second than the host gather, and it costs the host far
# less CPU and memory traffic; below it, the kernel needs its rows sorted (Note [device gather]
# in src/core/devgather.h) and the sort costs the producer more than the host gather does.
# The measurements: benchmarks/results/design_measurements.md.
_DEVICE_GATHER_MIN_SPAN = 256


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _wants_readahead(src: Any, readahead: bool | None) -> bool:
    """Note [read-ahead] in src/py/row_gather.c. Advice costs a system call per row range (a few
    microseconds each), which pays off only when the rows must come from storage: by default
    it is given for mappings larger than the memory available to the page cache."""
    if readahead is not None:
        return bool(readahead) and is_mapped(src)
    size = mapping_bytes(src)
    avail = _mem_available()
    return size > 0 and avail is not None and size > avail


def _hold(src: Any) -> list[memoryview]:
    """Buffer exports that keep the object under ``src`` from being closed or resized while the
    loader lives (Python raises BufferError instead). A CPU torch tensor is held by the
    RowGathers themselves, the first of them made as the loader is (torch_hold in
    src/py/row_gather.c: torch refuses to resize its storage from then on)."""
    target = src
    if isinstance(src, np.ndarray):
        target = next((b for b in base_chain(src) if not isinstance(b, np.ndarray)), None)
    if target is None or isinstance(target, np.ndarray):
        return []
    try:
        return [memoryview(target)]
    except TypeError:
        return []


_UNSET: Any = object()


def _int_arg(name: str, value: Any, lo: int) -> int:
    return int_arg("ArrayLoader", name, value, lo)


_LOADER_KEYWORDS = ("batch_size", "shuffle", "seed", "drop_last", "device", "depth", "rank",
                    "world_size", "windows", "readahead", "gather", "max_registered_bytes")

class ArrayLoader(EpochLoader):
    """Shuffled, sharded batches of rows of arrays, gathered into pinned memory and copied to a
    device by native threads: no worker processes, no collate, no Python per sample.

    Parameters
    ----------
    arrays : array or nested tuple/list/dict/namedtuple of arrays
        NumPy arrays, ``np.memmap`` / ``np.load(..., mmap_mode="r")`` arrays, CPU DLPack
        exporters (torch CPU tensors...) or buffer-protocol objects, all with the same first
        dimension (the rows). Batches have the structure of ``arrays``, each leaf holding the
        batch's rows: shape ``(batch, *array.shape[1:])``, or with ``windows=L``
        ``(batch, L, *array.shape[1:])``. Sources are read in place and never pinned, so a
        memory-mapped file larger than RAM works; they are held (cannot be closed or resized)
        until :meth:`close`. A CPU torch tensor can no longer grow with ``resize_`` once given
        to an ArrayLoader, even after :meth:`close` (torch marks its storage not resizable, as
        for tensors made by ``torch.from_numpy``). A file mapping reached only through another
        object (a tensor made by ``torch.from_numpy`` over a memmap) cannot be held: closing
        that mapping under the loader crashes the process, as any read of a closed mapping
        would.
    batch_size : int
        Items per batch (rows, or windows).
    shuffle : bool, default True
        Seeded permutation per epoch (see the module documentation); False: in order.
    seed : int, default 0
        Any int (taken modulo 2**64). The same ``(seed, epoch, rank, world_size)`` gives the
        same batches on every run and machine.
    drop_last : bool, default False
        Drop the epoch's tail that does not divide among the ranks (instead of padding by
        wrapping around) and the last partial batch.
    device : default None
        As for :class:`pinloader.AsyncPrefetcher` (None: the current CUDA device, else the
        host backend). Under torchrun pass ``f"cuda:{LOCAL_RANK}"``.
    depth : int, default 3
        Batches in flight or waiting.
    rank, world_size : int, optional
        This process's shard. Defaults: an initialised ``torch.distributed`` process group,
        else the ``RANK`` / ``WORLD_SIZE`` environment variables, else 0 / 1.
    windows : int, optional
        Sample windows of this many consecutive rows (token streams) instead of rows.
    gather : {"auto", "host", "device"}, default "auto"
        How a batch's rows reach the device. ``"host"``: the staging threads gather them into
        pinned memory and one DMA copies the batch (three touches of host memory per byte).
        ``"device"``: each source is registered with the CUDA driver once (page-locked and
        mapped, read-only where the device supports it) and a kernel on the copy stream reads
        the rows straight from host memory into the batch (one touch, no staging threads, no
        pinned memory for the data); a source that cannot be (rows that are not contiguous
        spans, over ``max_registered_bytes``, refused by the driver) is an error naming the
        leaf. ``"auto"``: the device gather on CUDA for every leaf it can serve whose items
        are at least 256 bytes (below that the host gather is faster), else the
        host gather, with the reason in :meth:`stats` (``gather_leaves``). The host backend
        implements ``"device"`` too (same semantics, a copy on its stream thread); ``"auto"``
        picks ``"host"`` there. Batches, events and lifetimes are the same either way.
    max_registered_bytes : int, optional
        Budget of host memory this process may register for the device gather (sources
        already page-locked do not count). Default: the default pinned pool's cap (a quarter
        of RAM, at most half of ``RLIMIT_MEMLOCK``, divided among ``LOCAL_WORLD_SIZE``
        ranks): a dataset that does not fit comfortably is never locked in RAM.
    readahead : bool, optional
        Advise the kernel (``madvise(MADV_WILLNEED)``) about the next batch's rows of
        memory-mapped sources while the current batch is gathered. Default: only for mappings
        larger than the memory available (``MemAvailable``), whose rows come from storage;
        for a file the page cache holds, the advice would only cost system calls.
    **prefetch_opts
        Passed to :class:`pinloader.AsyncPrefetcher` (``max_pinned_bytes``, ``pool``,
        ``staging_threads``, ``copy_stream_priority``, ``output``, ``stream``, ``convert``,
        ``static``, ``out``); any other keyword is a ``TypeError`` here. With ``static=True``
        the static buffers hold ``batch_size`` rows.

    Notes
    -----
    Iterating the loader runs one epoch and yields the batches as the prefetcher does
    (DeviceArrays; ``pinloader.torch.prefetch(loader)``, ``pinloader.jax.prefetch`` and
    ``pinloader.cupy.prefetch`` wrap this loader's own prefetcher and yield framework arrays).
    One prefetcher is kept across epochs; after an error (a source closed, resized or
    unreadable) the next iteration starts a new one, so the error is raised again rather than
    the loader going silently empty. A framework door over the loader iterates that
    prefetcher with the door's settings for its own iterations only: a door can be made per
    epoch, and doors and plain iterations can take turns (Note [doors over a loader] in
    pinloader/_loader_base.py).

    The loader is its own iterator: ``iter(loader)`` starts the next epoch and returns the
    loader itself (like a file object, unlike a ``DataLoader``). So two loops over one loader at
    the same time share one stream of batches: ``zip(loader, loader)`` or a loop nested in
    another over the same loader splits one epoch between them (each gets every other batch),
    and a ``break`` followed by a new ``for`` starts a new epoch. Use one ``ArrayLoader`` per
    independent stream of batches.
    """

    _NAME = "ArrayLoader"
    _DEFAULT_DEPTH = _DEFAULT_DEPTH

    def __init__(self, arrays: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, device: Any = None, depth: int | None = None,
                 rank: int | None = None, world_size: int | None = None, windows: int | None = None,
                 readahead: bool | None = None, gather: str = "auto",
                 max_registered_bytes: int | None = None, **prefetch_opts: Any) -> None:
        self._pf: AsyncPrefetcher | None = None
        self._holds: list[memoryview] = []
        self._regs: dict[str, Registration] = {}
        self._reg_device: Any = _UNSET
        self._gather_info: list[dict[str, Any]] = []
        self._closed = False
        if gather not in _GATHER_MODES:
            raise ValueError(f"ArrayLoader: gather must be one of {', '.join(map(repr, _GATHER_MODES))}, "
                             f"not {gather!r}")
        self.gather = gather
        self._max_registered = (None if max_registered_bytes is None
                                else _int_arg("max_registered_bytes", max_registered_bytes, 0))
        self.batch_size = _int_arg("batch_size", batch_size, 1)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"ArrayLoader: seed must be an int, not {type(seed).__name__}")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._device = _device.canonical(device, "ArrayLoader")
        self._depth = None if depth is None else _int_arg("depth", depth, 1)
        self._opts = prefetch_opts_arg("ArrayLoader", prefetch_opts, _LOADER_KEYWORDS)
        # the (device, depth, options) the running prefetcher was made with (Note [doors over a
        # loader])
        self._pf_settings: tuple[Any, int, dict[str, Any]] | None = None

        self.rank, self.world_size = rank_world("ArrayLoader", rank, world_size)

        # The structure is walked by the prefetcher's own walker (src/py/flatten.c), here for
        # the leaves and their paths, and once more by AsyncPrefetcher(structure=arrays), which
        # keeps it: each batch is then a flat tuple of RowGathers placed in that structure in C.
        leaves, others = _C.leaves(arrays, "arrays")
        if others:
            path, obj = others[0]
            raise TypeError(f"{path}: ArrayLoader needs arrays (NumPy arrays, memory maps, DLPack "
                            f"or buffer-protocol objects), got {type(obj).__name__}")
        if not leaves:
            raise ValueError("ArrayLoader: arrays holds no array")
        self.windows = None if windows is None else _int_arg("windows", windows, 1)
        plan_leaves = []
        dtypes: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        empty = np.empty(0, np.int64)
        for path, src in leaves:
            if src is None or isinstance(src, (str, bytes, int, float, complex)):
                raise TypeError(f"{path}: ArrayLoader needs arrays, got {type(src).__name__}")
            try:
                probe = RowGather(src, empty)
            except (TypeError, ValueError, BufferError) as e:
                raise type(e)(f"{path}: {e}") from None
            shape = probe.source_shape
            lengths[path] = shape[0]
            # Each batch's RowGather takes its own view of the live source (Note [array sources]
            # in src/py/row_gather.c), checked against the shape and dtype seen here: a source
            # reshaped, retyped or resized in place since is a clear error, and changes made
            # while a batch is being gathered cannot reach the gather.
            plan_leaves.append((path, src, _wants_readahead(src, readahead), shape))
            dtypes[path] = probe.dtype
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{p}: {n}" for p, n in lengths.items())
            raise ValueError(f"ArrayLoader: the arrays must have the same first dimension, got {detail}")
        self.num_rows = next(iter(lengths.values()))
        if self.windows is not None and self.windows > self.num_rows:
            raise ValueError(f"ArrayLoader: windows={self.windows} is longer than the arrays "
                             f"({self.num_rows} rows)")
        for _, src, _, _ in plan_leaves:
            self._holds += _hold(src)

        # items per epoch, per rank
        self.num_items = self.num_rows if self.windows is None else self.num_rows // self.windows
        if self.drop_last:
            self.num_samples = self.num_items // self.world_size
        else:
            self.num_samples = -(-self.num_items // self.world_size)
        n_batches = (self.num_samples // self.batch_size if self.drop_last
                     else -(-self.num_samples // self.batch_size))

        plan = Plan()
        plan.leaves = plan_leaves
        plan.dtypes = dtypes
        self._structure = arrays
        plan.batch_size = self.batch_size
        plan.n_batches = n_batches
        plan.window = self.windows
        plan.num_rows, plan.num_items, plan.num_samples = self.num_rows, self.num_items, self.num_samples
        plan.rank, plan.world_size, plan.seed = self.rank, self.world_size, self.seed
        plan.shuffle, plan.drop_last = self.shuffle, self.drop_last
        self._plan = plan
        # where the iteration is: epochs, batches handed out, a loaded state to resume at
        self._it = IterState()
        self._source = _resume.ResumableEpochs(Epochs(plan), plan, self._it)

    # ---- the device gather ----

    def _register(self, device: Any) -> None:
        """Choose each leaf's gather for ``device`` and register the sources that the device
        gather reads: at the first iteration, once the device is final (a door may set it),
        and kept until :meth:`close`."""
        key = str(device)
        if self._reg_device == key:
            return
        self._release_registrations()
        info = []
        for path, src, _, shape in self._plan.leaves:
            mode, reason = self._choose_gather(path, src, shape, device)
            info.append({"leaf": path, "gather": mode, "reason": reason})
        self._gather_info = info
        self._plan.regs = dict(self._regs)
        self._reg_device = key

    def _choose_gather(self, path: str, src: Any, shape: tuple[int, ...], device: Any) -> tuple[str, str]:
        if self.gather == "host":
            return "host", "gather='host'"
        span = int(np.prod(shape[1:], dtype=np.int64)) * self._plan.dtypes[path].itemsize * (self.windows or 1)
        if self.gather == "auto" and span < _DEVICE_GATHER_MIN_SPAN:
            # decided before registering: pinning a source only to let it go again costs time
            return "host", f"items of {span} bytes: below {_DEVICE_GATHER_MIN_SPAN} bytes the host gather is faster"
        reg, why = register_rows(src, self.windows, device, self._max_registered)
        if reg is not None and self.gather == "auto":
            why = "the host backend: its staging threads are the host's gather" if reg.backend != "cuda" else ""
            if why:
                reg.close()
                reg = None
        if reg is None:
            if self.gather == "device":
                raise ValueError(f"{path}: gather='device' cannot serve this source: {why}")
            return "host", why
        self._regs[path] = reg
        return "device", ""

    def _release_registrations(self) -> None:
        for reg in self._regs.values():
            reg.close()
        self._regs = {}
        self._plan.regs = {}
        self._reg_device = _UNSET

    # ---- sampling ----

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's item order for ``epoch`` (int64, read-only): row indices, or with
        ``windows`` the first row of each window. Batch ``b`` of the epoch is items
        ``[b*batch_size, (b+1)*batch_size)`` of it, so a plain loop can reproduce the loader
        exactly."""
        epoch = epoch_arg("ArrayLoader", epoch)
        # a view whose base is the table's capsule, not the loader's cached array: nothing
        # handed out reaches the cache (ndarray.__setstate__ on the cached array would free
        # the table under it; see gather_epoch_view in src/py/epoch_table.c)
        return _C.epoch_view(epoch_order(self._plan, epoch))

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (as ``DistributedSampler.set_epoch``); 0 <=
        epoch < 2**63."""
        self._it.requested = epoch_arg("ArrayLoader", epoch)

    @property
    def epoch(self) -> int | None:
        """The epoch of the current (or last) iteration; None before the first."""
        return self._it.epoch

    # ---- iteration ----

    def _check_structure(self) -> None:
        """The prefetcher places leaf i of each batch where the structure's leaf i is when it
        is made (at the first iteration, and again after an error or a load_state_dict): a
        structure changed since the loader was made (a dict reordered, an entry replaced) would
        put each batch's arrays under the wrong names."""
        leaves, _ = _C.leaves(self._structure, "arrays")
        now = [(path, id(src)) for path, src in leaves]
        if now != [(path, id(src)) for path, src, _, _ in self._plan.leaves]:
            raise ValueError("ArrayLoader: arrays was changed after the loader was made (entries "
                             "added, removed, replaced or reordered); make a new ArrayLoader "
                             "over the new arrays")

    def _make_prefetcher(self, settings: tuple[Any, int, dict[str, Any]]) -> AsyncPrefetcher:
        self._check_structure()
        device, depth, opts = settings
        self._register(device)
        if opts.get("static") or opts.get("out") is not None:
            # the static buffers hold a whole batch even when the first batch is short (a
            # resumed epoch's near its end): Note [static batches] in src/py/handout.c
            opts = dict(opts, static_rows=self.batch_size)
        pf = AsyncPrefetcher(self._source, device=device, depth=depth, structure=self._structure,
                             **opts)
        self._pf_settings = settings
        return pf

    # ---- the rest ----

    @property
    def valid_rows(self) -> int | None:
        """The real rows of the last batch handed out when batches are static (``static=True``,
        an AsyncPrefetcher option), else None."""
        rows: int | None = self._pf.valid_rows if self._pf is not None else None
        return rows

    def stats(self) -> dict[str, Any]:
        """The prefetcher's :meth:`~pinloader.AsyncPrefetcher.stats` (empty before the first
        iteration) and the loader's epoch, rank and world size; how its batches are gathered
        (``gather``, ``gather_leaves``, ``registered_bytes``); and how the last epoch's batches
        were made: ``epoch_source`` ``"native"`` (in C, without the GIL) or ``"generator"``
        (a Python generator, one GIL hold per batch), with ``epoch_source_reason``."""
        s = dict(self._pf.stats()) if self._pf is not None else {}
        modes = {i["gather"] for i in self._gather_info}
        s.update(epoch=self._it.epoch, rank=self.rank, world_size=self.world_size,
                 batches_per_epoch=len(self),
                 gather=modes.pop() if len(modes) == 1 else "mixed",
                 gather_leaves=[dict(i) for i in self._gather_info],
                 registered_bytes=sum(r.nbytes for r in self._regs.values() if r.owned),
                 epoch_source=self._plan.source_kind, epoch_source_reason=self._plan.source_reason)
        return s

    def close(self) -> None:
        """Stop the prefetcher and release the sources. Idempotent."""
        if self._pf is not None:
            self._pf.close()
        self._closed = True
        # ranges are unregistered once no batch in flight reads them (Note [registered
        # sources] in src/core/devgather.h); the prefetcher's close() waited for those
        self._release_registrations()
        for mv in self._holds:
            mv.release()
        self._holds = []
        # What only iterations read goes too: the sources (their paths, shapes and dtypes stay,
        # for state_dict()), the structure, the epoch's table (8 bytes a row) and the mapped
        # files' descriptors. Settings stay: len(), indices(), state_dict() still answer.
        plan = self._plan
        plan.leaves = [(path, None, mapped, shape) for path, _, mapped, shape in plan.leaves]
        plan.files = None
        plan.release_orders()
        self._structure = None
        self._it.resume_run = None

    def __repr__(self) -> str:
        w = f", windows={self.windows}" if self.windows is not None else ""
        return (f"pinloader.ArrayLoader(rows={self.num_rows}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed}, rank={self.rank}, "
                f"world_size={self.world_size}{w}, batches={len(self)})")

    # ---- checkpoint and resume (pinloader/_resume.py; Resuming in the module documentation) ----

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is, as the training loop sees it: a small dict that JSON, torch.save
        and ``torch.distributed.checkpoint`` all store (torch's ``Stateful`` protocol).

        Keys: ``format``, ``version``; ``epoch`` (the epoch the next batch comes from) and
        ``position`` (items of that epoch's order the ranks together were handed, see Resuming
        in the module documentation), ``consumed`` (items this rank was handed of that epoch,
        informational: with another world size resumed, ``position // world_size``); the settings ``seed``, ``shuffle``, ``drop_last``, ``batch_size``,
        ``windows``, ``rank``, ``world_size``; ``sources`` (rows, and each leaf's path, shape and
        dtype). Only batches handed out count: those prefetched since are not part of it. A
        ``set_epoch`` not yet followed by an iteration is recorded as that epoch's start, and
        an epoch whose batches were all handed out as the next epoch's start."""
        return _resume.state_of(self, self._it, self._plan)

    def load_state_dict(self, state: dict[str, Any], *, allow_changed: Any = ()) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly of another process, rank
        or world size): the next iteration hands out exactly the batches that would have come
        next, and what was prefetched is discarded. A ``set_epoch`` of the state's epoch (as a
        training loop calls it) keeps the resume; another epoch starts that epoch whole.

        The state must have been saved for the same sources (shapes and dtypes), ``seed``,
        ``shuffle``, ``windows``, ``drop_last`` and ``batch_size``, else ``ValueError`` names
        the field. ``allow_changed`` (a set of those names) accepts a change on purpose: the
        loader keeps its own value and continues at the state's epoch and position (items,
        not batches), which is exact for ``batch_size``; for the others the remaining items
        are this loader's order from that position on. ``world_size`` may always differ: the
        remaining items are re-sharded (Resuming, in the module documentation); ``rank`` is
        not checked, since every rank's state holds the same position."""
        self._check_open()
        epoch, position = _resume.validate(self, self._plan, state, allow_changed)
        if self._pf is not None:  # what it prefetched is not what comes next
            self._pf.close()
            self._pf = None
        _resume.load(self._it, state, epoch, position, self.num_items, self.world_size)

    def indices_after(self, epoch: int, position: int) -> np.ndarray:
        """This rank's item order for what is left of ``epoch`` once the ranks together were
        handed its first ``position`` items (the state's ``epoch`` and ``position``): what a
        loader resumed there hands out, in batches of ``batch_size``. ``indices_after(e, 0)``
        equals ``indices(e)``."""
        for name, v in (("epoch", epoch), ("position", position)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"ArrayLoader: {name} must be an int, not {type(v).__name__}")
        if position < 0:
            raise ValueError(f"ArrayLoader: position must be >= 0, got {position}")
        epoch = epoch_arg("ArrayLoader", epoch)
        return _resume.resumed_order(self._plan, epoch, int(position))
