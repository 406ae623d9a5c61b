"""The framework front doors on the host backend (CI): the torch door (over any source and over
an ArrayLoader), lazy imports of the CuPy and JAX doors, and `import pinloader` importing no
framework.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import warnings

import numpy as np
import pytest

import pinloader
from helpers import ids, run_py, sample, values


def test_import_pinloader_imports_no_framework():
    code = ("import sys, pinloader; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    out = run_py(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- the torch door ----

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Sample:
    image: np.ndarray
    label: int


def _items(n):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32),
             "pair": Pair(np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::-1], "tag"),
             "list": [np.full(3, i, np.uint8), None],
             "sample": Sample(np.ones((2, 2), np.float16) * i, i)} for i in range(n)]


def test_torch_door_yields_equal_tensors_with_same_structure():
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt

    src = _items(5)
    with pt.prefetch(src, device="cpu") as batches:
        assert len(batches) == 5
        out = list(batches)
    assert len(out) == 5
    for ref, b in zip(src, out):
        assert isinstance(b["x"], torch.Tensor) and b["x"].device.type == "cpu"
        assert torch.equal(b["x"], torch.from_numpy(ref["x"]))
        assert isinstance(b["pair"], Pair) and b["pair"].b == "tag"
        assert torch.equal(b["pair"].a, torch.from_numpy(np.ascontiguousarray(ref["pair"].a)))
        assert b["list"][1] is None and torch.equal(b["list"][0], torch.from_numpy(ref["list"][0]))
        assert isinstance(b["sample"], Sample) and b["sample"].label == ref["sample"].label
        assert b["sample"].image.dtype == torch.float16


def test_torch_door_epochs_len_and_set_epoch():
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt

    class Sampler:
        epoch = None

        def set_epoch(self, e):
            self.epoch = e

    class Loader:
        pin_memory = False

        def __init__(self):
            self.sampler = Sampler()

        def __len__(self):
            return 3

        def __iter__(self):
            return iter([torch.full((2,), i) for i in range(3)])

    loader = Loader()
    batches = pt.prefetch(loader, device="cpu")
    for epoch in range(3):
        batches.set_epoch(epoch)
        assert loader.sampler.epoch == epoch
        assert [int(t[0]) for t in batches] == [0, 1, 2]
    assert len(batches) == 3
    batches.close()


def test_torch_door_warns_once_about_pin_memory():
    pytest.importorskip("torch")
    import pinloader.torch as pt

    class PinnedLoader(list):
        pin_memory = True

    pt._warned_pin_memory = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pt.prefetch(PinnedLoader([np.zeros(2)]), device="cpu").close()
        pt.prefetch(PinnedLoader([np.zeros(2)]), device="cpu").close()
    msgs = [w for w in caught if "pin_memory=True" in str(w.message)]
    assert len(msgs) == 1


def test_torch_door_rejects_unknown_device():
    pytest.importorskip("torch")
    import pinloader.torch as pt

    with pytest.raises(ValueError, match="device must be"):
        pt.prefetch([np.zeros(1)], device="meta")


def test_bool_device_is_refused_by_the_torch_door():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    with pytest.raises(TypeError, match=r"pinloader.torch.prefetch: device must be .* not bool"):
        pt.prefetch([np.arange(3)], device=True)


# ---- the torch door over an ArrayLoader ----

def test_torch_door_wraps_the_loader_prefetcher():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    n = 50
    a = sample((n, 3), np.float32)
    L = pinloader.ArrayLoader((ids(n), a), 16, seed=2)
    tp = pt.prefetch(L, device="cpu", depth=3, staging_threads=2)
    assert tp._pf._loader is L and len(tp) == 4
    for epoch in range(2):
        tp.set_epoch(epoch)
        got = list(tp)
        idx = np.concatenate([g[0].numpy() for g in got])
        assert np.array_equal(idx, L.indices(epoch))
        assert np.array_equal(np.concatenate([g[1].numpy() for g in got]), a[idx])
    assert L.stats()["batches"] == 8
    tp.close()
    assert L.closed
    with pytest.raises(ValueError, match="device"):
        pt.prefetch(pinloader.ArrayLoader(ids(n), 4, device="cpu"), device="cuda:1")
    with pytest.raises(ValueError, match="staging_threads"):
        pt.prefetch(pinloader.ArrayLoader(ids(n), 4, staging_threads=1), device="cpu", staging_threads=2)


def test_a_doors_explicit_depth_wins_over_the_loaders_default():
    """A door left without depth uses the loader's depth; an explicit one, 2 included (the
    doors' own default value), is the prefetcher's; a loader's own explicit depth clashes."""
    pytest.importorskip("torch")
    import pinloader.torch as pt
    data = np.arange(12, dtype=np.float32)
    for loader_depth, door_opts, want in ((None, {}, 3), (None, {"depth": 2}, 2), (4, {}, 4),
                                          (2, {"depth": 2}, 2)):
        L = pinloader.ArrayLoader(data, 4, device="cpu", depth=loader_depth)
        T = pt.prefetch(L, **door_opts)
        assert len(list(T)) == 3
        assert L._pf.depth == want, (loader_depth, door_opts)
        L.close()
    with pinloader.ArrayLoader(data, 4, device="cpu", depth=4) as L:
        with pytest.raises(ValueError, match="depth=4.*depth=2"):
            pt.prefetch(L, depth=2)


