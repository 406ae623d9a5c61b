"""AsyncPrefetcher: len() and epochs (host backend).

One epoch per iter(): a re-iterable source (a list, a DataLoader-like object) is asked for one
iterator per epoch and delivers everything each time, without new threads; an epoch left part
way (break) and iterated again starts afresh; an exhausted epoch's iter() starts the next. A
one-shot iterator (a generator) resumes where the loop left it, loses nothing, and warns when
asked for a second epoch once exhausted.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import pinloader
from helpers import count_tasks, drain, good

DEVICE = "cpu"


# ---- len -----------------------------------------------------------------------------------------

def test_len_of_sized_source():
    src = [np.zeros(1)] * 17
    with pinloader.AsyncPrefetcher(src, device=DEVICE) as pf:
        assert len(pf) == 17


def test_len_without_len_raises_typeerror_naming_source():
    pf = pinloader.AsyncPrefetcher((np.zeros(1) for _ in range(3)), device=DEVICE)
    try:
        with pytest.raises(TypeError, match="generator"):
            len(pf)
    finally:
        pf.close()


# ---- re-iterable sources -------------------------------------------------------------------------

class ReiterableSource:
    """A DataLoader-like re-iterable source that counts __iter__ calls and items pulled."""

    def __init__(self, n, make=None):
        self.n = n
        self.iters = 0
        self.pulled = 0
        self.make = make or (lambda i: {"i": i, "x": np.full(8, i, np.int32)})

    def __len__(self):
        return self.n

    def __iter__(self):
        self.iters += 1
        epoch = self.iters
        for i in range(self.n):
            self.pulled += 1
            item = self.make(i)
            if isinstance(item, dict):
                item["epoch"] = epoch
            yield item


def test_three_epochs_each_deliver_everything_without_new_threads():
    src = ReiterableSource(25)
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, depth=3)
    try:
        tasks = None
        for epoch in range(1, 4):
            seen = []
            for b in pf:
                assert b["epoch"] == epoch
                assert (np.from_dlpack(b["x"]) == b["i"]).all()
                seen.append(b["i"])
            assert seen == list(range(25)), f"epoch {epoch}"
            if tasks is None:
                tasks = count_tasks()
            else:
                assert count_tasks() == tasks, "threads were created for a new epoch"
        # The constructor's eager epoch is reused by the first for loop: one __iter__ per epoch.
        assert src.iters == 3
        assert pf.stats()["batches"] >= 75
    finally:
        pf.close()


def test_unconsumed_epoch_is_reused_by_iter():
    src = ReiterableSource(5)
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE)
    try:
        time.sleep(0.05)  # let the eager first epoch get going
        assert iter(pf) is pf
        assert iter(pf) is pf
        assert src.iters == 1
        assert [b["i"] for b in pf] == list(range(5))
        assert src.iters == 1
    finally:
        pf.close()


def test_each_epoch_asks_the_source_for_one_iterator():
    # A DataLoader starts its worker processes in iter(): one call per epoch, not two.
    class Counting:
        calls = 0

        def __iter__(self):
            Counting.calls += 1
            return iter([np.zeros(4)] * 3)

    src = Counting()
    pf = pinloader.AsyncPrefetcher(src, device="cpu")
    for epoch in range(3):
        assert len([b for b in pf]) == 3
    pf.close()
    assert Counting.calls == 3
def test_break_mid_epoch_then_iterate_again_starts_fresh():
    src = ReiterableSource(20)
    with pinloader.AsyncPrefetcher(src, device=DEVICE, depth=4) as pf:
        first = []
        for b in pf:
            first.append(b["i"])
            if len(first) == 5:
                break
        assert first == [0, 1, 2, 3, 4]
        time.sleep(0.05)  # let stale batches of the abandoned epoch queue up
        second = [(b["epoch"], b["i"]) for b in pf]
        assert second == [(2, i) for i in range(20)]
        third = [b["i"] for b in pf]
        assert third == list(range(20))


def test_break_repeatedly_over_a_list_then_iterate_fully():
    # A list source: three loops broken after 7 batches each, every batch intact, then a full
    # epoch delivers everything from the start.
    src = [{"i": i, "x": np.full((4, 3), i, dtype=np.int64), "tag": f"b{i}"} for i in range(30)]
    with pinloader.AsyncPrefetcher(src, device=DEVICE, depth=4) as pf:
        for _ in range(3):
            seen = 0
            for b in pf:
                assert b["i"] == seen and b["tag"] == f"b{seen}"
                x = np.from_dlpack(b["x"])
                assert x.shape == (4, 3) and (x == seen).all()
                seen += 1
                if seen == 7:
                    break
        out = list(pf)
    assert [b["i"] for b in out] == list(range(30))


def test_iter_after_exhaustion_starts_new_epoch():
    src = [np.full(2, i) for i in range(4)]
    with pinloader.AsyncPrefetcher(src, device=DEVICE) as pf:
        a = drain(pf)
        with pytest.raises(StopIteration):
            next(pf)
        b = list(pf)
        assert [int(np.from_dlpack(x)[0]) for x in a] == [0, 1, 2, 3]
        assert [int(np.from_dlpack(x)[0]) for x in b] == [0, 1, 2, 3]


def test_empty_source():
    with pinloader.AsyncPrefetcher([], device=DEVICE) as pf:
        assert list(pf) == []
        assert list(pf) == []
        assert pf.stats()["batches"] == 0


def test_second_epoch_of_reiterable_source_does_not_warn():
    pf = pinloader.AsyncPrefetcher([np.full(3, i) for i in range(3)], device=DEVICE)
    try:
        assert len(list(pf)) == 3
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(pf)) == 3
    finally:
        pf.close()


# ---- one-shot iterators --------------------------------------------------------------------------

def test_breaking_out_of_the_loop_over_a_one_shot_iterator_loses_nothing():
    # A generator cannot be restarted: iter(gen) is gen. After `break`, a plain Python loop over
    # the same generator resumes where it stopped. The items the prefetcher had already pulled
    # from the generator (up to `depth` of them) must not be silently dropped.
    def gen():
        for i in range(20):
            yield good(i)

    with pinloader.AsyncPrefetcher(gen(), device=DEVICE, depth=4) as pf:
        seen = []
        for b in pf:
            seen.append(b["i"])
            if len(seen) == 3:
                break
        time.sleep(0.05)
        for b in pf:
            seen.append(b["i"])
    assert seen == list(range(20)), f"items lost or repeated: {seen}"


def test_second_epoch_of_exhausted_generator_warns():
    pf = pinloader.AsyncPrefetcher((np.full(3, i) for i in range(3)), device=DEVICE)
    try:
        assert len(list(pf)) == 3
        with pytest.warns(RuntimeWarning, match="one-shot iterator that is already exhausted"):
            again = list(pf)
        assert again == []
    finally:
        pf.close()
