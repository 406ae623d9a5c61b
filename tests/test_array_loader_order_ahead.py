"""ArrayLoader: the next epoch's order is made ahead, on a thread of its own (Note [orders made
ahead] in pinloader/_epoch_plan.py), and the batches stay exactly the documented ones (host
backend).

An epoch of many items begins by drawing a permutation of all of them (10 ms for 4 million
rows); made when the loop reaches the epoch's end, that stalls the pipeline once per epoch. The
tests spy on the making of the orders to see which were made ahead (by a job's thread) and which
in place, and check the batches against the Python reference of the order: made ahead, two
epochs ahead once an epoch waited for its order, made in place after set_epoch() to another
epoch, after a failed job, with windows and shards, and in a forked child while the parent's
job is still running.
"""
from __future__ import annotations

import textwrap
import threading

import numpy as np
import pytest

import pinloader
from pinloader import _epoch_plan
from pinloader._C import _testing
from helpers import WAIT_CHILD, describe, ids, ref_order, run_py

DEVICE = "cpu"
N = _epoch_plan._AHEAD_MIN_ITEMS + 123  # just enough items to be made ahead


class Spy:
    """_order_job wrapped: which epochs' orders were made, and where: "main" (in place, on the
    thread that asked) or "other" (ahead, by a job on a thread of its own); `fail_off_main`
    makes the jobs made ahead fail to be made (MemoryError)."""

    def __init__(self, monkeypatch, fail_off_main=False):
        self.calls: list[tuple[int, bool]] = []
        self.alive: list[list[int]] = []  # the epochs of the plan's jobs at each making
        self.fail_off_main = fail_off_main
        self._real = _epoch_plan._order_job
        self._mu = threading.Lock()
        monkeypatch.setattr(_epoch_plan, "_order_job", self)

    def __call__(self, plan, epoch, start):
        with self._mu:
            self.calls.append((int(epoch), not start))
            self.alive.append(sorted(int(j.key[0]) for j in plan.ahead))
        if self.fail_off_main and start:
            raise MemoryError("no memory for the order (test)")
        job = self._real(plan, epoch, start)
        assert job.threaded == start
        return job

    def where(self, epoch):
        """'main', 'other' or None: where epoch's order was made (its first making)."""
        with self._mu:
            for e, main in self.calls:
                if e == epoch:
                    return "main" if main else "other"
        return None


def epoch_rows(loader):
    """One epoch of `loader` (a loader over ids): the row ids of its batches, in order."""
    return np.concatenate([np.from_dlpack(b).copy() for b in loader])


