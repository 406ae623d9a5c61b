"""Hostile input against static batches, out= buffers, epoch tables, resume and the framework
doors (host backend): each case a clean error or the right values, never a crash, a leak or a
misleading message. The GPU cases are in test_array_loader_gpu.py."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import pinloader
from helpers import drain, ids, live_blocks, values, wait_for, warm_up

DEVICE = "cpu"


class Exporter:
    """An out= buffer whose __dlpack__ is Python code that runs `hook(calls)` first (so it can
    close the prefetcher, or let another thread do it, while the GIL is free)."""

    def __init__(self, arr, hook=None):
        self.arr, self.hook, self.calls = arr, hook, 0

    def __dlpack__(self, *args, **kwargs):
        self.calls += 1
        if self.hook is not None:
            self.hook(self.calls)
        return self.arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


def items(n=4, rows=4, last=None):
    out = []
    for b in range(n):
        r = last if (last is not None and b == n - 1) else rows
        out.append({"x": np.full((r, 3), b, np.float32), "y": np.arange(r, dtype=np.int64) + 10 * b})
    return out


# ---- close() while a batch is handed out (Note [closed during a handout] in handout.c) ----

@pytest.mark.parametrize("at_call", [1, 2])
def test_close_from_an_out_buffers_own_dlpack_says_closed(at_call):
    warm_up()
    before = live_blocks()
    box = {}

    def hook(calls):
        if calls == at_call:
            box["pf"].close()

    out = [Exporter(np.zeros((4, 3), np.float32), hook), np.zeros(4, np.int64)]
    pf = box["pf"] = pinloader.AsyncPrefetcher(items(), device=DEVICE, out=out)
    if at_call == 2:
        assert next(pf)["x"] is out[0]
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    assert pf.closed and pf.static_arrays is None
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    assert wait_for(lambda: live_blocks() == before), live_blocks()


def test_close_from_another_thread_during_an_out_buffers_dlpack_says_closed():
    # the exporter lets another thread run close() while it holds no GIL (Event.wait), as a
    # torch tensor's Python __dlpack__ can
    warm_up()
    before = live_blocks()
    box = {}

    def hook(calls):
        if calls == 2:
            t = threading.Thread(target=box["pf"].close)
            t.start()
            t.join()

    out = [Exporter(np.zeros((4, 3), np.float32), hook), np.zeros(4, np.int64)]
    pf = box["pf"] = pinloader.AsyncPrefetcher(items(), device=DEVICE, out=out)
    next(pf)
    with pytest.raises(ValueError, match="closed") as e:
        next(pf)
    assert "moved or changed" not in str(e.value)
    assert wait_for(lambda: live_blocks() == before), live_blocks()


@pytest.mark.parametrize("at_batch", [0, 1])
def test_close_from_the_stream_callable_makes_no_static_buffers(at_batch):
    warm_up()
    before = live_blocks()
    box = {"n": 0}

    def stream():
        if box["n"] == at_batch:
            box["pf"].close()
        box["n"] += 1
        return None

    pf = box["pf"] = pinloader.AsyncPrefetcher(items(), device=DEVICE, static=True, stream=stream)
    for _ in range(at_batch):
        next(pf)
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    assert pf.static_arrays is None
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    assert wait_for(lambda: live_blocks() == before), live_blocks()


def test_cross_thread_close_at_random_points_of_static_handouts_is_clean():
    warm_up()
    before = live_blocks()
    rng = np.random.default_rng(5)
    for _ in range(30):
        pf = pinloader.AsyncPrefetcher(items(6), device=DEVICE, static=True, depth=2)
        closer = threading.Timer(float(rng.uniform(0, 0.004)), pf.close)
        closer.start()
        try:
            for b in pf:
                assert b["x"].shape == (4, 3)
                del b  # a delivered static batch holds its buffers
        except ValueError as e:
            assert "closed" in str(e)
        closer.join()
        pf.close()
        assert pf.static_arrays is None
    assert wait_for(lambda: live_blocks() == before), live_blocks()


# ---- valid_rows ----

def test_valid_rows_is_the_fewest_rows_over_the_leaves():
    src = [{"x": np.ones((4, 3)), "y": np.ones(4)}, {"x": np.ones((2, 3)), "y": np.ones(4)},
           {"x": np.ones((4, 3)), "y": np.ones(3)}]
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, static=True)
    got = []
    for _ in pf:
        got.append(pf.valid_rows)
    assert got == [4, 2, 3]


def test_0d_leaves_have_no_rows():
    src = [{"x": np.full((4, 3), b, np.float32), "w": np.array(0.5 + b, np.float32)} for b in range(3)]
    src[-1]["x"] = src[-1]["x"][:2]
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, static=True)
    got = []
    for b in pf:
        got.append((pf.valid_rows, float(values(b["w"]))))
        assert b["w"].shape == ()
    assert got == [(4, 0.5), (4, 1.5), (2, 2.5)]


def test_a_batch_of_0d_leaves_only_has_valid_rows_none():
    src = [{"w": np.array(b, np.float32), "s": np.array(7 * b, np.int64)} for b in range(3)]
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, static=True)
    got = []
    for b in pf:
        got.append((pf.valid_rows, float(values(b["w"])), int(values(b["s"]))))
    assert got == [(None, 0.0, 0), (None, 1.0, 7), (None, 2.0, 14)]


def test_0d_leaves_through_the_torch_door():
    pt = pytest.importorskip("pinloader.torch")
    src = [(np.full((4, 2), b, np.float32), np.array(b, np.float32)) for b in range(3)]
    tp = pt.prefetch(src, device=DEVICE, static=True)
    rows = [tp.valid_rows for _ in tp]
    assert rows == [4, 4, 4]


# ---- out= buffers ----

def test_out_with_the_same_array_twice_is_refused_naming_both():
    a = np.zeros((4, 3), np.float32)
    pf = pinloader.AsyncPrefetcher(items(), device=DEVICE, out=[a, a])
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap in memory"):
        next(pf)
    pf.close()


def test_out_with_overlapping_views_is_refused_and_disjoint_views_work():
    buf = np.zeros(64, np.float32)
    src = [(np.full((4, 3), b, np.float32), np.full((4, 3), -b, np.float32)) for b in range(3)]
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, out=[buf[4:16].reshape(4, 3), buf[:12].reshape(4, 3)])
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap in memory"):
        next(pf)
    pf.close()
    x, y = buf[:12].reshape(4, 3), buf[12:24].reshape(4, 3)
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, out=[x, y])
    for b, (gx, gy) in enumerate(pf):
        assert gx is x and gy is y
        np.testing.assert_array_equal(x, b)
        np.testing.assert_array_equal(y, -b)


def test_out_layout_errors_name_the_buffer_not_a_first_batch():
    out = [np.zeros((4, 3), np.float32), np.zeros(4, np.int64)]
    src = items(2)
    src[1]["x"] = np.zeros((4, 5), np.float32)
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, out=out)
    next(pf)
    with pytest.raises(ValueError, match=r"batch leaf 0 is \(4, 5\) float32, but its buffer out\[0\] is \(4, 3\)") as e:
        next(pf)
    assert "first batch" not in str(e.value)
    pf = pinloader.AsyncPrefetcher(items(2), device=DEVICE, out=out[:1])
    with pytest.raises(ValueError, match=r"the batch has 2 array leaves, out= has 1 buffers"):
        next(pf)


def test_stream_callable_returning_a_wrong_type_names_the_callable():
    pf = pinloader.AsyncPrefetcher(items(), device=DEVICE, output="capsule", stream=lambda: "s0")
    with pytest.raises(TypeError, match=r"the stream= callable .* returned str"):
        next(pf)
    pf.close()


# ---- StatefulPrefetcher ----

class Stateful:
    def __init__(self, n=5, fail_load=False):
        self.n, self.pos, self.fail_load = n, 0, fail_load

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield np.full((4, 2), self.pos, np.float32)

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, st):
        if self.fail_load:
            raise RuntimeError("boom")
        self.pos = st["pos"]


def test_static_stateful_prefetcher_ends_its_epoch_with_stopiteration():
    src = Stateful()
    sp = pinloader.StatefulPrefetcher(src, device=DEVICE, static=True)
    got = [float(values(b)[0, 0]) for b in sp]
    assert got == [1, 2, 3, 4, 5]
    assert sp.state_dict() == {"pos": 5} and sp.valid_rows == 4
    src.pos = 0
    assert [float(values(b)[0, 0]) for b in sp] == [1, 2, 3, 4, 5]
    sp.close()


def test_stateful_prefetcher_after_a_failed_load_says_why():
    src = Stateful(fail_load=True)
    sp = pinloader.StatefulPrefetcher(src, device=DEVICE)
    next(iter(sp))
    with pytest.raises(RuntimeError, match="boom"):
        sp.load_state_dict({"pos": 1})
    with pytest.raises(ValueError, match=r"load_state_dict\(\) failed \(RuntimeError: boom\)"):
        next(sp)
    src.fail_load = False
    sp.load_state_dict({"pos": 2})  # usable again once a state loads
    assert [float(values(b)[0, 0]) for b in sp] == [3, 4, 5]
    sp.close()
    with pytest.raises(ValueError, match="StatefulPrefetcher is closed"):
        sp.load_state_dict({"pos": 0})
    with pytest.raises(ValueError, match="closed"):
        next(sp)


# ---- ArrayLoader ----

def test_misspelt_keyword_is_a_typeerror_at_construction():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'shufle' \(did you mean 'shuffle'\?\)"):
        pinloader.ArrayLoader(ids(10), 2, shufle=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stagging_threads' \(did you mean 'staging_threads'\?\)"):
        pinloader.ArrayLoader(ids(10), 2, stagging_threads=2)


def test_static_loader_resumed_near_an_epochs_end_lays_out_whole_batches():
    data = np.arange(20 * 2, dtype=np.float32).reshape(20, 2)
    L = pinloader.ArrayLoader(data, 8, device=DEVICE, seed=1, static=True)
    st = L.state_dict()
    st["position"] = 16  # 4 rows left in epoch 0
    L.load_state_dict(st)
    first = [(values(b), L.valid_rows) for b in L]
    assert len(first) == 1 and first[0][0].shape == (8, 2) and first[0][1] == 4
    np.testing.assert_array_equal(first[0][0][:4], data[L.indices_after(0, 16)])
    assert not first[0][0][4:].any()
    for epoch in (1, 2):
        got = [(values(b), L.valid_rows) for b in L]
        assert [v for _, v in got] == [8, 8, 4]
        idx = L.indices(epoch)
        np.testing.assert_array_equal(np.concatenate([x[:v] for x, v in got]), data[idx])
    L.close()


def test_epochs_are_bounded_and_never_wrap():
    L = pinloader.ArrayLoader(ids(10), 3, device=DEVICE)
    for bad in (2**64, 2**63, -1):
        with pytest.raises(ValueError, match=r"epoch must be in \[0, 2\*\*63\)"):
            L.indices(bad)
        with pytest.raises(ValueError, match="epoch must be in"):
            L.set_epoch(bad)
    L.set_epoch(2**63 - 1)
    assert len(list(L)) == 4
    with pytest.raises(ValueError, match="past the last epoch"):
        iter(L)
    L.close()


@pytest.mark.parametrize("field,value", [("epoch", -1), ("world_size", 0), ("position", -3),
                                         ("rank", 5), ("epoch", 2**64)])
def test_hostile_state_fields_are_refused_by_name(field, value):
    L = pinloader.ArrayLoader(ids(10), 3, device=DEVICE)
    st = L.state_dict()
    st[field] = value
    with pytest.raises(ValueError, match=rf"load_state_dict: {field}: "):
        L.load_state_dict(st)


def test_allow_changed_none_and_rows_edits_are_clear():
    L = pinloader.ArrayLoader(ids(10), 3, device=DEVICE)
    st = L.state_dict()
    with pytest.raises(TypeError, match="allow_changed must be a set .* not NoneType"):
        L.load_state_dict(st, allow_changed=None)
    st["sources"] = dict(st["sources"], rows=11)  # hand-edited: the leaves still say 10
    with pytest.raises(ValueError, match="saved over 11 rows, this loader has 10"):
        L.load_state_dict(st)


def test_setstate_on_what_indices_hands_out_never_reaches_the_loader():
    data = np.arange(40, dtype=np.int64)
    L = pinloader.ArrayLoader(data, 8, device=DEVICE, seed=4)
    view = L.indices(0)
    ref = view.copy()
    assert not isinstance(view.base, np.ndarray)  # the table's owner, which has no __setstate__
    with pytest.raises(AttributeError):
        view.base.__setstate__((1, (3,), np.dtype(np.int64), False, b"\0" * 24))
    view.__setstate__((1, (3,), np.dtype(np.int64), False, b"\0" * 24))  # re-points this view only
    assert view.tolist() == [0, 0, 0]
    np.testing.assert_array_equal(L.indices(0), ref)
    got = np.concatenate([values(b) for b in L])
    np.testing.assert_array_equal(got, data[ref])
    L.close()


# ---- doors over one loader (Note [doors over a loader] in pinloader/_loader_base.py) ----

def test_a_torch_door_per_epoch_over_one_loader_keeps_one_prefetcher():
    pt = pytest.importorskip("pinloader.torch")
    data = np.arange(30 * 2, dtype=np.float32).reshape(30, 2)
    L = pinloader.ArrayLoader(data, 8, device=DEVICE, seed=2)
    pfs = set()
    for ep in range(3):
        L.set_epoch(ep)
        got = [t.numpy().copy() for t in pt.prefetch(L)]
        pfs.add(id(L._pf))
        np.testing.assert_array_equal(np.concatenate(got), data[L.indices(ep)])
    assert len(pfs) == 1
    L.close()


def test_doors_switch_between_epochs_and_with_plain_iterations():
    pt = pytest.importorskip("pinloader.torch")
    torch = pytest.importorskip("torch")
    data = np.arange(20 * 2, dtype=np.float32).reshape(20, 2)
    L = pinloader.ArrayLoader(data, 8, device=DEVICE, shuffle=False)
    ptrs = set()
    for ep, kind in enumerate(["door", "static", "plain", "static", "door", "plain"]):
        if kind == "plain":
            got = [values(b) for b in L]
            assert all(isinstance(b, np.ndarray) for b in got)
        elif kind == "static":
            door = pt.prefetch(L, static=True)
            got = []
            for t in door:
                ptrs.add(t.data_ptr())
                got.append(t.numpy()[:door.valid_rows].copy())
        else:
            got = [t.numpy().copy() for t in pt.prefetch(L)]
            assert isinstance(got[0], np.ndarray)
        np.testing.assert_array_equal(np.concatenate(got), data, err_msg=f"epoch {ep} ({kind})")
    assert len(ptrs) == 2  # each static door's epoch had its own buffers, one for all its batches
    assert torch is not None
    L.close()


def test_a_door_over_a_closed_loader_says_closed():
    pt = pytest.importorskip("pinloader.torch")
    L = pinloader.ArrayLoader(ids(10), 3, device=DEVICE)
    door = pt.prefetch(L)
    list(door)
    door.close()
    with pytest.raises(ValueError, match="ArrayLoader is closed"):
        pt.prefetch(L)
    with pytest.raises(ValueError, match="ArrayLoader is closed"):
        iter(door)


def test_a_door_with_contradicting_settings_is_refused_naming_them():
    pt = pytest.importorskip("pinloader.torch")
    L = pinloader.ArrayLoader(ids(10), 3, device=DEVICE, staging_threads=1)
    with pytest.raises(ValueError, match="staging_threads=1, but the door asks for staging_threads=2"):
        pt.prefetch(L, staging_threads=2)
    L.close()


def test_nested_doors():
    pt = pytest.importorskip("pinloader.torch")
    src = [np.full((4, 2), b, np.float32) for b in range(4)]
    outer = pt.prefetch(pt.prefetch(src, device=DEVICE), device=DEVICE)
    got = [t.numpy().copy() for t in outer]
    np.testing.assert_array_equal(np.stack(got), np.stack(src))
    with pytest.raises(TypeError, match="has no state_dict"):
        outer.state_dict()
    # over a stateful inner door (an ArrayLoader's), the outer one has a state
    L = pinloader.ArrayLoader(ids(12), 4, device=DEVICE, shuffle=False)
    outer = pt.prefetch(pt.prefetch(L, device=DEVICE), device=DEVICE)
    it = iter(outer)
    assert next(it).tolist() == [0, 1, 2, 3]
    assert outer.state_dict()["position"] == 4
    L.close()


def test_torch_out_with_one_tensor_is_one_leaf():
    pt = pytest.importorskip("pinloader.torch")
    torch = pytest.importorskip("torch")
    out = torch.empty((4, 3))
    src = [np.full((4, 3), b, np.float32) for b in range(3)]
    tp = pt.prefetch(src, device=DEVICE, out=out)
    for b, t in enumerate(tp):
        assert t is out
        assert (out == b).all()


def test_static_stateful_door_ends_its_epoch():
    pt = pytest.importorskip("pinloader.torch")
    tp = pt.prefetch(Stateful(), device=DEVICE, static=True)
    assert len(drain(iter(tp))) == 5
    assert tp.state_dict() == {"pos": 5}


# ---- smaller checks the newer code relies on (each fails on a plausible slip) ----

def test_a_row_gather_over_an_epoch_table_with_negative_rows_is_refused():
    from pinloader._C import RowGather, epoch_table
    src = np.arange(10.0)
    with pytest.raises(IndexError, match=r"rows\[0\] = -1 is out of range"):
        RowGather(src, epoch_table([-1, 0]))
    # a slice of a table whose range starts below 0 is copied and checked row by row
    g = RowGather(src, epoch_table([-1, 0, 1])[1:])
    assert g.source_shape == (10,)


def test_row_batches_refuse_more_batches_than_the_order_holds():
    from pinloader._C import RowBatches, RowGather, epoch_table
    probe = RowGather(np.arange(9.0), np.empty(0, np.int64))
    with pytest.raises(ValueError, match="4 batches of 3 rows do not fit an order of 9 rows"):
        RowBatches([("x", probe, False, None, 0, None)], epoch_table(np.arange(9)), 3, 4)
    RowBatches([("x", probe, False, None, 0, None)], epoch_table(np.arange(9)), 3, 3)


def test_consumed_after_a_world_size_change_is_at_the_new_world_size():
    L = pinloader.ArrayLoader(ids(100), 5, device=DEVICE, rank=0, world_size=2)
    it = iter(L)
    for _ in range(3):
        next(it)
    st = L.state_dict()
    assert st["position"] == 30 and st["consumed"] == 15
    L.close()
    L4 = pinloader.ArrayLoader(ids(100), 5, device=DEVICE, rank=0, world_size=4)
    L4.load_state_dict(st)
    assert L4.state_dict()["consumed"] == 30 // 4
    L4.close()


def test_bytes_are_not_array_leaves_and_list_subclasses_are_walked():
    class Batch(list):
        pass

    pf = pinloader.AsyncPrefetcher([Batch([np.arange(3), b"xy"])], device=DEVICE)
    b = next(pf)
    # a list subclass comes back as itself, Batch(items) (Note [one leaf classifier])
    assert type(b) is Batch
    assert isinstance(b[0], pinloader.DeviceArray) and values(b[0]).tolist() == [0, 1, 2]
    assert b[1] == b"xy" and type(b[1]) is bytes
    pf.close()


@pytest.mark.parametrize("shuffle", [False, True])
def test_device_gather_of_every_row_of_a_source_starting_mid_page(shuffle):
    page = 4096
    raw = np.zeros(page * 8, np.uint8)
    base = (-raw.ctypes.data) % page + page // 2 + 8  # mid-page, 8-byte aligned
    n = (raw.size - base) // 24 - 1
    src = raw[base:base + n * 24].view(np.float64).reshape(n, 3)
    src[:] = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    L = pinloader.ArrayLoader(src, n, device=DEVICE, shuffle=shuffle, gather="device")
    (batch,) = [values(b) for b in L]
    np.testing.assert_array_equal(batch, src[L.indices(0)])
    assert L.stats()["gather"] == "device"
    L.close()


def test_a_loader_over_a_slice_of_a_registered_source_charges_only_new_pages():
    from pinloader import _C
    src = np.arange(4096 * 64, dtype=np.float64).reshape(-1, 8)
    L1 = pinloader.ArrayLoader(src, 64, device=DEVICE, gather="device")
    list(L1)
    assert L1.stats()["gather"] == "device"
    budget = _C._testing.registered_bytes("host")  # all this process holds registered now
    L2 = pinloader.ArrayLoader(src[10:], 64, device=DEVICE, gather="device", max_registered_bytes=budget)
    got = np.concatenate([values(b) for b in L2])
    assert L2.stats()["gather"] == "device"
    np.testing.assert_array_equal(got, src[10:][L2.indices(0)])
    L2.close()
    L1.close()


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"),
                    reason="streaming stores are SSE2's: other machines stage with memcpy")
def test_row_gathers_stream_only_in_batches_of_one_chunk(monkeypatch):
    # Note [non-temporal staging stores] in src/core/stager.c: rows of at least 4 KiB go
    # through streaming stores in a batch of at least 4 MiB staged as one chunk (below 16 MiB),
    # never in a chunked batch, and never rows shorter than 4 KiB
    from pinloader import _C
    monkeypatch.delenv("PINLOADER_STAGING_NT", raising=False)
    src = np.ones((8192, 1024), np.float32)  # rows of 4 KiB
    for rows, bs, streams in ((src, 1100, True), (src, 4200, False),
                              (np.ones((16384, 512), np.float32), 2200, False)):
        before = _C._testing.streamed_bytes()
        L = pinloader.ArrayLoader(rows, bs, device=DEVICE, gather="host", drop_last=True)
        n = len([b for b in L])
        L.close()
        streamed = _C._testing.streamed_bytes() - before
        assert streamed == (n * bs * rows.shape[1] * 4 if streams else 0), (bs, streamed)
