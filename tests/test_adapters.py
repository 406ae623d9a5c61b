"""The framework front doors on the host backend (CI): torch adapter, lazy imports, the demo."""
import collections
import dataclasses
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

import pinloader


def test_import_pinloader_imports_no_framework():
    code = ("import sys, pinloader; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


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


def test_torch_adapter_yields_equal_tensors_with_same_structure():
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


def test_torch_adapter_epochs_len_and_set_epoch():
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


def test_torch_adapter_warns_once_about_pin_memory():
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


def test_torch_adapter_rejects_unknown_device():
    pytest.importorskip("torch")
    import pinloader.torch as pt

    with pytest.raises(ValueError, match="device must be"):
        pt.prefetch([np.zeros(1)], device="meta")


def test_demo_runs_on_the_host_backend_and_prints_json():
    out = subprocess.run([sys.executable, "-m", "pinloader", "demo", "--device", "cpu", "--steps", "3",
                          "--warmup", "1", "--batch-size", "4", "--image-size", "32",
                          "--compute-ms", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "pinloader" in result["rows"] and len(result["rows"]) >= 2
    assert result["pinloader_stats"]["batches"] >= 3
    for row in result["rows"].values():
        assert row["samples_per_s"] > 0 and 0.0 <= row["idle_pct"] <= 100.0


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "pinloader", "info", "--json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["backend"] == pinloader.backend()
    assert set(info) >= {"usable", "library", "device_count", "error"}


@pytest.mark.parametrize("name,framework", [("pinloader.cupy", "cupy"), ("pinloader.jax", "jax")])
def test_cuda_adapters_are_importable_lazily(run_python, name, framework):
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
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["after_pinloader"] == [], f"import pinloader imported {out['after_pinloader']}"
    assert out["result"] == "ImportError", out
    assert framework in out["msg"], out
    assert out["tried"] and out["tried"][0] == framework, out  # it did try to import it ...
    assert not out["in_modules"], out  # ... and left no half-imported adapter behind

    # and with the name mapped to None in sys.modules (the other way to make a module absent)
    p = run_python(f"import sys; sys.modules[{framework!r}] = None\n"
                   f"try:\n    import {name}\nexcept ImportError as e:\n    print('ImportError', e)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ImportError") and framework in p.stdout, p.stdout
