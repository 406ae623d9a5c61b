"""Static batches and the handout on a GPU: torch.compile's reduce-overhead mode over static
batches (no re-recording, no input copies, counted), AsyncPrefetcher(static=True) with its
stream, side-stream ordering, the CuPy door, JAX's refusal, and the torch door's one stream
lookup per batch. See Note [static batches] in src/py/handout.c."""
from __future__ import annotations

import numpy as np
import pytest

import pinloader

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not pinloader.cuda_available(), reason="no CUDA device")]

torch = pytest.importorskip("torch")
import pinloader.torch as pt  # noqa: E402
from helpers import capture_and_replay, capture_around  # noqa: E402


def _source(n=10, rows=256, cols=64, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((rows, cols)).astype(np.float32),
             "y": rng.integers(0, 10, rows)} for _ in range(n)]


def _count_recordings(monkeypatch):
    from torch._inductor import cudagraph_trees
    calls = {"record": 0}
    real = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counting(self, *a, **k):
        calls["record"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    return calls


_COPY = ("memcpy dtod", "copy_", "copykernel", "copy_kernel", "_foreach_copy")


def _input_copies(fn):
    """Copies run while fn() runs, host ops and device work alike (a CUDA-graph replay copies
    non-static inputs into the graph's own, by aten copies or device-to-device memcpys)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if any(c in e.key.lower() for c in _COPY))


def _compiled_step(model):
    def step(x, y):
        return torch.nn.functional.cross_entropy(model(x), y)
    return torch.compile(step, mode="reduce-overhead")


def test_reduce_overhead_records_once_and_copies_no_input(monkeypatch):
    torch._dynamo.reset()
    calls = _count_recordings(monkeypatch)
    model = torch.nn.Linear(64, 10).cuda()
    step = _compiled_step(model)
    src = _source(12)
    batches = pt.prefetch(src, device="cuda:0", static=True, depth=3)
    it = iter(batches)
    losses, copies = [], []
    for k in range(len(src)):
        b = next(it)  # next(), not a for loop over batches: iter() would start another epoch
        with torch.no_grad():
            if k < 3:  # warm-up and the recording
                loss = step(b["x"], b["y"])
            else:
                holder = {}
                copies.append(_input_copies(lambda: holder.setdefault("l", step(b["x"], b["y"]))))
                loss = holder["l"]
            losses.append(float(loss))
    with torch.no_grad():
        want = [float(torch.nn.functional.cross_entropy(
            model(torch.from_numpy(s["x"]).cuda()), torch.from_numpy(s["y"]).cuda())) for s in src]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert calls["record"] == 1, calls
    assert copies == [0] * len(copies), copies
    batches.close()


def test_the_counts_see_input_copies_of_non_static_inputs(monkeypatch):
    # The control for the test above: fresh input tensors every step are copied into the
    # graph's own inputs on every replay, and the counter sees it.
    torch._dynamo.reset()
    calls = _count_recordings(monkeypatch)
    model = torch.nn.Linear(64, 10).cuda()
    step = _compiled_step(model)
    src = _source(6)
    copies, keep = [], []
    with torch.no_grad():
        for k, s in enumerate(src):
            x, y = torch.from_numpy(s["x"]).cuda(), torch.from_numpy(s["y"]).cuda()
            keep.append((x, y))  # every step's inputs at new addresses
            if k < 3:
                step(x, y)
            else:
                copies.append(_input_copies(lambda: step(x, y)))
    torch.cuda.synchronize()
    assert calls["record"] >= 1  # a graph ran (torch may record more than one here)
    assert all(c > 0 for c in copies), copies


def test_async_prefetcher_static_on_a_given_stream_and_read_on_another():
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    src = [np.full((1024, 1024), i, np.float32) for i in range(6)]
    pf = pinloader.AsyncPrefetcher(src, device="cuda:0", static=True, stream=s1.cuda_stream)
    m = torch.randn(2048, 2048, device="cuda")
    sums = []
    for i in range(len(src)):
        a = next(pf)
        assert a is pf.static_arrays[0]
        with torch.cuda.stream(s2):
            for _ in range(3):  # s2 busy: the export must order s2 after s1's fill
                m = m @ m * 1e-4
            t = torch.from_dlpack(a)  # waits on the fill queued on s1
            sums.append(t.sum())
            s1.wait_stream(s2)  # the next fill comes after this read
    torch.cuda.synchronize()
    assert [float(x) for x in sums] == [1024 * 1024 * i for i in range(6)]
    pf.close()


def test_out_tensors_on_a_side_stream_see_each_batch():
    out = [torch.empty((512, 8), device="cuda"), torch.empty(512, dtype=torch.int64, device="cuda")]
    src = [(np.full((512, 8), i, np.float32), np.arange(512) + i) for i in range(5)]
    side = torch.cuda.Stream()
    got = []
    with torch.cuda.stream(side):
        with pt.prefetch(src, device="cuda:0", out=out) as batches:
            it = iter(batches)
            for _ in range(len(src)):
                x, y = next(it)
                assert x is out[0] and y is out[1]
                got.append((x.sum().item(), int(y[0])))
    assert got == [(512 * 8 * i, i) for i in range(5)]


def test_cupy_static_batches():
    cp = pytest.importorskip("cupy")
    import pinloader.cupy as pc
    src = [{"x": np.full((64, 4), i, np.float32)} for i in range(3)] + [{"x": np.ones((10, 4), np.float32)}]
    batches = pc.prefetch(src, static=True)
    it = iter(batches)
    ptrs, vals = set(), []
    for _ in range(len(src)):
        b = next(it)
        ptrs.add(b["x"].data.ptr)
        vals.append((float(cp.asnumpy(b["x"]).sum()), batches.valid_rows))
    assert len(ptrs) == 1
    assert vals == [(0.0, 64), (256.0, 64), (512.0, 64), (40.0, 10)]
    batches.close()


@pytest.mark.jax_gpu
def test_jax_refuses_static_batches():
    pytest.importorskip("jax")
    import pinloader.jax as pj
    with pytest.raises(ValueError, match="a jax.Array is immutable"):
        pj.prefetch([np.zeros(2)], static=True)


@pytest.mark.parametrize("patched", [False, True])
def test_torch_door_looks_the_stream_up_once_per_batch_and_follows_it(monkeypatch, patched):
    # Unpatched, the door reads torch's raw current stream (torch._C._cuda_getCurrentRawStream);
    # with torch.cuda.current_stream replaced, it calls the replacement, and the count shows it
    # is asked once per batch.
    lookups = {"n": 0}
    real = torch.cuda.current_stream

    def counting(*a, **k):
        lookups["n"] += 1
        return real(*a, **k)

    if patched:
        monkeypatch.setattr(torch.cuda, "current_stream", counting)  # before the door binds it
    src = [{"x": np.full((1024, 1024), i, np.float32), "y": np.arange(i, i + 4)} for i in range(9)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.default_stream()]
    m = torch.randn(4096, 4096, device="cuda")
    out = []
    with pt.prefetch(src, device="cuda") as batches:
        it = iter(batches)
        for i in range(len(src)):
            with torch.cuda.stream(streams[i % 3]):
                for _ in range(3):  # the consumer stream is busy when the batch arrives
                    m = m @ m * 1e-4
                before = lookups["n"]
                b = next(it)
                assert lookups["n"] - before == (1 if patched else 0)  # once per batch, not per leaf
                out.append((b["x"].sum(), b["y"] * 1))
    torch.cuda.synchronize()
    for i, (total, y) in enumerate(out):
        assert float(total) == i * 1024 * 1024
        assert y.cpu().tolist() == list(range(i, i + 4))


@pytest.mark.parametrize("door", ["torch", "cupy", pytest.param("jax", marks=pytest.mark.jax_gpu), "capsule",
                                  "array"])
def test_every_container_kind_through_every_door_on_the_gpu(door):
    from helpers import map_leaves
    from test_handout import STRUCTURES, _canon

    def to_numpy(x):
        if isinstance(x, np.ndarray):
            return x
        if door == "torch":
            return x.cpu().numpy()
        if door == "cupy":
            import cupy
            return cupy.asnumpy(x)
        if door == "jax":
            return np.asarray(x)
        if door == "capsule":
            return torch.from_dlpack(x).cpu().numpy()
        return torch.from_dlpack(x).cpu().numpy()

    def leaves_to_numpy(obj):
        return map_leaves(obj, lambda x: x if isinstance(x, (str, int, float, type(None)))
                          else to_numpy(x))

    def make(src):
        if door == "torch":
            return pt.prefetch(src, device="cuda:0")
        if door == "cupy":
            pytest.importorskip("cupy")
            import pinloader.cupy as pc
            return pc.prefetch(src, device=0)
        if door == "jax":
            pytest.importorskip("jax")
            import pinloader.jax as pj
            return pj.prefetch(src, device="cuda:0")
        return pinloader.AsyncPrefetcher(src, device="cuda:0", output=door,
                                         stream=torch.cuda.current_stream().cuda_stream or 1)

    for kind, maker in sorted(STRUCTURES.items()):
        if door == "jax" and kind == "tuple":
            continue  # its int64 leaf: JAX without x64 mode has no int64 arrays
        src = [maker(i) for i in range(3)]
        with make(src) as batches:
            got = [leaves_to_numpy(b) for b in batches]
        torch.cuda.synchronize()
        assert [_canon(b) for b in got] == [_canon(b) for b in src], kind


@pytest.mark.parametrize("gather", ["host", "device"])
def test_a_graph_captured_in_global_mode_while_the_producer_works(gather):
    # Note [the producer and graph captures] in src/py/pf_producer.c: right after each next(),
    # while the producer makes the next batch (it allocates and queries the events of the
    # deferred frees, reserves pinned memory and queries its regions' events), the training
    # thread captures a graph in cudaStreamCaptureModeGlobal (torch's default). capture_begin
    # directly, not torch.cuda.graph(), whose synchronize and gc.collect() on entry would let
    # the producer finish first. No capture may be invalidated, and every batch is whole.
    rng = np.random.default_rng(3)
    n, row, batch = 2048, 32768, 128
    data = rng.integers(0, 256, size=(n, row), dtype=np.uint8)
    x = torch.ones(4096, device="cuda")
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    captured = 0
    with pinloader.ArrayLoader((np.arange(n), data), batch, gather=gather, device="cuda:0",
                               depth=4) as L:
        for _ in range(3):
            for b in L:
                g = capture_and_replay(torch, x, out, side)
                captured += 1
                i, rows = torch.from_dlpack(b[0]), torch.from_dlpack(b[1])
                assert torch.equal(rows.cpu(), torch.from_numpy(data[i.cpu().numpy()]))
                del i, rows, b, g  # the batch joins the deferred frees
    torch.cuda.synchronize()
    assert captured == 3 * (n // batch)
    assert torch.equal(out, x)



class _Sentinel:
    """In a cycle with what a test wants freed by the collector: its weakref says when."""


def _garbage(what, data):
    """``what`` (pinloader objects holding CUDA resources), reachable only from a reference
    cycle, so that only the collector frees it; returns a weakref to a sentinel in the cycle."""
    import weakref

    from pinloader import _C, _cudart
    held = []
    if what in ("batch", "tensor", "loader"):
        loader = pinloader.ArrayLoader(data, 128, device="cuda:0", gather="device", depth=2)
        it = iter(loader)
        b = next(it)
        next(it)  # another batch taken, one more in flight
        held += [loader, it, b] if what == "loader" else [b]
        if what == "tensor":
            held.append(torch.from_dlpack(b))
    elif what == "prefetcher":
        pool = pinloader.PinnedPool(max_bytes=64 << 20)
        pf = pinloader.AsyncPrefetcher([{"x": data[:64]}] * 4, device="cuda:0", depth=2, pool=pool)
        held += [pf, next(pf), pool]
    elif what == "prefetcher_in_its_cycle":
        # the prefetcher in the cycle itself (its source refers back to it): the collector
        # clears it (close) before it is deallocated

        class Source:
            def __iter__(self):
                return iter([{"x": data[:64]}] * 4)

        src = Source()
        pf = pinloader.AsyncPrefetcher(src, device="cuda:0", depth=2)
        src.prefetcher = pf
        held.append(next(pf))
        held.append(src)
    elif what == "pool":
        pool = pinloader.PinnedPool(max_bytes=64 << 20)
        with pinloader.AsyncPrefetcher([{"x": data[:64]}] * 2, device="cuda:0", depth=1, pool=pool) as pf:
            next(pf)
        held.append(pool)
    else:
        held.append(_C.JpegDecoder("cuda:0", libraries=_cudart.nvjpeg_candidates()))
    sentinel = _Sentinel()
    cycle = [held, sentinel]
    cycle.append(cycle)
    return weakref.ref(sentinel)


@pytest.mark.parametrize("what", ["batch", "tensor", "loader", "prefetcher", "prefetcher_in_its_cycle",
                                  "pool", "decoder"])
def test_pinloaders_objects_released_during_a_capture_in_global_mode(what):
    # Note [releases during a capture] in src/core/backend.h: the garbage collector may free a
    # batch, a loader, a prefetcher, a pool or a decoder in the middle of the user's graph
    # capture (torch's default mode, cudaStreamCaptureModeGlobal), on the capturing thread. The
    # releases' stream synchronizes, event queries and cudaFreeHost must not invalidate it.
    import gc
    data = np.random.default_rng(5).integers(0, 256, size=(1024, 4096), dtype=np.uint8)
    x = torch.ones(4096, device="cuda")
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    from pinloader import _C
    enabled = gc.isenabled()
    gc.disable()  # the collection happens inside the capture, not before it
    try:
        alive = _garbage(what, data)
        torch.cuda.synchronize()
        assert alive() is not None
        blocks = []

        def collect():
            blocks.append(_C._testing.live_device_blocks("cuda"))
            gc.collect()
            blocks.append(_C._testing.live_device_blocks("cuda"))

        capture_around(torch, x, out, side, collect)
        assert alive() is None  # freed inside the capture
        if what in ("batch", "tensor", "loader"):
            assert blocks[1] < blocks[0]  # the batch's device memory was released there
    finally:
        if enabled:
            gc.enable()
    torch.cuda.synchronize()
    assert torch.equal(out, x)
