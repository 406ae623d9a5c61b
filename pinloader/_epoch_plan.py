"""The epoch plan of an ArrayLoader (pinloader/array_loader.py): which items each rank takes in
an epoch, in what order, and the epoch's batches the loader's prefetcher places in its structure
(AsyncPrefetcher's structure=): a RowBatches, whose batches the prefetcher makes in C without
the GIL (Note [native epochs] in src/py/row_batches.c), or, where a file-mapped source's file cannot
be opened for its size check, a generator of tuples of RowGather leaves. The files under
memory-mapped sources are found and opened by pinloader/_mapped.py. Shared by the loader and by
the resumed epoch (pinloader/_resume.py), which both build on it; it imports neither."""
from __future__ import annotations

import mmap
import os
from typing import Any, Iterator

import numpy as np

from ._C import Registration, RowBatches, RowGather, EpochTables, OrderJob
from ._mapped import file_mapping, MappedName, open_mapped_files


class Plan:
    """What an epoch's generator needs; shared by the loader and the prefetcher's source (the
    source must not reference the loader, which holds the prefetcher)."""

    epoch = 0
    cache: tuple[int, np.ndarray] | None = None
    # the orders of the epochs that come next, being made, and how many epochs ahead they are
    # made (Note [orders made ahead])
    ahead: tuple[_AheadOrder, ...] = ()
    ahead_depth = 1
    # the blocks of orders no longer used, for the next (Note [epoch table reuse] in
    # src/py/epoch_table.c); the loader makes one, and clears it when it closes
    tables: EpochTables | None = None
    native = True  # RowBatches where it can be (False: the generator; for tests)
    source_kind = ""  # the last epoch's: "native" (a RowBatches) or "generator"
    source_reason = ""  # why the generator, when it was
    files: dict[str, Any] | None = None  # open_mapped_files, made at the first native epoch
    leaves: list[Any] = []
    regs: dict[str, Registration] = {}  # leaf path -> its registration for the device gather
    dtypes: dict[str, Any] = {}  # leaf path -> the source's dtype when the loader was made
    batch_size = n_batches = num_rows = num_items = num_samples = rank = seed = 0
    world_size = 1
    window: int | None = None
    shuffle = drop_last = False

    def __init__(self) -> None:
        self.tables = EpochTables()

    def release_orders(self) -> None:
        """Drop the cached order, the job making the next one and the blocks kept for reuse
        (the loader's close()); orders asked for later are made without reuse."""
        self.cache, self.ahead = None, ()
        if self.tables is not None:
            self.tables.clear()
        self.tables = None


def epoch_order(plan: Plan, epoch: int) -> np.ndarray:
    """The rank's item order of an epoch: see the module documentation."""
    cache = plan.cache
    if cache is not None and cache[0] == epoch:
        return cache[1]
    order = _take_ahead(plan, epoch)
    if order is None:
        # the last order goes first (its epoch's batches may still hold it): this one is drawn
        # beside the next one's job (Note [orders made ahead])
        plan.cache = None
        order = _make_order(plan, epoch)
    plan.cache = (epoch, order)
    return order


def _order_job(plan: Plan, epoch: int, start: bool) -> OrderJob:
    """The job that makes the order epoch_order caches, from the plan's settings only (Note [epoch
    orders] in src/py/epoch_order.c): on a thread of its own when ``start``, else in its
    result()."""
    n, L = plan.num_items, plan.window
    return OrderJob(n, plan.seed, epoch, shuffle=plan.shuffle,
                     phase_range=0 if L is None else plan.num_rows - n * L,
                     world_size=plan.world_size, rank=plan.rank, count=plan.num_samples,
                     window=L or 0, tables=plan.tables, start=start)


def _make_order(plan: Plan, epoch: int) -> np.ndarray:
    """The order epoch_order caches, made here: the rank's items, read-only, and read in place by
    the batches' RowGathers (Note [epoch row tables] in src/py/epoch_table.c)."""
    order: np.ndarray = _order_job(plan, epoch, False).result()
    return order


