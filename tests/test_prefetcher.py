"""Functional tests of pinloader.AsyncPrefetcher on the host backend (device="cpu").

Everything here runs without a GPU: the host backend runs the same producer thread, pinned
pool, multi-threaded stager and in-order handoff as the CUDA backend, with worker threads
standing in for streams.

Note on iteration: ``iter(pf)`` (and so every ``for`` loop and ``itertools.islice``) starts a
new epoch once the current epoch has handed something out. Tests that consume part of an epoch
and then keep going use ``next(pf)`` / ``drain(pf)`` and never a second ``for`` loop unless the
epoch restart is what they test.
"""
from __future__ import annotations

import array
import ctypes
import collections
import dataclasses
import os
import random
import threading
import time

import numpy as np
import pytest

import pinloader
from helpers import CapsuleWrapper, drain

DEVICE = "cpu"
ALIGN = 256

NUMERIC_DTYPES = [
    np.bool_,
    np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
    np.complex64, np.complex128,
]


# ---- helpers -------------------------------------------------------------------------------

def to_np(leaf):
    assert isinstance(leaf, pinloader.DeviceArray), f"expected a DeviceArray, got {type(leaf)!r}"
    return np.from_dlpack(leaf)


def random_array(rng, dtype, shape):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "f":
        a = (rng.standard_normal(size=shape) * 1e3).astype(dtype)
        flat = a.reshape(-1)
        specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], dtype=dtype)
        flat[: min(flat.size, specials.size)] = specials[: flat.size]
        return a
    if dtype.kind == "c":
        real = rng.standard_normal(size=shape)
        imag = rng.standard_normal(size=shape)
        return (real + 1j * imag).astype(dtype)
    raise AssertionError(dtype)


def assert_leaf_equal(expected, leaf, where="item"):
    """leaf is the DeviceArray delivered for the array-like `expected`: same shape, dtype, bytes."""
    exp = np.asarray(expected)
    assert isinstance(leaf, pinloader.DeviceArray), f"{where}: got {type(leaf)!r}, expected DeviceArray"
    assert leaf.shape == exp.shape, where
    assert leaf.ndim == exp.ndim, where
    assert leaf.dtype == exp.dtype, where
    assert leaf.nbytes == exp.nbytes, where
    assert leaf.device == "cpu", where
    assert leaf.__dlpack_device__() == (1, 0), where
    if exp.size:
        assert leaf.ptr % ALIGN == 0, f"{where}: leaf not {ALIGN}-byte aligned"
    got = np.from_dlpack(leaf)
    assert got.shape == exp.shape, where
    assert got.dtype == exp.dtype, where
    # bit-exact: a copy must preserve NaN payloads, -0.0, every byte
    assert got.tobytes() == exp.tobytes(), f"{where}: values differ"