def whole_batches(order, bs):
    """drop_last=True: the reference order without its last partial batch."""
    return order[:len(order) // bs * bs]


def wait_ahead(loader):
    for job in loader._plan.ahead:
        job.job.result()
        assert job.job.done


class ReleasedByResult:
    """An _AheadOrder's job whose result() turns the test switch off first: with the switch on
    when the next epoch begins, that epoch finds its order not yet made (done is False, the
    thread is held), whatever the timing, and then waits for it."""

    def __init__(self, job):
        self._job = job
        self.asked = 0

    @property
    def done(self):
        return self._job.done

    def result(self):
        self.asked += 1
        _testing.debug_hold_order_jobs(False)
        return self._job.result()


def epoch_that_waits(loader):
    """One epoch of `loader` whose order (made ahead, its job held by the test switch, which
    this turns off) was not made yet when the epoch began."""
    (ahead,) = [j for j in loader._plan.ahead if j.key[0] == loader.epoch + 1]
    ahead.job = ReleasedByResult(ahead.job)
    assert not ahead.job.done
    rows = epoch_rows(loader)
    assert ahead.job.asked == 1
    return rows


def test_the_next_epochs_order_is_drawn_off_the_training_thread(monkeypatch):
    spy = Spy(monkeypatch)
    bs = 4096
    with pinloader.ArrayLoader(ids(N), bs, seed=3, device=DEVICE) as L:
        for epoch in range(3):
            rows = epoch_rows(L)
            assert L.epoch == epoch
            assert rows.tolist() == ref_order(N, bs, 3, epoch)
            wait_ahead(L)
        assert spy.where(0) == "main"  # the first epoch begins with nothing made ahead
        assert spy.where(1) == "other"
        assert spy.where(2) == "other"
        assert spy.where(3) == "other"  # the epoch after the last one run is on its way
        # each epoch's order was drawn once
        assert sorted(e for e, _ in spy.calls) == [0, 1, 2, 3]
        assert np.array_equal(L.indices(3), ref_order(N, bs, 3, 3))
        assert L._plan.ahead_depth == 1  # no epoch waited for its order


def test_the_next_epochs_order_is_begun_before_this_epochs_own_is_drawn(monkeypatch):
    """The first epoch draws its order in place; the second's job starts before that, not
    after, so the two are made at once and a first epoch shorter than a permutation does not
    leave the second waiting for the rest of its own. An epoch whose order was made ahead takes
    it before the next job starts (one table fewer alive)."""
    spy = Spy(monkeypatch)
    bs = 4096
    with pinloader.ArrayLoader(ids(N), bs, seed=5, device=DEVICE) as L:
        rows = epoch_rows(L)
        assert spy.calls[:2] == [(1, False), (0, True)]  # epoch 1's job, then epoch 0 in place
        assert rows.tolist() == ref_order(N, bs, 5, 0)
        wait_ahead(L)
        assert epoch_rows(L).tolist() == ref_order(N, bs, 5, 1)
        wait_ahead(L)
        assert spy.where(1) == "other"
        assert spy.calls == [(1, False), (0, True), (2, False)]  # each drawn once
        assert spy.alive[2] == []  # epoch 2's job began after epoch 1 took its order
        L.set_epoch(7)  # an epoch not made ahead: drawn in place, the one after it ahead first
        del spy.calls[:], spy.alive[:]
        assert epoch_rows(L).tolist() == ref_order(N, bs, 5, 7)
        wait_ahead(L)
        assert spy.calls[:2] == [(8, False), (7, True)]
        assert spy.alive[0] == []  # epoch 2's job, of no use now, went before epoch 8's began


def test_a_ctrl_c_while_the_next_order_is_begun_leaves_the_epoch_to_begin_again(monkeypatch):
    """A KeyboardInterrupt in the start of the next epoch's job (before this epoch's order is
    drawn) is the epoch's failure to begin: it propagates as itself, and the next iteration
    begins the same epoch, with the right rows."""
    real, hit = _epoch_plan._order_job, []

    def interrupted_once(plan, epoch, start):
        if start and not hit:
            hit.append(int(epoch))
            raise KeyboardInterrupt
        return real(plan, epoch, start)

    bs = 4096
    with pinloader.ArrayLoader(ids(N), bs, seed=2, device=DEVICE) as L:
        assert epoch_rows(L).tolist() == ref_order(N, bs, 2, 0)
        wait_ahead(L)
        L.set_epoch(5)  # drawn in place: epoch 6's job begins first
        before = L.state_dict()
        monkeypatch.setattr(_epoch_plan, "_order_job", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            iter(L)
        assert hit == [6]
        assert L.state_dict() == before
        assert L._plan.epoch == 0  # the plan too says the epoch before
        assert epoch_rows(L).tolist() == ref_order(N, bs, 2, 5)
        assert L.epoch == 5
        wait_ahead(L)
        assert epoch_rows(L).tolist() == ref_order(N, bs, 2, 6)


def test_an_epoch_that_waits_for_its_order_makes_orders_two_epochs_ahead(monkeypatch):
    spy = Spy(monkeypatch)
    bs = 8192
    with pinloader.ArrayLoader(ids(N), bs, seed=6, device=DEVICE) as L:
        _testing.debug_hold_order_jobs(True)  # epoch 1's job waits: as if the epoch were short
        try:
            assert epoch_rows(L).tolist() == ref_order(N, bs, 6, 0)
            rows = epoch_that_waits(L)  # its first batch waited for the order
        finally:
            _testing.debug_hold_order_jobs(False)
        assert rows.tolist() == ref_order(N, bs, 6, 1)
        assert L._plan.ahead_depth == 2
        assert sorted(j.key[0] for j in L._plan.ahead) == [2, 3]  # both on their way
        for epoch in (2, 3, 4):
            assert epoch_rows(L).tolist() == ref_order(N, bs, 6, epoch)
            assert sorted(j.key[0] for j in L._plan.ahead) == [epoch + 1, epoch + 2]
        assert [spy.where(e) for e in range(6)] == ["main"] + ["other"] * 5
        assert sorted(e for e, _ in spy.calls) == list(range(7))  # each epoch's order made once
        # a set_epoch() elsewhere: made in place, the jobs of other epochs dropped
        for job in L._plan.ahead:
            job.job.result()
        L.set_epoch(20)
        assert epoch_rows(L).tolist() == ref_order(N, bs, 6, 20)
        assert spy.where(20) == "main"
        assert sorted(j.key[0] for j in L._plan.ahead) == [21, 22]


def test_a_large_order_stays_one_epoch_ahead(monkeypatch):
    # past _AHEAD_EXTRA_BYTES a third table is not worth its memory: the epoch waits instead
    monkeypatch.setattr(_epoch_plan, "_AHEAD_EXTRA_BYTES", N * 8 - 1)
    bs = 8192
    with pinloader.ArrayLoader(ids(N), bs, seed=6, device=DEVICE) as L:
        _testing.debug_hold_order_jobs(True)
        try:
            assert epoch_rows(L).tolist() == ref_order(N, bs, 6, 0)
            rows = epoch_that_waits(L)  # waited for its order
        finally:
            _testing.debug_hold_order_jobs(False)
        assert rows.tolist() == ref_order(N, bs, 6, 1)
        assert L._plan.ahead_depth == 1
        assert [j.key[0] for j in L._plan.ahead] == [2]


def test_a_large_sharded_order_counts_its_permutation_too(monkeypatch):
    # A shard's job holds the whole permutation (num_items) beside the shard (num_samples) until
    # its order is handed out: that is what a job two epochs ahead adds, not the shard alone.
    world = 8
    items = N + 5
    monkeypatch.setattr(_epoch_plan, "_AHEAD_EXTRA_BYTES", items * 8)  # a shard fits, not both
    bs = 1024
    with pinloader.ArrayLoader(ids(items), bs, seed=6, device=DEVICE, rank=3, world_size=world) as L:
        assert L._plan.num_samples * 8 < _epoch_plan._AHEAD_EXTRA_BYTES
        _testing.debug_hold_order_jobs(True)
        try:
            assert epoch_rows(L).tolist() == ref_order(items, bs, 6, 0, rank=3, world=world)
            rows = epoch_that_waits(L)
        finally:
            _testing.debug_hold_order_jobs(False)
        assert rows.tolist() == ref_order(items, bs, 6, 1, rank=3, world=world)
        assert L._plan.ahead_depth == 1
        assert [j.key[0] for j in L._plan.ahead] == [2]


def test_only_a_whole_epoch_that_waits_makes_orders_two_epochs_ahead(monkeypatch):
    # What waits for the next epoch's order before a whole epoch ran says nothing of how long
    # epochs take: indices() of the next epoch asked mid-epoch, or the rest of a resumed epoch
    # (however short). Neither makes orders two epochs ahead (a third table, kept for good).
    spy = Spy(monkeypatch)
    bs = 4096
    with pinloader.ArrayLoader(ids(N), bs, seed=2, device=DEVICE) as L:
        _testing.debug_hold_order_jobs(True)
        try:
            it = iter(L)
            first = [np.from_dlpack(next(it)).copy() for _ in range(3)]
            (ahead,) = L._plan.ahead
            ahead.job = ReleasedByResult(ahead.job)
            assert not ahead.job.done
            assert L.indices(1).tolist() == ref_order(N, bs, 2, 1)  # waited for the job
            assert ahead.job.asked == 1
        finally:
            _testing.debug_hold_order_jobs(False)
        assert L._plan.ahead_depth == 1
        state = L.state_dict()
    with pinloader.ArrayLoader(ids(N), bs, seed=2, device=DEVICE) as R:
        R.load_state_dict(state)
        _testing.debug_hold_order_jobs(True)
        try:
            rest = epoch_rows(R)  # the resumed epoch: epoch 1's job is held
            assert np.concatenate(first + [rest]).tolist() == ref_order(N, bs, 2, 0)
            rows = epoch_that_waits(R)
        finally:
            _testing.debug_hold_order_jobs(False)
        assert rows.tolist() == ref_order(N, bs, 2, 1)
        assert spy.where(1) == "other"
        assert R._plan.ahead_depth == 1
        assert [j.key[0] for j in R._plan.ahead] == [2]


def test_set_epoch_to_another_epoch_draws_that_one_in_place(monkeypatch):
    spy = Spy(monkeypatch)
    bs = 8192
    with pinloader.ArrayLoader(ids(N), bs, seed=5, device=DEVICE, drop_last=True) as L:
        assert epoch_rows(L).tolist() == whole_batches(ref_order(N, bs, 5, 0, drop_last=True), bs)
        wait_ahead(L)
        L.set_epoch(7)  # not the epoch made ahead (1)
        assert epoch_rows(L).tolist() == whole_batches(ref_order(N, bs, 5, 7, drop_last=True), bs)
        assert spy.where(7) == "main"
        wait_ahead(L)
        L.set_epoch(8)  # the one made ahead, as a DistributedSampler-style loop names it
        assert epoch_rows(L).tolist() == whole_batches(ref_order(N, bs, 5, 8, drop_last=True), bs)
        assert spy.where(8) == "other"


def test_a_failed_job_leaves_the_order_to_the_epoch_that_needs_it(monkeypatch):
    spy = Spy(monkeypatch, fail_off_main=True)
    bs = 10_000
    with pinloader.ArrayLoader(ids(N), bs, seed=9, device=DEVICE) as L:
        assert epoch_rows(L).tolist() == ref_order(N, bs, 9, 0)
        wait_ahead(L)
        assert spy.where(1) == "other"  # tried ahead, and failed
        assert epoch_rows(L).tolist() == ref_order(N, bs, 9, 1)
        assert [e for e, main in spy.calls if main] == [0, 1]  # epoch 1 drawn again, in place


@pytest.mark.parametrize("shuffle", [True, False])
def test_windows_and_shards_made_ahead_are_the_documented_ones(monkeypatch, shuffle):
    Spy(monkeypatch)
    rows, window, world, bs = 3 * N + 2, 3, 3, 5000
    items = rows // window
    for rank in range(world):
        with pinloader.ArrayLoader(ids(rows), bs, seed=1, device=DEVICE, windows=window,
                                   rank=rank, world_size=world, shuffle=shuffle) as L:
            for epoch in range(2):
                got = [np.from_dlpack(b).copy() for b in L]
                starts = np.concatenate([g[:, 0] for g in got])
                want = ref_order(rows, bs, 1, epoch, rank=rank, world=world, shuffle=shuffle,
                                 window=window)
                assert starts.tolist() == want
                assert len(starts) == -(-items // world)
                wait_ahead(L)


def test_a_resumed_epoch_and_the_next_whole_one(monkeypatch):
    spy = Spy(monkeypatch)
    bs = 4096
    with pinloader.ArrayLoader(ids(N), bs, seed=2, device=DEVICE) as L:
        it = iter(L)
        first = [np.from_dlpack(next(it)).copy() for _ in range(3)]
        state = L.state_dict()
        wait_ahead(L)
    with pinloader.ArrayLoader(ids(N), bs, seed=2, device=DEVICE) as R:
        R.load_state_dict(state)
        rest = epoch_rows(R)
        assert np.concatenate(first + [rest]).tolist() == ref_order(N, bs, 2, 0)
        wait_ahead(R)
        assert epoch_rows(R).tolist() == ref_order(N, bs, 2, 1)
        assert spy.where(1) == "other"


def test_close_drops_the_job():
    L = pinloader.ArrayLoader(ids(N), 4096, seed=0, device=DEVICE)
    next(iter(L))
    (job,) = L._plan.ahead
    L.close()
    assert L._plan.ahead == () and L._plan.tables is None
    # the job is the test's now: it still gives the order
    assert np.array_equal(job.job.result(), ref_order(N, 4096, 0, 1))


@pytest.mark.fork
def test_a_forked_child_draws_the_order_itself_while_the_parents_job_runs(tmp_path):
    # The parent's job is held inside its draw until the child is done: the child must not wait
    # for that thread (it does not exist in the child), and must get the same order.
    code = textwrap.dedent("""
    import os, sys, threading, time, warnings
    import numpy as np
    import pinloader
    from pinloader import _epoch_plan
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
    """) + WAIT_CHILD.format(timeout=30.0, poll=0.01) + textwrap.dedent("""
    from pinloader._C import _testing
    _testing.debug_hold_order_jobs(True)    # the parent's job waits until the child is done
    n = _epoch_plan._AHEAD_MIN_ITEMS + 5
    L = pinloader.ArrayLoader(np.arange(n, dtype=np.int64), 4096, seed=4, device="cpu")
    next(iter(L))                           # epoch 0 begun: epoch 1's order is being made
    (ahead,) = L._plan.ahead
    job = ahead.job
    assert job.threaded and not job.done
    # Fork once the job's thread waits at the switch and the producer waits for room (its queue
    # full: depth 3), not while either may be inside an allocation: a lock of the C library's or
    # a sanitizer's allocator held then stays held in the child.
    deadline = time.monotonic() + 60
    while _testing.order_jobs_parked() < 1 or L.stats()["queued"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    out = sys.argv[1]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mine = L.indices(1)             # made in place: the parent's thread is not here
            assert np.array_equal(job.result(), mine)  # the job makes it here too
            np.save(out, mine)
            code = 0
        finally:
            os._exit(code)
    status = wait_child(pid)
    _testing.debug_hold_order_jobs(False)
    assert status == 0, status
    want = L.indices(1)                      # the parent's, from its job
    assert np.array_equal(np.load(out), want)
    assert sorted(want.tolist()) == list(range(n))
    L.close()
    print("OK")
    """)
    p = run_py(code, timeout=120, argv=[str(tmp_path / "child_order.npy")])
    assert p.returncode == 0 and "OK" in p.stdout, describe(p)


def test_a_job_whose_hand_out_failed_leaves_the_order_to_be_made_in_place():
    # result() can fail once the order is made (its table's array or capsule could not be
    # allocated); the job then only says so (RuntimeError) on every later call. The epoch must
    # not be stuck on that job: its order is made again where it is needed.
    class Failing:
        threaded = True
        done = True

        def result(self):
            raise MemoryError("no memory for the table's array (test)")

    bs = 4096
    with pinloader.ArrayLoader(ids(N), bs, seed=6, device=DEVICE) as L:
        assert epoch_rows(L).tolist() == ref_order(N, bs, 6, 0)
        (ahead,) = L._plan.ahead
        ahead.job.result()
        ahead.job = Failing()
        assert L.indices(1).tolist() == ref_order(N, bs, 6, 1)
        assert L._plan.ahead == ()
        assert epoch_rows(L).tolist() == ref_order(N, bs, 6, 1)