# Note [orders made ahead]
# An epoch's order is a permutation of all its items (Note [epoch permutation] in
# src/py/epoch_table.c), made when the epoch begins, in time linear in the items (about 10 ms
# for 4 million rows, one random access each). The prefetcher's producer stops at an epoch's
# end until the next iter() (Note [epochs] in src/py/prefetcher.c), so a loop across epochs
# would wait that long for the next epoch's first batch, every epoch: for a short epoch of
# small rows, longer than the batches themselves take. So as an epoch begins, the order of
# the epoch that follows it by default (the next one; a set_epoch() to it, as
# DistributedSampler users call it, names the same) is made by an OrderJob on a thread of its
# own that never takes the GIL (Note [epoch orders] in src/py/epoch_order.c), and epoch_order takes
# it from there: at once if it is done, else after waiting for the rest of it. Where the
# beginning epoch's own order is to be drawn in place (the first epoch, or one after a
# set_epoch() elsewhere; not a resumed epoch, whose order the resume draws), that job starts
# before the drawing (prepare_alongside), so both are made at once: a first epoch shorter than a
# permutation does not leave the second waiting for all of its own. An epoch that
# found its order not yet made is shorter than the making (an epoch that began with it, after
# a whole one: not indices() asking for it, nor the rest of a resumed epoch before it): from
# then on the orders of the next _AHEAD_MAX epochs are made, each on its own thread, so that
# each has that many epochs' time (for jobs of up to _AHEAD_EXTRA_BYTES, _job_bytes: the extra
# job's memory is bounded).
# The order is a pure function of the plan's settings and the epoch; a job is made from them
# and matched by _order_key, so only a plan of the same settings uses it (the resumed epoch's
# plan, a copy with other sharding, makes its own). Orders of fewer than _AHEAD_MIN_ITEMS items
# are made in place (a thread costs more than they do). A forked child never waits for a
# thread of its parent (it does not exist there): it makes the order itself. A job that could
# not be made, or whose table could not be handed out (out of memory), leaves the order to be
# made, and its error raised, where it is needed. Memory: the current order and the ones being
# made, 8 bytes an item of the rank's shard each (two tables; three once orders are made two
# epochs ahead, or while an order is drawn in place beside the next one's job and the last
# epoch's batches still hold theirs), a sharded job also the whole permutation's 8 bytes an
# item until its order is handed out (_job_bytes), and the plan's EpochTables keeps at most
# two blocks more for reuse (Note [epoch table reuse]).
_AHEAD_MIN_ITEMS = 1 << 16
_AHEAD_MAX = 2
_AHEAD_EXTRA_BYTES = 512 << 20  # the most a job two epochs ahead holds (64 million items)


def _job_bytes(plan: Plan) -> int:
    """What a job holds until its order is handed out: the order's block, and for a shard the
    whole permutation's block beside it (Note [epoch orders] in src/py/epoch_order.c)."""
    sharded = plan.world_size > 1 and plan.num_samples > 0
    return 8 * (plan.num_items + (plan.num_samples if sharded else 0))


def _order_key(plan: Plan, epoch: int) -> tuple[Any, ...]:
    return (epoch, plan.num_items, plan.num_rows, plan.window, plan.shuffle, plan.seed,
            plan.world_size, plan.rank, plan.num_samples)


class _AheadOrder:
    """An epoch's order being made on a thread of its own (Note [orders made ahead])."""

    def __init__(self, plan: Plan, epoch: int, whole: bool) -> None:
        self.key = _order_key(plan, epoch)
        self.pid = os.getpid()
        self.whole = whole  # made as a whole epoch began: a wait for it says epochs are short
        self.job = _order_job(plan, epoch, True)


def prepare_order(plan: Plan, epoch: int, whole: bool = True, start: int | None = None) -> None:
    """Start making the orders of ``epoch`` and of the epochs after it up to the plan's depth
    (the first ``start`` of them only, when given), each on a thread of its own (Note [orders
    made ahead]); ``whole``: the epoch that began is a whole one (not the rest of a resumed
    epoch)."""
    if plan.num_items < _AHEAD_MIN_ITEMS:
        return
    wanted = [_order_key(plan, e) for e in range(epoch, epoch + plan.ahead_depth)]
    # jobs of other epochs or settings, or the parent's, go: their blocks can serve these
    pid = os.getpid()
    plan.ahead = tuple(j for j in plan.ahead if j.key in wanted and j.pid == pid)
    have = {j.key for j in plan.ahead}
    for key in wanted[:start]:
        if key in have or (plan.cache is not None and plan.cache[0] == key[0]):
            continue
        try:
            plan.ahead += (_AheadOrder(plan, key[0], whole),)
        except Exception:  # noqa: BLE001 -- the order is made, or its error raised, where it is needed
            return


def prepare_alongside(plan: Plan, epoch: int) -> None:
    """As ``epoch - 1`` begins and before it takes its order: start ``epoch``'s job only when
    that order is to be drawn in place (no job of this process makes it, and it is not the
    cached one), so that both are made at once (Note [orders made ahead]). Otherwise nothing:
    prepare_order, once the epoch has begun, starts the jobs it wants."""
    key, pid = _order_key(plan, epoch - 1), os.getpid()
    cached = plan.cache is not None and plan.cache[0] == epoch - 1
    if not cached and not any(j.key == key and j.pid == pid for j in plan.ahead):
        prepare_order(plan, epoch, start=1)


