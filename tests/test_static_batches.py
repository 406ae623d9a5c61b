"""Static batches (pinloader.torch.prefetch(static=True) / out=): every batch in the same
tensors, for steps captured in CUDA graphs. Host-backend tests run everywhere; the graph
capture runs on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pinloader  # noqa: E402
import pinloader.torch as pt  # noqa: E402

BACKENDS = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def source(n_batches=5, bs=8, last=None):
    out = []
    for b in range(n_batches):
        rows = last if (last is not None and b == n_batches - 1) else bs
        x = np.full((rows, 3), b, np.float32) + np.arange(rows, dtype=np.float32)[:, None]
        out.append({"x": x, "y": np.full(rows, b, np.int64), "tag": f"batch{b}"})
    return out


@pytest.mark.parametrize("device", BACKENDS)
def test_every_batch_arrives_in_the_same_tensors_with_its_values(device):
    src = source()
    batches = pt.prefetch(src, device=device, static=True, depth=3)
    ptrs, seen = set(), []
    for b in batches:
        ptrs.add((b["x"].data_ptr(), b["y"].data_ptr()))
        seen.append((b["x"].cpu().numpy().copy(), b["y"].cpu().numpy().copy(), b["tag"]))
        assert batches.valid_rows == 8
    assert len(ptrs) == 1
    for (x, y, tag), ref in zip(seen, src):
        np.testing.assert_array_equal(x, ref["x"])
        np.testing.assert_array_equal(y, ref["y"])
        assert tag == ref["tag"]
    batches.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_a_short_last_batch_fills_the_first_rows_and_says_how_many(device):
    src = source(last=3)
    batches = pt.prefetch(src, device=device, static=True)
    got = [(b["x"].cpu().numpy().copy(), batches.valid_rows) for b in batches]
    x, valid = got[-1]
    assert valid == 3
    np.testing.assert_array_equal(x[:3], src[-1]["x"])
    assert not x[3:].any()
    assert [v for _, v in got[:-1]] == [8] * 4
    batches.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_other_layouts_are_refused_naming_the_leaf(device):
    src = source(2)
    src[1]["x"] = np.zeros((8, 4), np.float32)  # other trailing dims
    batches = pt.prefetch(src, device=device, static=True)
    it = iter(batches)
    next(it)
    with pytest.raises(ValueError, match=r"batch leaf 0 is \(8, 4\) float32, but the static buffer .* is \(8, 3\) float32"):
        next(it)
    batches.close()
    big = source(2)
    big[1]["y"] = np.zeros(9, np.int64)
    batches = pt.prefetch(big, device=device, static=True)
    it = iter(batches)
    next(it)
    with pytest.raises(ValueError, match=r"batch leaf 1 is \(9,\) int64, but the static buffer .* is \(8,\) int64: a later batch may only have fewer rows"):
        next(it)
    batches.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_out_tensors_given_by_the_user(device):
    out = {"x": torch.empty((8, 3), device=device), "y": torch.empty(8, dtype=torch.int64, device=device)}
    batches = pt.prefetch(source(3), device=device, out=out)
    for k, b in enumerate(batches):
        assert b["x"] is out["x"] and b["y"] is out["y"]
        assert float(b["y"].sum()) == 8 * k
    batches.close()
    with pytest.raises(ValueError, match=r"out\[0\] is on meta"):
        pt.prefetch(source(1), device=device, out={"x": torch.empty(8, device="meta")})
    with pytest.raises(TypeError, match=r"out\[1\] must be a torch.Tensor"):
        pt.prefetch(source(1), device=device, out=[out["x"], None])


@pytest.mark.hostile
@pytest.mark.parametrize("how", ["set_", "data", "resize_"])
def test_out_tensor_moved_under_the_prefetcher_is_an_error(how):
    # torch's DLPack export keeps the tensor, not its memory: re-pointed or grown, the buffer's
    # old memory is freed, and the static copy wrote into it (a use-after-free); each batch now
    # checks the out= buffers where they are
    import gc
    out = {"x": torch.empty((8, 3)), "y": torch.empty(8, dtype=torch.int64)}
    batches = pt.prefetch(source(3), device="cpu", out=out)
    it = iter(batches)
    next(it)
    if how == "set_":
        out["x"].set_(torch.zeros(8, 3))
    elif how == "data":
        out["x"].data = torch.zeros(8, 3)
    else:
        out["x"].resize_(64, 3)
    gc.collect()
    with pytest.raises(ValueError, match=r"out\[0\] moved or changed since the first batch"):
        next(it)
    batches.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_static_over_an_array_loader(device):
    data = np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4)
    L = pinloader.ArrayLoader(data, 64, device=device, seed=3, drop_last=True)
    batches = pt.prefetch(L, static=True)
    first = None
    for k, x in enumerate(batches):
        first = first or x.data_ptr()
        assert x.data_ptr() == first
        idx = L.indices(0)[k * 64:(k + 1) * 64]
        np.testing.assert_array_equal(x.cpu().numpy(), data[idx])
    L.close()


@pytest.mark.gpu
def test_a_captured_step_replays_on_every_batch():
    # The step reads the static tensors from inside a CUDA graph: capture once, replay per
    # batch, and check each replay saw its own batch.
    rng = np.random.default_rng(0)
    src = [{"x": rng.standard_normal((256, 64)).astype(np.float32),
            "y": rng.integers(0, 10, 256)} for _ in range(12)]
    model = torch.nn.Linear(64, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the outputs depend only on x
    batches = pt.prefetch(src, device="cuda:0", static=True, depth=3)
    it = iter(batches)
    b0 = next(it)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs ask
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(b0["x"]), b0["y"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    sums = torch.zeros((), device="cuda")
    with torch.cuda.graph(g):
        logits = model(b0["x"])
        loss = torch.nn.functional.cross_entropy(logits, b0["y"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sums.copy_(b0["x"].sum() + b0["y"].sum())
    got = []
    # the first batch is in the static tensors already; replay it, then every next one
    g.replay()
    got.append(float(sums))
    while True:
        try:
            b = next(it)  # next(), not a for loop: iter() would start another epoch
        except StopIteration:
            break
        assert b["x"] is b0["x"]
        g.replay()
        got.append(float(sums))
    torch.cuda.synchronize()
    want = [float(s["x"].astype(np.float64).sum() + s["y"].sum()) for s in src]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    batches.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_a_batch_kept_past_the_next_one_holds_the_next_ones_values(device):
    # The documented rule: a static batch is valid until the next one is taken. A consumer that
    # keeps the previous batch by mistake sees it overwritten (in stream order), not a copy and
    # not freed memory; a .clone() taken before keeps the old values.
    src = source(3)
    batches = pt.prefetch(src, device=device, static=True)
    it = iter(batches)
    kept = next(it)["x"]
    saved = kept.clone()
    b1 = next(it)
    assert b1["x"] is kept
    np.testing.assert_array_equal(kept.cpu().numpy(), src[1]["x"])
    np.testing.assert_array_equal(saved.cpu().numpy(), src[0]["x"])
    batches.close()
    # after close() the kept tensor still owns its memory (the static buffer lives as long as
    # anything refers to it) and holds the last batch taken
    np.testing.assert_array_equal(kept.cpu().numpy(), src[1]["x"])
