"""Inputs of the fuzz target (tests/test_fuzz.py).

Hypothesis strategies that draw hostile items as plain data (so that Hypothesis prints and shrinks
them), the DLPack exporter that builds capsules byte by byte with ctypes (the ABI is in
tests/helpers.py), and build_leaf / build_tree / check: what each drawn leaf is made into and what
it must come out as. Also the ArrayLoader target's sources (loader_sources, make_source).
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import os

import numpy as np
from hypothesis import strategies as st

import pinloader
from helpers import DLManagedTensor, DLManagedTensorVersioned, capsule_new

# max_pinned_bytes of every prefetcher here: bounds the memory a huge leaf may take (and stays
# small: a bounded prefetcher's slabs are no larger than its bound)
CAP = 4 << 20


# Capsule names must outlive every capsule: module constants.
CAPSULE_NAMES = {"legacy": b"dltensor", "versioned": b"dltensor_versioned", "other": b"not_dltensor"}

# Every dtype DLPack defines that pinloader copies: (code, bits).
VALID_DL_DTYPES = ([(0, b) for b in (8, 16, 32, 64)] + [(1, b) for b in (8, 16, 32, 64)]
                   + [(2, b) for b in (16, 32, 64)] + [(4, 16), (5, 64), (5, 128), (6, 8)]
                   + [(c, 8) for c in range(7, 15)])
BAD_DL_DTYPES = [  # (code, bits, lanes)
    (0, 0, 1), (0, 7, 1), (0, 24, 1), (1, 128, 1), (2, 8, 1), (2, 255, 1), (4, 32, 1),
    (5, 32, 1), (6, 1, 1), (6, 16, 1), (3, 8, 1), (15, 8, 1), (200, 32, 1), (255, 255, 1),
    (2, 32, 0), (2, 32, 2), (0, 8, 65535),
]
PROXY = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.dtype("V16")}
MAX_DIMS = 64  # pinloader's (and NumPy's) limit on dimensions


class Exporter:
    """An object with __dlpack__/__dlpack_device__ handing out a capsule built here.

    `backing` is the memory the tensor points into (kept alive by this object, as are the
    structure and its shape/strides arrays: the capsules carry no destructor, so nothing here is
    ever freed under pinloader)."""

    def __init__(self, spec):
        self.spec = spec
        self.backing = None
        self.device = spec.get("device", (1, 0))
        self.keep = []
        kind = spec.get("capsule", "legacy")
        self.capsule_kind = kind
        if kind in ("legacy", "other"):
            self.m = DLManagedTensor()
            t = self.m.dl_tensor
        else:
            self.m = DLManagedTensorVersioned()
            self.m.version.major = spec.get("major", 1)
            self.m.version.minor = 3
            t = self.m.dl_tensor
        if "backing" in spec:
            self.backing = np.frombuffer(bytearray(spec["backing"]), np.uint8)
            data = self.backing.ctypes.data + spec["data_off"] if spec["backing"] else None
        else:
            data = spec.get("data")
        t.data = data
        t.device.device_type, t.device.device_id = self.device if isinstance(
            self.device, tuple) and len(self.device) == 2 and all(
            isinstance(v, int) and -2**31 <= v < 2**31 for v in self.device) else (1, 0)
        t.ndim = spec["ndim"]
        t.dtype.code, t.dtype.bits, t.dtype.lanes = spec["dtype"]
        t.shape = self._int64s(spec["shape"])
        t.strides = self._int64s(spec["strides"])
        t.byte_offset = spec.get("byte_offset", 0)

    def _int64s(self, values):
        if values is None:
            return None
        arr = (ctypes.c_int64 * max(len(values), 1))(*values)
        self.keep.append(arr)
        return ctypes.addressof(arr)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        how = self.spec.get("export", "capsule")
        if how == "raise":
            raise ValueError("exporter refuses \udcff")
        if how == "not-a-capsule":
            return 42
        name = CAPSULE_NAMES[self.capsule_kind]
        return capsule_new(ctypes.addressof(self.m), name, None)

    def __repr__(self):
        return f"Exporter({self.spec!r})"


# ---- leaves --------------------------------------------------------------------------------------

NUMPY_DTYPES = [np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)]
UNSUPPORTED_NUMPY = ["O", "U3", "S2", "M8[s]", "m8[ms]", ">i4", ">f8", [("a", "<i4"), ("b", "u1")]]

small_shape = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@st.composite
def numpy_view(draw):
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = draw(small_shape)
    seed = draw(st.integers(0, 2**32 - 1))
    ops = []
    if shape:
        for n in shape:
            ops.append((draw(st.sampled_from([1, 1, 2, 3, -1, -2])),
                        draw(st.none() | st.integers(0, max(n - 1, 0))),
                        draw(st.none() | st.integers(0, n))))
    transpose = draw(st.permutations(range(len(shape)))) if shape and draw(st.booleans()) else None
    return {"leaf": "numpy", "dtype": dtype.str, "shape": shape, "seed": seed, "slices": ops,
            "transpose": transpose, "fortran": draw(st.booleans())}


@st.composite
def numpy_as_strided(draw):
    """Any strides in elements (negative, zero, overlapping) over a buffer large enough."""
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    strides = tuple(draw(st.lists(st.integers(-9, 9), min_size=ndim, max_size=ndim)))
    return {"leaf": "as_strided", "dtype": dtype.str, "shape": shape, "strides": strides,
            "seed": draw(st.integers(0, 2**32 - 1))}


# Shapes NumPy can broadcast to (at least for 1-byte dtypes: larger items fall back to uint8
# where NumPy refuses the byte count): one real element seen 2**40 times, 2**63 - 256 times, ...
BROADCAST_SHAPES = [(2**40,), (2**20, 2**20), (2**63 - 256,), (2**31, 2**31), (3, 2**61),
                    (0, 2**62), (2**62, 0), (1 << 16,), (4, 1 << 12), (1,), ()]


@st.composite
def numpy_broadcast(draw):
    return {"leaf": "broadcast", "dtype": np.dtype(draw(st.sampled_from(NUMPY_DTYPES))).str,
            "shape": draw(st.sampled_from(BROADCAST_SHAPES)), "value": draw(st.integers(0, 255))}


@st.composite
def numpy_unsupported(draw):
    return {"leaf": "unsupported", "dtype": draw(st.sampled_from(range(len(UNSUPPORTED_NUMPY)))),
            "n": draw(st.integers(0, 4))}


@st.composite
def pinned_view(draw):
    n = draw(st.sampled_from([64 << 10, (64 << 10) + 8, 100_000, 1 << 20, 256]))
    dtype = draw(st.sampled_from([np.uint8, np.float32, np.int64, np.complex128]))
    return {"leaf": "pinned", "nbytes": n, "dtype": np.dtype(dtype).str,
            "seed": draw(st.integers(0, 2**32 - 1))}


@st.composite
def dlpack_valid(draw):
    """A well-formed capsule over a real buffer: must be copied exactly."""
    code, bits = draw(st.sampled_from(VALID_DL_DTYPES))
    isz = bits // 8
    ndim = draw(st.sampled_from([0, 1, 1, 2, 3, 4, 40]))
    if ndim == 40:
        shape = [1] * 40
        shape[draw(st.integers(0, 39))] = draw(st.integers(0, 5))
    else:
        shape = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    layout = draw(st.sampled_from(["null", "contiguous", "random"]))
    if layout == "null" or ndim == 0:
        strides = None
        el = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(ndim)]
    elif layout == "contiguous":
        el = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(ndim)]
        strides = el
    else:
        el = strides = draw(st.lists(st.integers(-7, 7), min_size=ndim, max_size=ndim))
    size = int(np.prod(shape, dtype=np.int64))
    lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, el)) if size else 0
    hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, el)) if size else 0
    byte_offset = draw(st.sampled_from([0, 0, isz, 3 * isz]))
    start = -lo * isz  # bytes from data + byte_offset back to the lowest element
    nbytes = (hi - lo + 1) * isz + byte_offset + 16 if size else draw(st.sampled_from([0, 16]))
    return {"leaf": "dlpack", "dtype": (code, bits, 1), "ndim": ndim, "shape": shape,
            "strides": strides, "byte_offset": byte_offset, "backing": nbytes,
            "data_off": start if size else 0, "seed": draw(st.integers(0, 2**32 - 1)),
            "capsule": draw(st.sampled_from(["legacy", "versioned"])),
            "device": draw(st.sampled_from([(1, 0), (3, 0)]))}


@st.composite
def dlpack_hostile(draw):
    """A capsule or exporter that no reader may trust: must be refused."""
    base = {"leaf": "dlpack", "dtype": (2, 32, 1), "ndim": 1, "shape": [4], "strides": None,
            "byte_offset": 0, "backing": 64, "data_off": 0, "seed": 0, "capsule": "legacy",
            "device": (1, 0), "hostile": None}
    what = draw(st.sampled_from([
        "negative-shape", "huge-shape", "overflow-shape", "overflow-stride", "overflow-offset",
        "bad-dtype", "negative-ndim", "huge-ndim", "null-data", "bad-major", "bad-name",
        "not-a-capsule", "export-raises", "bad-device"]))
    base["hostile"] = what
    base["capsule"] = draw(st.sampled_from(["legacy", "versioned"]))
    if what == "negative-shape":
        base["ndim"] = draw(st.integers(1, 3))
        base["shape"] = [4] * base["ndim"]
        base["shape"][draw(st.integers(0, base["ndim"] - 1))] = draw(
            st.sampled_from([-1, -2, -(2**31), -(2**63)]))
        base["strides"] = draw(st.sampled_from([None, [0] * base["ndim"], [1] * base["ndim"]]))
    elif what == "huge-shape":  # fits in 64 bits, but far over the cap (zero strides: 1 real element)
        base["dtype"] = (2, 64, 1)
        base["shape"] = [draw(st.sampled_from([2**61 + 1, 2**40, 2**62 - 1, CAP + 1]))]
        base["strides"] = draw(st.sampled_from([None, [0]]))
    elif what == "overflow-shape":  # the element count or byte count overflows 64 bits
        base["ndim"] = 2
        base["dtype"] = (2, 64, 1)
        base["shape"] = draw(st.sampled_from([[2**62, 4], [2**32, 2**32], [2**63 - 1, 2**63 - 1],
                                              [2**61, 2**3]]))
        base["strides"] = draw(st.sampled_from([None, [0, 0]]))
    elif what == "overflow-stride":  # the extent of the strides overflows 64 bits
        base["ndim"] = 1
        base["shape"] = [3]
        base["strides"] = [draw(st.sampled_from([2**62, -(2**62), 2**63 - 1, -(2**63)]))]
    elif what == "overflow-offset":
        base["byte_offset"] = draw(st.sampled_from([2**63, 2**64 - 1, 2**64 - 8]))
    elif what == "bad-dtype":
        base["dtype"] = draw(st.sampled_from(BAD_DL_DTYPES))
    elif what == "negative-ndim":
        base["ndim"] = draw(st.sampled_from([-1, -(2**31)]))
    elif what == "huge-ndim":
        base["ndim"] = draw(st.sampled_from([MAX_DIMS + 1, 1000, 2**31 - 1]))
        # shape/strides hold only 4 entries: a reader must check ndim before reading them
    elif what == "null-data":
        base["backing"] = 0
        base["shape"] = draw(st.sampled_from([[4], [1], [2, 3]]))
        base["ndim"] = len(base["shape"])
    elif what == "bad-major":
        base["capsule"] = "versioned"
        base["major"] = draw(st.sampled_from([0, 2, 2**32 - 1]))
    elif what == "bad-name":
        base["capsule"] = "other"
    elif what == "not-a-capsule":
        base["export"] = "not-a-capsule"
    elif what == "export-raises":
        base["export"] = "raise"
    elif what == "bad-device":
        base["device"] = draw(st.sampled_from([(1,), "cpu", (2**40, 0), (-1, 0), (1, 0, 0),
                                               (7, 0), None]))
    return base


PASS_THROUGH = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=4),
                         st.binary(max_size=4), st.booleans())

LEAF_SPECS = st.one_of(numpy_view(), numpy_as_strided(), numpy_broadcast(), numpy_unsupported(),
                       pinned_view(), dlpack_valid(), dlpack_hostile(),
                       PASS_THROUGH.map(lambda v: {"leaf": "value", "value": v}))


# ---- trees ---------------------------------------------------------------------------------------

KEYS = st.one_of(st.text(min_size=1, max_size=4), st.integers(-3, 3))

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Box:
    a: object
    b: object = None


def tree_specs(max_leaves=8):
    return st.recursive(
        LEAF_SPECS,
        lambda kids: st.one_of(
            st.lists(kids, max_size=3).map(lambda v: ("list", v)),
            st.lists(kids, max_size=3).map(lambda v: ("tuple", v)),
            st.dictionaries(KEYS, kids, max_size=3).map(lambda v: ("dict", list(v.items()))),
            st.tuples(kids, kids).map(lambda v: ("namedtuple", list(v))),
            st.tuples(kids, kids).map(lambda v: ("dataclass", list(v))),
        ),
        max_leaves=max_leaves,
    )


# ---- building and checking -----------------------------------------------------------------------

def _fill(rng, n):
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def build_leaf(spec, pool):
    kind = spec["leaf"]
    if kind == "value":
        return spec["value"], ("same",)
    if kind == "numpy":
        dtype = np.dtype(spec["dtype"])
        rng = np.random.default_rng(spec["seed"])
        n = int(np.prod(spec["shape"], dtype=np.int64)) * dtype.itemsize
        base = _fill(rng, n).view(dtype).reshape(spec["shape"])
        if spec["fortran"]:
            base = np.asfortranarray(base)
        view = base
        if spec["slices"]:
            view = view[tuple(slice(b0, e0, s) for s, b0, e0 in spec["slices"])]
        if spec["transpose"] is not None:
            view = view.transpose(spec["transpose"])
        return view, ("bytes", view.shape, view.tobytes())
    if kind == "as_strided":
        dtype = np.dtype(spec["dtype"])
        isz = dtype.itemsize
        shape, el = spec["shape"], spec["strides"]
        size = int(np.prod(shape, dtype=np.int64))
        lo = sum(min(0, (n - 1) * s) for n, s in zip(shape, el)) if size else 0
        hi = sum(max(0, (n - 1) * s) for n, s in zip(shape, el)) if size else 0
        buf = _fill(np.random.default_rng(spec["seed"]), (hi - lo + 1) * isz).view(dtype)
        view = np.lib.stride_tricks.as_strided(buf[-lo:], shape=shape,
                                               strides=tuple(s * isz for s in el))
        return view, ("bytes", view.shape, view.tobytes())
    if kind == "broadcast":
        dtype = np.dtype(spec["dtype"])
        try:
            view = np.broadcast_to(np.array(spec["value"]).astype(dtype), spec["shape"])
        except ValueError:  # NumPy's own limit on the byte count
            dtype = np.dtype(np.uint8)
            view = np.broadcast_to(np.array(spec["value"]).astype(dtype), spec["shape"])
        nbytes = view.size * dtype.itemsize
        if nbytes > CAP:
            return view, ("raise",)
        return view, ("bytes", view.shape, view.tobytes())
    if kind == "unsupported":
        dt = np.dtype(UNSUPPORTED_NUMPY[spec["dtype"]])
        return np.zeros(spec["n"], dt), ("raise",)
    if kind == "pinned":
        buf = pool.alloc(spec["nbytes"], timeout=30)
        raw = np.frombuffer(buf, np.uint8)
        raw[:] = _fill(np.random.default_rng(spec["seed"]), raw.size)
        dtype = np.dtype(spec["dtype"])
        view = np.frombuffer(buf, dtype, count=spec["nbytes"] // dtype.itemsize)
        return view, ("bytes", view.shape, view.tobytes())
    if kind == "dlpack":
        ex = Exporter(spec)
        if spec.get("hostile"):
            return ex, ("raise",)
        code, bits, _ = spec["dtype"]
        isz = bits // 8
        if ex.backing is not None and ex.backing.size:
            ex.backing[:] = _fill(np.random.default_rng(spec["seed"]), ex.backing.size)
        shape = tuple(spec["shape"])
        size = int(np.prod(shape, dtype=np.int64))
        if not size:
            return ex, ("bytes", shape, b"")
        el = spec["strides"]
        if el is None:
            el = [int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape))]
        # the expected bytes in C order, read without the dimensions of extent 1 (the same
        # order): NumPy before 2.3 copies a strided array of over 32 dimensions with an
        # iterator limited to 32 ("this function only supports up to 32 dimensions")
        keep = [i for i, n in enumerate(shape) if n != 1]
        view = np.ndarray(tuple(shape[i] for i in keep), dtype=PROXY[isz], buffer=ex.backing,
                          offset=spec["data_off"] + spec["byte_offset"],
                          strides=tuple(el[i] * isz for i in keep))
        return ex, ("bytes", shape, view.tobytes())
    raise AssertionError(spec)


def build_tree(spec, pool, bad):
    """(object, expected tree); appends to `bad` when the tree holds a leaf that must be refused."""
    if isinstance(spec, dict):
        obj, exp = build_leaf(spec, pool)
        if exp[0] == "raise":
            bad.append(spec)
        return obj, exp
    kind, kids = spec
    if kind == "dict":
        built = [(k, build_tree(v, pool, bad)) for k, v in kids]
        return {k: o for k, (o, _) in built}, ("dict", [(k, e) for k, (_, e) in built])
    built = [build_tree(k, pool, bad) for k in kids]
    objs = [o for o, _ in built]
    exps = [e for _, e in built]
    if kind == "list":
        return objs, ("list", exps)
    if kind == "tuple":
        return tuple(objs), ("tuple", exps)
    if kind == "namedtuple":
        return Pair(*objs), ("namedtuple", exps)
    return Box(*objs), ("dataclass", exps)


def check(obj, exp, got, where):
    tag = exp[0]
    if tag == "same":
        assert got is obj, f"{where}: {got!r} is not the source object {obj!r}"
    elif tag in ("bytes", "either"):
        assert isinstance(got, pinloader.DeviceArray), f"{where}: got {type(got)!r}"
        shape, raw = exp[1], exp[2]
        assert got.shape == tuple(shape), f"{where}: shape {got.shape} != {tuple(shape)}"
        assert got.nbytes == len(raw), f"{where}: nbytes {got.nbytes} != {len(raw)}"
        assert got.device == "cpu", where
        if raw:
            # .ptr is raw memory: export once first, which on the host backend waits for the
            # batch's copy (Note [ready handoff] in src/py/device_array.c)
            got.__dlpack__()
            assert ctypes.string_at(got.ptr, got.nbytes) == raw, f"{where}: bytes differ"
    elif tag == "dict":
        assert type(got) is dict and list(got) == [k for k, _ in exp[1]], where
        for k, e in exp[1]:
            check(obj[k], e, got[k], f"{where}[{k!r}]")
    elif tag in ("list", "tuple", "namedtuple"):
        assert type(got) is type(obj) and len(got) == len(obj), f"{where}: {type(got)!r}"
        for i, e in enumerate(exp[1]):
            check(obj[i], e, got[i], f"{where}[{i}]")
    elif tag == "dataclass":
        assert type(got) is Box, f"{where}: {type(got)!r}"
        check(obj.a, exp[1][0], got.a, f"{where}.a")
        check(obj.b, exp[1][1], got.b, f"{where}.b")
    else:
        raise AssertionError(exp)


def count_leaves(exp):
    if exp[0] in ("same", "bytes", "either", "raise"):
        return 1
    kids = exp[1]
    return sum(count_leaves(e if exp[0] != "dict" else e[1]) for e in kids)


# ---- ArrayLoader sources -------------------------------------------------------------------------

LOADER_DTYPES = ["int8", "uint16", "int32", "int64", "float16", "float32", "float64",
                 "complex64", "bool"]


@st.composite
def loader_sources(draw):
    n_rows = draw(st.integers(0, 40))
    leaves = []
    for _ in range(draw(st.integers(1, 3))):
        dtype = np.dtype(draw(st.sampled_from(LOADER_DTYPES)))
        row = draw(st.sampled_from([(), (3,), (0,), (2, 0), (2, 3), (1, 5)]))
        layout = draw(st.sampled_from(["c", "fortran", "reversed", "strided", "memmap"]))
        leaves.append((dtype.str, row, layout))
    return n_rows, leaves


def make_source(n_rows, dtype, row, layout, tmp, k):
    base = (np.arange(int(np.prod((n_rows,) + row, dtype=np.int64)) or 0) % 251).astype(dtype)
    a = base.reshape((n_rows,) + row)
    if layout == "fortran":
        a = np.asfortranarray(a)
    elif layout == "reversed":
        a = np.ascontiguousarray(a)[::-1]
    elif layout == "strided":
        b = np.zeros((2 * n_rows,) + row, dtype)
        b[::2] = a
        a = b[::2]
    elif layout == "memmap":
        if a.nbytes == 0:
            return a, None  # an empty file cannot be mapped
        path = os.path.join(tmp, f"leaf{k}.bin")
        m = np.memmap(path, dtype=dtype, mode="w+", shape=a.shape)
        m[...] = a
        m.flush()
        return np.memmap(path, dtype=dtype, mode="r", shape=a.shape), path
    return a, None