def _take_ahead(plan: Plan, epoch: int) -> np.ndarray | None:
    """The order of ``epoch`` made ahead for this plan, waiting for its thread if needed; None
    when there is none, or its table could not be handed out."""
    key = _order_key(plan, epoch)
    job = next((j for j in plan.ahead if j.key == key), None)
    if job is None:
        return None
    # a new tuple, not the shared one changed: a copy of the plan (the resumed epoch's) holds it too
    rest = tuple(j for j in plan.ahead if j is not job)
    if job.pid != os.getpid():  # the thread was the parent's (a fork() since)
        plan.ahead = rest
        return None
    if (not job.job.done and job.whole and epoch == plan.epoch and plan.ahead_depth < _AHEAD_MAX
            and _job_bytes(plan) <= _AHEAD_EXTRA_BYTES):
        plan.ahead_depth += 1  # the epoch beginning waits: epochs are shorter than an order takes
    try:
        order: np.ndarray = job.job.result()  # a Ctrl-C leaves the job for the next attempt
    except Exception:  # noqa: BLE001 -- its table could not be handed out (out of memory): the
        plan.ahead = rest  # job is spent; the order is made where it is needed, which raises
        return None
    plan.ahead = rest
    return order


class Epochs:
    """The re-iterable source given to the AsyncPrefetcher: each iter() is one epoch."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def __len__(self) -> int:
        return self._plan.n_batches

    def __iter__(self) -> Iterator[Any]:
        return epoch_batches(self._plan, self._plan.epoch)


def _check_shape(path: str, src: Any, shape: tuple[int, ...]) -> None:
    """Raise a clear error if the source no longer has the shape the loader was made for."""
    try:
        now = RowGather(src, ()).source_shape
    except Exception as e:
        raise ValueError(f"{path}: the source can no longer be read ({e})") from None
    if now != shape:
        raise ValueError(f"{path}: the source changed shape from {shape} to {now} under the "
                         "ArrayLoader (resized or replaced while loading)")


def _truncated(path: str, m: mmap.mmap | MappedName, need: int, name: str) -> ValueError:
    try:
        now = f"{m.size()} bytes"
    except (OSError, ValueError) as e:
        now = f"unreadable ({e})"
    return ValueError(f"{path}: the memory-mapped file {name} was truncated on disk while "
                      f"loading: it is now {now}, the mapping needs {need} (the dataset was "
                      "rewritten or cut short under the ArrayLoader)")


def _row_gather(plan: Plan, path: str, src: Any, shape: tuple[int, ...], rows: Any,
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


def epoch_batches(plan: Plan, epoch: int, resumed: tuple[np.ndarray, int] | None = None) -> Iterator[Any]:
    """The epoch's batches: a RowBatches (Note [native epochs] in src/py/row_batches.c), or the
    generator where a mapped file cannot be opened for its size check. A source found changed
    or cut short is the first batch's error, as the generator reports it, not iter()'s.
    ``resumed``: the resumed epoch's order and batch count (pinloader/_resume.py), in place of
    the whole epoch's."""
    if not plan.native:
        plan.source_kind, plan.source_reason = "generator", "native epochs turned off"
        return _epoch_generator(plan, epoch, resumed)
    plan.source_kind, plan.source_reason = "native", ""
    try:
        order, n_batches = resumed or (epoch_order(plan, epoch), plan.n_batches)
        if plan.files is None:
            plan.files = open_mapped_files(plan.leaves)
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


def _epoch_generator(plan: Plan, epoch: int, resumed: tuple[np.ndarray, int] | None = None) -> Iterator[Any]:
    # Note [truncated mappings]
    # Rows of a mapping past the end of its file fault with SIGBUS when a staging thread reads
    # them, which kills the process: another job may rewrite or cut the dataset at any time.
    # Before each batch is read, each file-mapped leaf's file size is checked against the end of
    # its mapping (one fstat), and a shorter file is an error naming the leaf and the file. A
    # RowBatches checks it in C, on a descriptor that open_mapped_files (pinloader/_mapped.py)
    # matched to the mapping (Note [native epochs] in src/py/row_batches.c); this generator, used
    # where no such descriptor can be had, checks it with mmap.size() before the batch's
    # RowGathers exist. A file cut while a batch is being staged, after its check, is not
    # caught: the check narrows the window to one batch.
    order, n_batches = resumed or (epoch_order(plan, epoch), plan.n_batches)
    bs = plan.batch_size
    any_mapped = any(mapped for _, _, mapped, _ in plan.leaves)
    files = [(path, *fm) for path, src, _, _ in plan.leaves
             if (fm := file_mapping(src)) is not None]
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
        # Note [read-ahead] in src/py/row_gather.c: the next batch's rows (the first batch's own too)
        ahead = order[(lo + bs if b else lo):lo + 2 * bs] if any_mapped else None
        leaves = [_row_gather(plan, path, src, shape, rows, ahead if mapped else None)
                  for path, src, mapped, shape in plan.leaves]
        yield tuple(leaves)  # placed in the loader's structure by the prefetcher (structure=)