def test_door_adopts_a_loader_after_a_plain_epoch_with_equal_settings():
    torch_ = pytest.importorskip("torch")
    import pinloader.torch as pt
    data = np.arange(40, dtype=np.float32).reshape(20, 2)
    L = pinloader.ArrayLoader(data, 5, device="cpu", shuffle=False)
    plain = [values(b) for b in L]
    T = pt.prefetch(L)  # same device (cpu) and depth (the default): accepted
    got = [t.numpy().copy() for t in T]
    assert all(isinstance(t, np.ndarray) for t in got)
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(plain))
    L.close()
    # a door's other settings apply to its own iterations only (Note [doors over a loader])
    L2 = pinloader.ArrayLoader(data, 5, device="cpu")
    assert len([values(b) for b in L2]) == 4
    for opts in ({"depth": 4}, {"depth": 2}, {"max_pinned_bytes": 1 << 20}):
        T2 = pt.prefetch(L2, **opts)
        assert len([t.numpy().copy() for t in T2]) == 4
        assert L2._pf.depth == opts.get("depth", 3)
        assert len([values(b) for b in L2]) == 4  # the loader's own settings again
        assert L2._pf.depth == 3
    L2.close()
    assert torch_ is not None


# ---- CuPy and JAX ----

@pytest.mark.parametrize("name,framework", [("pinloader.cupy", "cupy"), ("pinloader.jax", "jax")])
def test_cuda_doors_are_importable_lazily(name, framework):
    # pinloader.cupy and pinloader.jax import their framework; without it they fail cleanly
    # with an ImportError naming it, and `import pinloader` never tried to import it. The
    # framework is blocked in a fresh interpreter (a meta path finder that refuses it, and
    # sys.modules[name] = None), so this asserts the same whether or not it is installed here.
    code = f"""
import importlib.abc, json, sys
tried = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == {framework!r}:
            tried.append(fullname)
            raise ImportError("blocked for the test: " + fullname, name=fullname)
        return None
sys.meta_path.insert(0, Block())
import pinloader
after_pinloader = list(tried)
try:
    import {name}
    out = {{"result": "imported"}}
except ImportError as e:
    out = {{"result": "ImportError", "msg": str(e), "name": e.name}}
out["after_pinloader"] = after_pinloader
out["tried"] = tried
out["in_modules"] = {name!r} in sys.modules
print(json.dumps(out))
"""
    p = run_py(code, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["after_pinloader"] == [], f"import pinloader imported {out['after_pinloader']}"
    assert out["result"] == "ImportError", out
    assert framework in out["msg"], out
    assert out["tried"] and out["tried"][0] == framework, out  # it did try to import it ...
    assert not out["in_modules"], out  # ... and left no half-imported door behind

    # and with the name mapped to None in sys.modules (the other way to make a module absent)
    p = run_py(f"import sys; sys.modules[{framework!r}] = None\n"
               f"try:\n    import {name}\nexcept ImportError as e:\n    print('ImportError', e)",
               timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ImportError") and framework in p.stdout, p.stdout
