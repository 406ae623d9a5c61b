"""The epoch order made in C (pinloader._C.OrderJob, Note [epoch orders] in
src/py/epoch_order.c) and the reuse of its tables' blocks (EpochTables, Note [epoch table reuse]
in src/py/epoch_table.c).

The order must be the documented one item for item, on a thread of its own or in place, with
reused blocks or fresh ones; a block is reused only once nothing holds the table it was; the
job's thread never needs the GIL; a Ctrl-C while waiting for it is a KeyboardInterrupt that
leaves the job whole; a job dropped while its thread runs is freed by the thread.
"""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pinloader import _C
from pinloader._C import EpochTables, OrderJob, _testing
from helpers import WAIT_CHILD, describe, ref_order, run_py


def formula(n, seed, epoch, shuffle=True, phase_range=0, world=1, rank=0, count=None, window=0):
    """The Note's formula in NumPy, over permutation() (itself checked against the Python
    reference generator in tests/test_permutation.py)."""
    count = n if count is None else count
    phase, perm = _C.permutation(n, seed, epoch, phase_range) if shuffle else (0, np.arange(n))
    perm = np.asarray(perm, np.int64)
    if world > 1 and count > 0:
        order = perm[(np.arange(count, dtype=np.int64) * world + rank) % n]
    else:
        order = perm[:count]
    return phase + order * window if window else order


CASES = [
    # n, world, rank, count, window, phase_range, shuffle
    (0, 1, 0, 0, 0, 0, True),
    (1, 1, 0, 1, 0, 0, True),
    (10, 1, 0, 10, 0, 0, True),
    (10, 1, 0, 10, 0, 0, False),
    (10, 1, 0, 4, 0, 0, True),      # a count short of n: the order's first items
    (10, 3, 1, 4, 0, 0, True),      # padded shards wrap to the order's start
    (10, 3, 2, 3, 0, 0, False),
    (5, 8, 7, 1, 0, 0, True),       # more ranks than items
    (5, 8, 7, 0, 0, 0, True),       # drop_last: nothing for this rank
    (7, 2, 1, 4, 3, 2, True),       # windows after a phase
    (7, 1, 0, 7, 3, 2, False),
    (1000, 4, 3, 250, 2, 1, True),
    (70_001, 3, 0, 23_334, 0, 0, True),
]


@pytest.mark.parametrize("start", [True, False], ids=["thread", "in-place"])
@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "fresh"])
@pytest.mark.parametrize("case", CASES, ids=[f"n{c[0]}-w{c[1]}r{c[2]}c{c[3]}-L{c[4]}p{c[5]}-s{int(c[6])}" for c in CASES])
def test_the_order_is_the_documented_one(case, start, reuse):
    n, world, rank, count, window, phase_range, shuffle = case
    tables = EpochTables() if reuse else None
    for epoch in (0, 1, 2**64 - 1):
        job = OrderJob(n, 7, epoch, shuffle=shuffle, phase_range=phase_range, world_size=world,
                        rank=rank, count=count, window=window, tables=tables, start=start)
        got = job.result()
        want = formula(n, 7, epoch, shuffle, phase_range, world, rank, count, window)
        assert got.dtype == np.int64 and not got.flags.writeable
        assert got.tolist() == want.tolist()
        assert job.result() is got and job.done
        # its range is the one RowGathers check the source against (Note [epoch row tables])
        # (a range recorded too narrow would let a RowGather borrow rows past its source)
        if len(got):
            span = window or 1
            end = int(got.max()) + span
            g = _C.RowGather(np.zeros((end, 1), np.uint8), got, window or None)
            assert np.array_equal(g.rows, got)
            with pytest.raises(IndexError):
                _C.RowGather(np.zeros((end - 1, 1), np.uint8), got, window or None)
        del got, job


def test_the_loader_order_matches_the_python_reference():
    rows, window, world, bs = 3 * 1001 + 2, 3, 3, 100
    n = rows // window
    for rank in range(world):
        for drop_last in (False, True):
            count = n // world if drop_last else -(-n // world)
            got = OrderJob(n, 1, 4, phase_range=rows - n * window, world_size=world, rank=rank,
                            count=count, window=window).result()
            assert got.tolist() == ref_order(rows, bs, 1, 4, rank=rank, world=world,
                                             drop_last=drop_last, window=window)


def data_address(a):
    return a.__array_interface__["data"][0]