def assert_tree_equal(expected, actual, where="item"):
    if isinstance(expected, np.ndarray):
        assert_leaf_equal(expected, actual, where)
        return
    if isinstance(expected, (bytearray, memoryview, array.array)):
        assert_leaf_equal(np.asarray(expected), actual, where)
        return
    if isinstance(expected, dict):
        assert type(actual) is type(expected), where
        assert list(actual.keys()) == list(expected.keys()), where
        for k in expected:
            assert_tree_equal(expected[k], actual[k], f"{where}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), where
        assert len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_tree_equal(e, a, f"{where}[{i}]")
        return
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        assert type(actual) is type(expected), where
        for f in dataclasses.fields(expected):
            assert_tree_equal(getattr(expected, f.name), getattr(actual, f.name), f"{where}.{f.name}")
        return
    # every other leaf passes through unchanged: the very same object
    assert actual is expected, f"{where}: {actual!r} is not the source object {expected!r}"


def count_tasks():
    return len(os.listdir("/proc/self/task"))


Point = collections.namedtuple("Point", ["x", "y", "label"])


@dataclasses.dataclass
class Sample:
    image: object
    target: object
    name: str = "s"


class MyDict(dict):
    pass


# ---- values, dtypes, layouts ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_numeric_dtype_roundtrips(dtype):
    rng = np.random.default_rng(1234)
    items = []
    for i in range(4):
        items.append({
            "matrix": random_array(rng, dtype, (3, 5)),
            "scalar0d": random_array(rng, dtype, ()),
            "empty": random_array(rng, dtype, (0, 4)),
            "vec": random_array(rng, dtype, (17 + i,)),
            "meta": ("idx", i),
        })
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    assert len(out) == len(items)
    for exp, got in zip(items, out):
        assert_tree_equal(exp, got)
        assert got["matrix"].dtype == np.dtype(dtype)


def test_zero_dim_and_size_zero_leaves():
    items = [
        (np.array(7, np.int16), np.zeros((0,)), np.zeros((2, 0, 4), np.complex64), np.zeros((0, 0)),
         np.array(3.5), np.ones((1, 1, 1), np.uint8)),
    ] * 3
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    assert len(out) == 3
    for b in out:
        assert_tree_equal(items[0], b)
        assert b[0].shape == () and b[0].ndim == 0
        assert b[2].nbytes == 0


def test_non_contiguous_negative_strides_and_fortran_order():
    base = np.arange(2 * 6 * 10, dtype=np.float64).reshape(2, 6, 10)
    leaves = {
        "step": base[:, ::2, ::3],
        "negative": base[::-1, :, ::-1],
        "negative_step": base[:, ::-2, 1::-4],
        "fortran": np.asfortranarray(base),
        "fortran_2d": np.asfortranarray(np.arange(35, dtype=np.int32).reshape(5, 7)),
        "transpose": base.transpose(2, 0, 1),
        "column": base[0, :, 3],
        "broadcast_zero_stride": np.broadcast_to(np.arange(5, dtype=np.int64), (4, 5)),
        "single_col_view": base[:, :, 4:5],
        "reversed_1d": np.arange(100, dtype=np.uint16)[::-1],
    }
    assert not leaves["step"].flags.c_contiguous
    assert leaves["negative"].strides[0] < 0
    assert leaves["broadcast_zero_stride"].strides[0] == 0
    items = [leaves, dict(leaves)]
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    for exp, got in zip(items, out):
        assert_tree_equal(exp, got)


def test_large_leaf_multithreaded_chunked_staging():
    # 64 MiB contiguous plus a 32 MiB strided view: both above the 2 x 8 MiB chunking threshold,
    # staged by two threads.
    big = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
    strided_base = np.arange(8 << 20, dtype=np.int64).reshape(2048, 4096)  # 64 MiB
    strided = strided_base[:, ::2]  # 32 MiB, non-contiguous
    items = [
        {"big": big, "strided": strided, "tag": "a"},
        {"big": big[::-1], "strided": strided[::-1], "tag": "b"},
    ]
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, staging_threads=2)
    try:
        assert pf.staging_threads == 2
        out = drain(pf)
        assert len(out) == 2
        for exp, got in zip(items, out):
            assert got["tag"] is exp["tag"]
            for k in ("big", "strided"):
                leaf = got[k]
                assert leaf.shape == exp[k].shape and leaf.dtype == exp[k].dtype
                assert np.array_equal(np.from_dlpack(leaf), exp[k])
        st = pf.stats()
        assert st["bytes"] >= 2 * (big.nbytes + strided.nbytes)
    finally:
        pf.close()


MiB = 1 << 20
CHUNK = 8 * MiB  # the staging chunk: batches staging >= 2 chunks are copied chunk by chunk


def odd_bytes(seed, n):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def assert_bytes_equal(expected, leaf, where):
    got = np.from_dlpack(leaf)
    assert got.shape == expected.shape and got.dtype == expected.dtype, where
    if not np.array_equal(got.view(np.uint8).reshape(-1), expected.view(np.uint8).reshape(-1)):
        diff = np.flatnonzero(got.view(np.uint8).reshape(-1) != expected.view(np.uint8).reshape(-1))
        raise AssertionError(f"{where}: {diff.size} bytes differ, first at byte {diff[0]} "
                             f"of {expected.nbytes}")


