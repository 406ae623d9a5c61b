"""AsyncPrefetcher: what comes out (host backend, device="cpu").

Every numeric dtype, 0-d and size-0 leaves, non-contiguous, negative-stride and Fortran layouts,
items whose structure and dtypes change from batch to batch, containers (tuple, list, dict and its
subclasses, namedtuple, dataclass) rebuilt as they were, buffer-protocol leaves, non-array leaves
passed through as the very same objects, torch tensors in and out, the order of batches under
random delays, and output="capsule".

Everything here runs without a GPU: the host backend runs the same producer thread, pinned pool,
multi-threaded stager and in-order handoff as the CUDA backend, with worker threads standing in
for streams.

Note on iteration: ``iter(pf)`` (and so every ``for`` loop and ``itertools.islice``) starts a
new epoch once the current epoch has handed something out. Tests that consume part of an epoch
and then keep going use ``next(pf)`` / ``drain(pf)`` and never a second ``for`` loop unless the
epoch restart is what they test.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import random
import time

import numpy as np
import pytest

import pinloader
from helpers import CapsuleWrapper, assert_leaf_equal, drain, val

DEVICE = "cpu"


NUMERIC_DTYPES = [
    np.bool_,
    np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
    np.complex64, np.complex128,
]


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


# ---- values, dtypes, layouts ---------------------------------------------------------------------

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


def test_inconsistent_structures_and_dtypes_batch_to_batch():
    rng = np.random.default_rng(3)
    items = [
        {"x": np.arange(5, dtype=np.float32)},
        (np.arange(3, dtype=np.int8), "t"),
        [np.zeros((2, 2), np.complex128), {"nested": np.ones(4, np.uint16)}],
        np.arange(7, dtype=np.float16),
        "just metadata",
        None,
        {"x": np.arange(100000, dtype=np.int64)},   # much larger than the others
        {"x": np.zeros((0, 3), np.float64), "y": np.array(True)},
        {"x": rng.standard_normal((3, 1, 2)).astype(np.float64)[::-1]},
        {},
        [],
        (),
        {"x": np.arange(5, dtype=np.float32)},
    ]
    with pinloader.AsyncPrefetcher(items, device=DEVICE, depth=2) as pf:
        out = drain(pf)
    assert len(out) == len(items)

    def same(e, a):
        if isinstance(e, np.ndarray):
            g = val(a)
            assert g.shape == e.shape and g.dtype == e.dtype and g.tobytes() == e.tobytes()
        elif isinstance(e, dict):
            assert type(a) is dict and list(a) == list(e)
            for k in e:
                same(e[k], a[k])
        elif isinstance(e, (list, tuple)):
            assert type(a) is type(e) and len(a) == len(e)
            for x, y in zip(e, a):
                same(x, y)
        else:
            assert a is e

    for e, a in zip(items, out):
        same(e, a)


# ---- containers ----------------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y", "label"])


@dataclasses.dataclass
class Sample:
    image: object
    target: object
    name: str = "s"


class MyDict(dict):
    pass


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


# ---- buffer protocol and pass-through ------------------------------------------------------------

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


# ---- torch ---------------------------------------------------------------------------------------

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


# ---- ordering ------------------------------------------------------------------------------------

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


# ---- capsule output ------------------------------------------------------------------------------

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