def test_a_dropped_table_is_reused_and_a_held_one_is_not():
    tables = EpochTables()
    n = 50_000
    a = OrderJob(n, 0, 0, tables=tables).result()
    where = data_address(a)
    del a
    assert tables.spare_bytes >= n * 8
    b = OrderJob(n, 0, 1, tables=tables).result()  # made in the block of epoch 0's table
    assert tables.reused == 1 and data_address(b) == where
    assert b.tolist() == formula(n, 0, 1).tolist()
    # held three ways: a view whose base is the capsule, a slice, a RowGather borrowing its rows
    held = [_C.epoch_view(b), b[10:20], _C.RowGather(np.zeros((n, 2), np.uint8), b[:100])]
    want = b.copy()
    del b
    for k, h in enumerate(held):
        c = OrderJob(n, 0, 2 + k, tables=tables).result()
        assert data_address(c) != where  # the held block is not written
        assert np.array_equal(c, formula(n, 0, 2 + k))
        del c
    assert np.array_equal(held[0], want) and np.array_equal(held[1], want[10:20])
    del held
    # every block is back: the cache keeps two, the largest
    assert tables.spare_bytes <= 2 * (n * 8 + 64)
    tables.clear()
    assert tables.spare_bytes == 0


def test_a_block_serves_tables_of_half_its_size_to_its_size():
    tables = EpochTables()
    a = OrderJob(1000, 0, 0, tables=tables).result()
    del a
    small = OrderJob(400, 0, 0, tables=tables).result()  # under half: a block of its own
    assert tables.reused == 0
    near = OrderJob(600, 0, 0, tables=tables).result()
    assert tables.reused == 1
    assert small.tolist() == formula(400, 0, 0).tolist() and near.tolist() == formula(600, 0, 0).tolist()