# Staged totals around and past the chunked path: the last chunk is partial unless the total is a
# multiple of CHUNK (one thread stages inline on the calling thread: the default on 1-CPU hosts).
# The ones that are multiples of the 256-byte alignment end exactly at the end of the staged
# region: a short last chunk loses a data byte there, not padding.
STAGED_SIZES = [2 * CHUNK + 256, 3 * CHUNK - 256, 2 * CHUNK + 1, 2 * CHUNK + 255, 3 * CHUNK - 3,
                2 * CHUNK - 1, 2 * CHUNK]


@pytest.mark.parametrize("threads,nbytes", [(1, n) for n in STAGED_SIZES] + [
    (2, STAGED_SIZES[0]), (2, STAGED_SIZES[2]), (3, STAGED_SIZES[1]), (4, STAGED_SIZES[3])])
def test_chunked_staging_last_partial_chunk_is_exact(threads, nbytes):
    # A single leaf, and the same bytes through a non-contiguous view, every byte checked.
    data = odd_bytes(nbytes, nbytes)
    strided = np.lib.stride_tricks.as_strided(data, shape=(nbytes // 2,), strides=(2,))
    items = [{"flat": data}, {"strided": strided}, (data[::-1],)]
    with pinloader.AsyncPrefetcher(items, device=DEVICE, staging_threads=threads, depth=1) as pf:
        assert pf.staging_threads == threads
        b0 = next(pf)
        assert_bytes_equal(data, b0["flat"], f"flat {nbytes} B, {threads} thread(s)")
        del b0
        b1 = next(pf)
        assert_bytes_equal(strided, b1["strided"], f"strided {nbytes // 2} B")
        del b1
        b2 = next(pf)
        assert_bytes_equal(data[::-1], b2[0], f"reversed {nbytes} B")
        with pytest.raises(StopIteration):
            next(pf)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunked_staging_multi_leaf_batch_of_odd_sizes(threads):
    # Many leaves of odd sizes whose aligned total is >= 2 chunks and not a multiple of a chunk:
    # leaves straddle chunk boundaries, and the last chunk is partial.
    # (first and last end on the 256-byte alignment, so in both orders the region's last byte is data)
    sizes = [5 * MiB + 256, 1, 3 * MiB + 255, 257, 7 * MiB + 1, 4 * MiB - 3, 12345, 0, 99, 4352]
    leaves = [odd_bytes(i, n) for i, n in enumerate(sizes)]
    leaves[2] = leaves[2].view(np.uint8)[::-1]  # one strided (reversed) leaf among them
    assert sum(-(-n // ALIGN) * ALIGN for n in sizes) >= 2 * CHUNK
    assert sum(-(-n // ALIGN) * ALIGN for n in sizes) % CHUNK
    items = [{"leaves": list(leaves), "i": i} for i in range(2)]
    items[1]["leaves"] = leaves[::-1]
    with pinloader.AsyncPrefetcher(items, device=DEVICE, staging_threads=threads) as pf:
        for exp in items:
            got = next(pf)
            assert got["i"] == exp["i"]
            for j, (e, g) in enumerate(zip(exp["leaves"], got["leaves"])):
                assert_bytes_equal(e, g, f"batch {exp['i']} leaf {j} ({e.nbytes} B, {threads} thread(s))")
            del got


def test_big_nested_structure_1000_leaves():
    rng = np.random.default_rng(7)
    dtypes = [np.float32, np.int64, np.uint8, np.float16, np.bool_, np.complex64]

    def make(seed):
        r = np.random.default_rng(seed)
        item = {}
        for g in range(10):
            group = []
            for j in range(100):
                dt = dtypes[(g + j) % len(dtypes)]
                shape = tuple(int(s) for s in r.integers(0, 4, size=(j % 3)))
                group.append(random_array(r, dt, shape))
            item[f"group{g}"] = group if g % 2 else tuple(group)
        item["meta"] = {"seed": seed, "name": f"batch{seed}", "none": None}
        return item

    items = [make(int(s)) for s in rng.integers(0, 1 << 30, size=3)]
    n_leaves = sum(len(v) for k, v in items[0].items() if k.startswith("group"))
    assert n_leaves == 1000
    with pinloader.AsyncPrefetcher(items, device=DEVICE, depth=2) as pf:
        out = drain(pf)
    assert len(out) == 3
    for exp, got in zip(items, out):
        assert_tree_equal(exp, got)


def test_container_types_preserved():
    item = {
        "tuple": (np.arange(3), "t"),
        "list": [np.arange(4.0), [np.ones(2, np.int8)]],
        "ordered": collections.OrderedDict([("b", np.arange(2)), ("a", np.zeros(1))]),
        "subclass": MyDict(q=np.arange(5, dtype=np.uint32)),
        "namedtuple": Point(np.arange(2), np.zeros((2, 2)), "pt"),
        "dataclass": Sample(np.zeros((2, 3), np.uint8), np.int64(3)),
        "nested": [{"deep": (Point(np.arange(1), 1, "x"),)}],
    }
    with pinloader.AsyncPrefetcher([item, item], device=DEVICE) as pf:
        out = drain(pf)
    assert len(out) == 2
    for got in out:
        assert_tree_equal(item, got)
        assert isinstance(got["ordered"], collections.OrderedDict)
        assert list(got["ordered"]) == ["b", "a"]
        assert type(got["namedtuple"]) is Point
        assert got["namedtuple"].label == "pt"
        assert type(got["dataclass"]) is Sample


def test_defaultdict_preserved():
    # defaultdict is the commonest dict subclass in collate code; its constructor takes the
    # default_factory first, so it cannot be rebuilt as type(obj)(items).
    dd = collections.defaultdict(list)
    dd["x"] = np.arange(4)
    dd["meta"] = "m"
    with pinloader.AsyncPrefetcher([{"batch": dd}], device=DEVICE) as pf:
        (got,) = drain(pf)
    out = got["batch"]
    assert type(out) is collections.defaultdict
    assert out.default_factory is list
    assert list(out) == ["x", "meta"]
    assert_leaf_equal(dd["x"], out["x"])
    assert out["meta"] is dd["meta"]


def test_dict_key_order_preserved():
    keys = [f"k{i}" for i in (5, 3, 9, 1, 0, 7)]
    item = {k: np.full(2, i) for i, k in enumerate(keys)}
    with pinloader.AsyncPrefetcher([item], device=DEVICE) as pf:
        (got,) = drain(pf)
    assert list(got) == keys


# ---- buffer protocol and pass-through --------------------------------------------------------

def test_buffer_protocol_leaves():
    strided_mv = memoryview(np.arange(20, dtype=np.int32))[::3]
    leaves = [
        bytearray(b"hello world"),
        memoryview(b"abcdefgh"),
        memoryview(bytearray(range(16))).cast("d"),
        array.array("i", [1, -2, 3, -4]),
        array.array("d", [1.5, 2.5, -0.0]),
        array.array("B", range(200)),
        array.array("l", []),
        strided_mv,
    ]
    items = [tuple(leaves), {"ba": bytearray(3)}]
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    assert len(out) == 2
    for exp, got in zip(leaves, out[0]):
        assert_leaf_equal(np.asarray(exp), got)
    assert_leaf_equal(np.zeros(3, np.uint8), out[1]["ba"])


@pytest.mark.parametrize("make", [
    lambda: np.arange(5, dtype=np.longlong),
    lambda: np.arange(5, dtype=np.ulonglong),
    lambda: array.array("q", [1, -2, 3]),
    lambda: memoryview(np.arange(4, dtype=np.int64).tobytes()).cast("q"),
], ids=["np.longlong", "np.ulonglong", "array-q", "memoryview-cast-q"])
def test_long_long_dtype_is_accepted(make):
    # On LP64 Linux 'q'/'Q' (long long) are 64-bit integers just like 'l'/'L': NumPy reports
    # them as int64/uint64, and array.array('q'), memoryview.cast('q'), ctypes c_longlong and
    # struct-described buffers produce them. They must copy like any other int64 array.
    obj = make()
    expected = np.asarray(obj)
    assert expected.dtype.kind in "iu" and expected.dtype.itemsize == 8
    with pinloader.AsyncPrefetcher([{"v": obj}], device=DEVICE) as pf:
        (got,) = drain(pf)
    assert_leaf_equal(expected, got["v"], "item['v']")


def test_non_array_leaves_pass_through_unchanged():
    class Custom:
        pass

    def fn():
        return 1

    passthrough = [
        "a string", b"some bytes", 12345678901234567890, -3, 2.5, 1 + 2j, True, None,
        np.float32(1.5), np.int64(-7), np.bool_(True), np.complex128(1j), np.datetime64("2020-01-01"),
        Custom(), fn, Ellipsis, frozenset({1, 2}), range(3),
    ]
    item = {"values": list(passthrough), "tup": tuple(passthrough), "arr": np.arange(3)}
    with pinloader.AsyncPrefetcher([item], device=DEVICE) as pf:
        (got,) = drain(pf)
    for exp, g in zip(passthrough, got["values"]):
        assert g is exp, f"{exp!r} was not passed through as the same object"
    for exp, g in zip(passthrough, got["tup"]):
        assert g is exp
    assert_leaf_equal(item["arr"], got["arr"])


def test_item_that_is_a_bare_array_or_scalar():
    items = [np.arange(5), "just a string", 42, None, np.ones((2, 2))]
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    assert len(out) == len(items)
    for exp, got in zip(items, out):
        assert_tree_equal(exp, got)


# ---- torch --------------------------------------------------------------------------------

def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    tensors = {
        "f32": base,
        "bf16": torch.arange(24, dtype=torch.bfloat16).reshape(4, 6) / 3,
        "f16": torch.linspace(-2, 2, 9, dtype=torch.float16),
        "i64": torch.arange(10, dtype=torch.int64) - 5,
        "u8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(4, dtype=torch.complex64),
        "noncontig_step": base[:, ::2, 1::2],
        "transposed": base.transpose(0, 2),
        "narrowed": base.narrow(1, 1, 2),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
    }
    assert not tensors["noncontig_step"].is_contiguous()
    items = [dict(tensors), {"x": tensors["bf16"], "meta": "m"}]
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        out = drain(pf)
    assert len(out) == 2
    got = out[0]
    assert got["bf16"].dtype == "bfloat16"
    assert isinstance(got["f32"].dtype, np.dtype) and got["f32"].dtype == np.float32
    for k, t in tensors.items():
        leaf = got[k]
        assert isinstance(leaf, pinloader.DeviceArray), k
        assert leaf.shape == tuple(t.shape), k
        back = torch.from_dlpack(leaf)
        assert back.dtype == t.dtype, k
        assert back.shape == t.shape, k
        assert torch.equal(back, t), k
    assert torch.equal(torch.from_dlpack(out[1]["x"]), tensors["bf16"])
    assert out[1]["meta"] is items[1]["meta"]


def test_torch_tensor_leaves_in_containers_and_numpy_readback():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    item = Point(t, t.t(), "lbl")
    with pinloader.AsyncPrefetcher([item], device=DEVICE) as pf:
        (got,) = drain(pf)
    assert type(got) is Point and got.label == "lbl"
    assert np.array_equal(np.from_dlpack(got.x), t.numpy())
    assert np.array_equal(np.from_dlpack(got.y), t.t().numpy())


# ---- ordering ---------------------------------------------------------------------------

def test_order_preserved_under_random_source_delays():
    n = 300
    rnd = random.Random(42)
    delays = [rnd.uniform(0, 0.003) for _ in range(n)]

    def source():
        for i in range(n):
            time.sleep(delays[i])
            yield {"i": i, "x": np.full((rnd.randint(1, 50),), i, dtype=np.int64)}

    with pinloader.AsyncPrefetcher(source(), device=DEVICE, depth=3) as pf:
        seen = []
        for b in pf:
            # consumer also jitters, so the queue alternates between full and empty
            if b["i"] % 7 == 0:
                time.sleep(0.002)
            x = np.from_dlpack(b["x"])
            assert (x == b["i"]).all()
            seen.append(b["i"])
    assert seen == list(range(n))


# ---- len, epochs, restart ----------------------------------------------------------------

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


# ---- lifecycle ------------------------------------------------------------------------------

def test_context_manager_closes():
    src = [np.arange(3)] * 5
    with pinloader.AsyncPrefetcher(src, device=DEVICE) as pf:
        assert not pf.closed
        first = next(pf)
    assert pf.closed
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    assert_leaf_equal(src[0], first)


def test_context_manager_closes_on_exception():
    class Oops(Exception):
        pass

    with pytest.raises(Oops):
        with pinloader.AsyncPrefetcher([np.arange(3)] * 5, device=DEVICE) as pf:
            next(pf)
            raise Oops
    assert pf.closed


def test_close_is_idempotent_and_blocks_further_use():
    pf = pinloader.AsyncPrefetcher([np.arange(3)] * 10, device=DEVICE)
    next(pf)
    pf.close()
    pf.close()
    pf.close()
    assert pf.closed
    with pytest.raises(ValueError, match="closed"):
        next(pf)
    with pytest.raises(ValueError, match="closed"):
        iter(pf)
    with pytest.raises(ValueError):
        with pf:
            pass
    # stats and repr still answer after close
    assert pf.stats()["batches"] >= 1
    assert "closed" in repr(pf)


def test_close_before_anything_consumed():
    pf = pinloader.AsyncPrefetcher([np.arange(3)] * 10, device=DEVICE)
    pf.close()
    assert pf.closed
    with pytest.raises(ValueError):
        next(pf)


def test_properties():
    src = [np.arange(3)]
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, depth=5, staging_threads=3)
    try:
        assert pf.device == "cpu"
        assert pf.depth == 5
        assert pf.source is src
        assert pf.staging_threads == 3
        assert pf.closed is False
        assert "cpu" in repr(pf)
    finally:
        pf.close()
    assert pf.closed is True


def test_default_device_without_cuda_is_host():
    if pinloader.cuda_available():
        pytest.skip("CUDA is usable here: device=None selects it")
    with pinloader.AsyncPrefetcher([np.arange(3)], device=None) as pf:
        assert pf.device == "cpu"
        (b,) = drain(pf)
        assert b.device == "cpu"
        assert pf.stats()["backend"] == "host"


# ---- capsule output -------------------------------------------------------------------------

def _is_capsule(o):
    return type(o).__name__ == "PyCapsule"


def test_capsule_output_mode():
    items = [
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": [np.arange(3)[::-1], "s"],
         "c": (np.array(5, np.int8), None)},
    ] * 3
    with pinloader.AsyncPrefetcher(items, device=DEVICE, output="capsule") as pf:
        out = drain(pf)
    assert len(out) == 3
    for got in out:
        exp = items[0]
        for cap, e in [(got["a"], exp["a"]), (got["b"][0], exp["b"][0]), (got["c"][0], exp["c"][0])]:
            assert _is_capsule(cap), type(cap)
            arr = np.from_dlpack(CapsuleWrapper(cap))
            assert arr.shape == e.shape and arr.dtype == e.dtype
            assert arr.tobytes() == e.tobytes()
        assert got["b"][1] is exp["b"][1]
        assert got["c"][1] is None


def test_capsule_output_mode_in_every_container_type():
    # output="capsule" promises capsules in place of DeviceArrays wherever they sit: namedtuple,
    # dataclass, OrderedDict and dict subclasses included.
    item = {
        "nt": Point(np.arange(3), np.zeros(2), "p"),
        "dc": Sample(np.ones(4), np.arange(2)),
        "od": collections.OrderedDict(z=np.arange(5)),
        "sub": MyDict(w=np.arange(6)),
    }
    with pinloader.AsyncPrefetcher([item], device=DEVICE, output="capsule") as pf:
        (got,) = drain(pf)
    leaves = {
        "nt.x": (got["nt"].x, item["nt"].x),
        "nt.y": (got["nt"].y, item["nt"].y),
        "dc.image": (got["dc"].image, item["dc"].image),
        "dc.target": (got["dc"].target, item["dc"].target),
        "od['z']": (got["od"]["z"], item["od"]["z"]),
        "sub['w']": (got["sub"]["w"], item["sub"]["w"]),
    }
    not_capsules = [k for k, (g, _) in leaves.items() if not _is_capsule(g)]
    assert not not_capsules, f"output='capsule' left DeviceArrays at {not_capsules}"
    for k, (g, e) in leaves.items():
        assert np.array_equal(np.from_dlpack(CapsuleWrapper(g)), e), k


def test_bad_output_and_priority_arguments():
    with pytest.raises(ValueError, match="output"):
        pinloader.AsyncPrefetcher([], device=DEVICE, output="tensor")
    with pytest.raises(ValueError, match="copy_stream_priority"):
        pinloader.AsyncPrefetcher([], device=DEVICE, copy_stream_priority="urgent")
    with pinloader.AsyncPrefetcher([np.arange(2)], device=DEVICE, copy_stream_priority="normal") as pf:
        (b,) = drain(pf)
        assert_leaf_equal(np.arange(2), b)
    with pinloader.AsyncPrefetcher([np.arange(2)], device=DEVICE, copy_stream_priority="low") as pf:
        (b,) = drain(pf)  # "low" is "normal": the device's least priority
        assert_leaf_equal(np.arange(2), b)


# ---- stats ---------------------------------------------------------------------------------

STATS_KEYS = {
    "batches", "bytes", "padding_bytes", "h2d_gbps", "wait_s_total", "wait_ms_mean", "wait_ms_p99", "next_s_total",
    "staging_s_total", "copy_issue_s_total", "pinned_bytes_in_use", "pinned_bytes_reserved",
    "pinned_bytes_peak", "pinned_cap", "device_bytes_peak", "pinned_stalls", "pinned_stall_s",
    "queued", "backend",
}


def test_stats_fields_are_sane():
    rng = np.random.default_rng(0)
    items = []
    for i in range(12):
        items.append({
            "a": rng.standard_normal((i + 1, 7)).astype(np.float32),
            "b": np.zeros(i * 100, np.uint8),
            "c": np.arange(3, dtype=np.int16)[::-1],
            "s": "meta",
        })
    pf = pinloader.AsyncPrefetcher(items, device=DEVICE, depth=3)
    try:
        st0 = pf.stats()
        assert set(st0) >= STATS_KEYS, STATS_KEYS - set(st0)
        out = drain(pf)
        st = pf.stats()
    finally:
        pf.close()
    assert len(out) == 12
    assert st["batches"] == 12
    raw = sum(v.nbytes for it in items for v in it.values() if isinstance(v, np.ndarray))
    rounded = sum(-(-v.nbytes // ALIGN) * ALIGN for it in items for v in it.values()
                  if isinstance(v, np.ndarray))
    assert st["bytes"] == raw  # payload only; alignment is reported apart
    assert st["bytes"] + st["padding_bytes"] == rounded
    assert st["backend"] == "host"
    for k in ("h2d_gbps", "wait_s_total", "wait_ms_mean", "wait_ms_p99", "next_s_total",
              "staging_s_total", "copy_issue_s_total", "pinned_stall_s"):
        assert isinstance(st[k], float) and st[k] >= 0.0, k
    for k in ("pinned_bytes_in_use", "pinned_bytes_reserved", "pinned_bytes_peak", "pinned_cap",
              "device_bytes_peak", "pinned_stalls", "queued"):
        assert isinstance(st[k], int) and st[k] >= 0, k
    assert st["pinned_bytes_peak"] >= st["pinned_bytes_reserved"] > 0
    assert st["pinned_bytes_reserved"] <= st["pinned_cap"]
    assert st["pinned_bytes_in_use"] <= st["pinned_bytes_reserved"]
    assert st["device_bytes_peak"] >= max(-(-v.nbytes // ALIGN) * ALIGN for v in items[-1].values()
                                          if isinstance(v, np.ndarray))
    assert 0 <= st["queued"] <= 3
    assert st["wait_ms_p99"] >= 0.0
    assert st["wait_ms_mean"] * 12 <= st["wait_s_total"] * 1000 + 1e-6 or st["wait_s_total"] == 0


def test_stats_bytes_exact_for_known_layout():
    # payload 3 + 0 + 300 bytes per batch, laid out as 3 B -> 256, 0 B -> 0, 300 B -> 512
    items = [(np.zeros(3, np.int8), np.zeros(0), np.zeros(300, np.uint8))] * 4
    with pinloader.AsyncPrefetcher(items, device=DEVICE) as pf:
        drain(pf)
        st = pf.stats()
    assert st["batches"] == 4
    assert st["bytes"] == 4 * (3 + 0 + 300)
    assert st["padding_bytes"] == 4 * ((256 - 3) + 0 + (512 - 300))


# ---- depth ---------------------------------------------------------------------------------

class PullCounter:
    def __init__(self, n):
        self.n = n
        self.pulled = 0
        self.lock = threading.Lock()

    def __iter__(self):
        for i in range(self.n):
            with self.lock:
                self.pulled += 1
            yield {"i": i, "x": np.full(16, i)}


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_depth_bounds_how_far_the_producer_runs_ahead(depth):
    src = PullCounter(200)
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, depth=depth)
    try:
        b = next(pf)
        assert b["i"] == 0
        # the producer does run ahead (it is a prefetcher) ...
        assert _wait_for(lambda: src.pulled >= depth), src.pulled
        time.sleep(0.2)
        # ... but no further than depth batches (plus the one being built, plus slack of one)
        assert src.pulled <= depth + 2, f"depth={depth} but {src.pulled} items pulled"
        assert pf.stats()["queued"] <= depth
        # consuming one more lets it pull one more, not more
        next(pf)
        time.sleep(0.1)
        assert src.pulled <= depth + 3
    finally:
        pf.close()


# ---- the ready-event wait, made deterministic ------------------------------------------------

def test_dlpack_export_waits_for_the_held_copy():
    # pinloader._C._debug_hold_copies(True) holds the host backend's copy streams: every copy
    # issued after it stays queued until _debug_hold_copies(False). A batch handed out while its
    # copy is held has not been filled yet, so a consumer that skipped the ready-event wait
    # would read unfilled memory every time, not only when a race happens to go that way.
    hold = getattr(pinloader._C, "_debug_hold_copies", None)
    assert hold is not None, (
        "pinloader._C._debug_hold_copies(flag) is missing: the host-backend debug switch that "
        "holds the copy streams (this test needs it)")
    n = 1 << 20
    src = np.frombuffer(os.urandom(n), dtype=np.uint8)  # fresh bytes: no stale copy can match
    released = threading.Event()

    def release():
        released.set()  # set first: whatever the export returns must come after this
        hold(False)

    watchdog = threading.Timer(30.0, release)  # never leave the copies held, whatever fails
    watchdog.start()
    pf = None
    try:
        hold(True)
        pf = pinloader.AsyncPrefetcher([{"x": src}], device=DEVICE, depth=1)
        b = next(pf)
        assert not released.is_set(), "next() waited for the held copy (it must hand out at once)"
        leaf = b["x"]
        assert leaf.nbytes == n
        # .ptr is the raw block: before the release the held copy has not filled it
        raw = ctypes.string_at(leaf.ptr, n)
        assert raw != src.tobytes(), "the block was filled while its copy was held"
        # the export waits for the copy: release from another thread a little later
        threading.Timer(0.2, release).start()
        got = np.from_dlpack(leaf)
        assert released.is_set(), "np.from_dlpack returned before the held copy was released"
        assert np.array_equal(got, src), "the export returned before the copy landed"
        assert ctypes.string_at(leaf.ptr, n) == src.tobytes()
    finally:
        if not released.is_set():
            release()
        watchdog.cancel()
        if pf is not None:
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