def test_a_shard_returns_its_permutation_block():
    tables = EpochTables()
    n, world = 100_000, 4
    for epoch in range(3):
        got = OrderJob(n, 3, epoch, world_size=world, rank=1, count=n // world, tables=tables).result()
        assert got.tolist() == formula(n, 3, epoch, world=world, rank=1, count=n // world).tolist()
        del got
    # epoch 1 and 2 reuse both the permutation's block and the shard's
    assert tables.reused == 4


@pytest.mark.parametrize("kwargs,err", [
    (dict(n=-1), ValueError),
    (dict(n=True), TypeError),
    (dict(n=1.5), TypeError),
    (dict(seed=1.0), TypeError),
    (dict(epoch=None), TypeError),
    (dict(world_size=0), ValueError),
    (dict(world_size=2, rank=2), ValueError),
    (dict(rank=-1), ValueError),
    (dict(count=-1), ValueError),
    (dict(window=-1), ValueError),
    (dict(phase_range=-1), ValueError),
    (dict(n=2**62, window=4), ValueError),  # the window starts overflow int64
    (dict(n=2**61), ValueError),  # past what the address space holds
    (dict(n=2**59), MemoryError),
    (dict(tables=object()), TypeError),
    (dict(tables=np.arange(3)), TypeError),
    (dict(shuffle=None), TypeError),  # not silently False
    (dict(shuffle="no"), TypeError),  # not silently True
    (dict(start=1), TypeError),
])
def test_bad_arguments_are_clear_errors(kwargs, err):
    args = dict(n=10, seed=0, epoch=0)
    args.update(kwargs)
    n, seed, epoch = args.pop("n"), args.pop("seed"), args.pop("epoch")
    with pytest.raises(err):
        OrderJob(n, seed, epoch, **args)


@pytest.fixture
def held():
    _testing.debug_hold_order_jobs(True)
    try:
        yield
    finally:
        _testing.debug_hold_order_jobs(False)


def test_held_threads_are_counted_while_they_wait_at_the_switch():
    # the fork tests wait for this count before they fork (test_a_child_forked_while_...); in a
    # fresh interpreter, where no other test's job threads can come and go
    code = textwrap.dedent("""
    import time
    import numpy as np
    from pinloader._C import OrderJob, _testing
    assert _testing.order_jobs_parked() == 0
    _testing.debug_hold_order_jobs(True)
    jobs = [OrderJob(1000, 0, e) for e in range(3)]
    assert all(j.threaded and not j.done for j in jobs)
    deadline = time.monotonic() + 60
    while _testing.order_jobs_parked() < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _testing.order_jobs_parked() == 3
    time.sleep(0.05)
    assert _testing.order_jobs_parked() == 3 and not any(j.done for j in jobs)
    _testing.debug_hold_order_jobs(False)
    got = [j.result() for j in jobs]
    assert all(sorted(g.tolist()) == list(range(1000)) for g in got)
    assert _testing.order_jobs_parked() == 0  # each left the switch before its order was made
    print("OK")
    """)
    p = run_py(code, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, describe(p)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc")
def test_the_job_runs_on_a_named_thread(held):
    job = OrderJob(1000, 0, 0)
    assert job.threaded and not job.done
    def names():
        out = set()
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    out.add(f.read().strip())
            except OSError:
                pass
        return out

    deadline = time.monotonic() + 60  # the thread names itself once it runs
    while "pl-epoch-order" not in names() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "pl-epoch-order" in names()
    _testing.debug_hold_order_jobs(False)
    assert job.result().tolist() == formula(1000, 0, 0).tolist()


def test_the_thread_never_needs_the_gil():
    # With a switch interval of an hour no other Python thread runs while this one spins: the
    # job is done all the same, so its thread never asked for the GIL.
    job = OrderJob(200_000, 1, 1)
    old = sys.getswitchinterval()
    sys.setswitchinterval(3600.0)
    try:
        deadline = time.monotonic() + 120
        while not job.done and time.monotonic() < deadline:
            pass
        done = job.done
    finally:
        sys.setswitchinterval(old)
    assert done
    assert job.result().tolist() == formula(200_000, 1, 1).tolist()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_ctrl_c_while_waiting_leaves_the_job_whole(held):
    job = OrderJob(5000, 2, 3)
    main = threading.get_ident()
    timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            job.result()
    finally:
        timer.join()
    assert not job.done
    _testing.debug_hold_order_jobs(False)
    assert job.result().tolist() == formula(5000, 2, 3).tolist()


def test_a_job_dropped_while_its_thread_runs_is_freed_by_the_thread(held):
    tables = EpochTables()
    jobs = [OrderJob(10_000 + k, 0, k, world_size=2, rank=1, count=5000, tables=tables) for k in range(8)]
    del jobs  # their threads are still held: each frees its work when it ends
    _testing.debug_hold_order_jobs(False)
    # the threads end on their own; a new job after them works, and nothing came back to the
    # cache from a thread (keeping a block needs the GIL)
    assert OrderJob(3000, 0, 0, tables=tables).result().tolist() == formula(3000, 0, 0).tolist()
    assert tables.reused == 0


def test_a_thread_that_cannot_start_leaves_the_order_to_result():
    # start=False is the path a failed pthread_create takes
    job = OrderJob(3000, 4, 4, start=False)
    assert not job.threaded and not job.done
    assert job.result().tolist() == formula(3000, 4, 4).tolist()


@pytest.mark.parametrize("start", [True, False], ids=["thread", "in-place"])
def test_result_called_from_two_threads_at_once_gives_both_the_order(held, start):
    # Two Python threads wait in result() for the same job (or make it in place at once): each
    # gets the one table, and the job still gives it afterwards. A sharded order without tables
    # frees its permutation's block when it is handed out: a second maker still writing it would
    # write freed memory (ASan).
    n, world = 2_000_000 if not start else 100_000, 2
    job = OrderJob(n, 5, 6, world_size=world, rank=1, count=n // world, start=start)
    barrier = threading.Barrier(2)
    got = [None, None]

    def call(k):
        barrier.wait()
        try:
            got[k] = job.result()
        except BaseException as e:  # noqa: BLE001 -- reported by the assertion below
            got[k] = e

    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # both wait (or make it)
    _testing.debug_hold_order_jobs(False)
    for t in threads:
        t.join()
    assert all(isinstance(g, np.ndarray) for g in got), got
    assert got[0] is got[1] and job.result() is got[0]
    assert got[0].tolist() == formula(n, 5, 6, world=world, rank=1, count=n // world).tolist()


@pytest.mark.fork
def test_a_child_forked_while_another_thread_makes_the_order_in_place_makes_it_itself():
    # A Python thread of the parent is inside result() of an in-place job (start=False) when the
    # main thread forks: in the child that thread does not exist, and result() there must make
    # the order itself, not wait for a maker that will never finish.
    code = textwrap.dedent("""
    import os, sys, threading, time, warnings
    import numpy as np
    from pinloader import _C
    from pinloader._C import OrderJob
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
    """) + WAIT_CHILD.format(timeout=60.0, poll=0.01) + textwrap.dedent("""
    n = 8_000_000
    job = OrderJob(n, 1, 2, world_size=2, rank=1, count=n // 2, start=False)
    go = threading.Barrier(2)
    def make():
        go.wait()
        job.result()
    t = threading.Thread(target=make)
    t.start()
    go.wait()
    time.sleep(0.05)                         # the thread is inside its making
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            got = job.result()
            phase, perm = _C.permutation(n, 1, 2)
            want = np.asarray(perm)[(np.arange(n // 2) * 2 + 1) % n]
            code = 0 if np.array_equal(got, want) else 2
        finally:
            os._exit(code)
    status = wait_child(pid)
    t.join()
    assert status == 0, status
    print("OK")
    """)
    p = run_py(code, timeout=150)
    assert p.returncode == 0 and "OK" in p.stdout, describe(p)


@st.composite
def order_cases(draw):
    n = draw(st.integers(0, 300))
    world = draw(st.integers(1, 9))
    rank = draw(st.integers(0, world - 1))
    if world > 1 and n == 0:
        count = 0
    else:
        count = draw(st.integers(0, n if world == 1 else n + world))
    window = draw(st.sampled_from([0, 1, 2, 7]))
    phase_range = draw(st.integers(0, 5)) if window else 0
    return dict(n=n, world=world, rank=rank, count=count, window=window, phase_range=phase_range,
                shuffle=draw(st.booleans()), seed=draw(st.integers(-2**70, 2**70)),
                epoch=draw(st.integers(0, 2**64 - 1)), start=draw(st.booleans()),
                reuse=draw(st.booleans()))


_PROPERTY_TABLES = EpochTables()  # shared across examples: blocks of every size come and go


@settings(max_examples=300, deadline=None)
@given(case=order_cases())
def test_any_order_is_the_formulas_and_its_range_is_exact(case):
    c = case
    job = OrderJob(c["n"], c["seed"], c["epoch"], shuffle=c["shuffle"], phase_range=c["phase_range"],
                    world_size=c["world"], rank=c["rank"], count=c["count"], window=c["window"],
                    tables=_PROPERTY_TABLES if c["reuse"] else None, start=c["start"])
    got = job.result()
    want = formula(c["n"], c["seed"] % 2**64, c["epoch"], c["shuffle"], c["phase_range"], c["world"],
                   c["rank"], c["count"], c["window"])
    assert got.tolist() == want.tolist()
    if len(got):  # the range the table records, through the one reader of it that checks
        span = c["window"] or 1
        end = int(got.max()) + span
        _C.RowGather(np.zeros((end, 1), np.uint8), got, c["window"] or None)
        with pytest.raises((IndexError, ValueError)):  # ValueError: a window past a source of no rows
            _C.RowGather(np.zeros((end - 1, 1), np.uint8), got, c["window"] or None)


@pytest.mark.fork
def test_a_child_forked_while_the_test_switch_holds_jobs_runs_its_own():
    # The switch is process state: in the child the parent's held threads do not exist, the
    # switch is off and its lock re-made, so a job made there runs; the parent's is held still.
    import textwrap
    from helpers import WAIT_CHILD, describe, run_py
    code = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
    import numpy as np
    from pinloader._C import OrderJob, _testing
    """) + WAIT_CHILD.format(timeout=60.0, poll=0.01) + textwrap.dedent("""
    _testing.debug_hold_order_jobs(True)
    held = OrderJob(5000, 1, 1)
    deadline = time.monotonic() + 60        # fork once its thread waits at the switch, not while
    while _testing.order_jobs_parked() < 1: # it starts (a lock of the C library or a sanitizer's
        assert time.monotonic() < deadline  # allocator it holds then stays held in the child)
        time.sleep(0.001)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mine = OrderJob(3000, 2, 2).result()          # its thread runs: the switch is off
            assert sorted(mine.tolist()) == list(range(3000))
            assert sorted(held.result().tolist()) == list(range(5000))  # made here, in place
            code = 0
        finally:
            os._exit(code)
    status = wait_child(pid)
    assert status == 0, status
    assert not held.done                                  # the parent's is still held
    _testing.debug_hold_order_jobs(False)
    assert sorted(held.result().tolist()) == list(range(5000))
    print("OK")
    """)
    p = run_py(code, timeout=180)  # the child's 60 s, its dump's 60 s
    assert p.returncode == 0 and "OK" in p.stdout, describe(p)
