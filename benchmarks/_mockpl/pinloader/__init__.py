"""Throwaway stand-in for the pinloader API, built on torch, for exercising the benchmarks."""
import queue, threading, time
import numpy as np
import torch

__version__ = "0.0.mock"

def backend():
    return "cuda"

class PinnedBuffer:
    def __init__(self, n):
        self._t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self._np = self._t.numpy()
    def __buffer__(self, flags):
        return memoryview(self._np)
    def __len__(self):
        return self._np.nbytes
    def release(self):
        self._t = None
        self._np = None

class PinnedPool:
    def __init__(self, max_bytes=None):
        self.max_bytes = max_bytes
    def alloc(self, n):
        return PinnedBuffer(n)

class DeviceArray:
    def __init__(self, t, ev):
        self._t, self._ev = t, ev
        self.shape, self.dtype, self.nbytes = tuple(t.shape), t.dtype, t.nbytes
    def __dlpack_device__(self):
        return self._t.__dlpack_device__()
    def __dlpack__(self, stream=None, **kw):
        if stream is not None and stream != -1:
            s = torch.cuda.ExternalStream(0 if stream in (1, 2) else stream)
            s.wait_event(self._ev)
            self._t.record_stream(s)
        return self._t.__dlpack__()

def _flatten(item, leaves):
    if isinstance(item, dict):
        return ("d", [(k, _flatten(v, leaves)) for k, v in item.items()])
    if isinstance(item, (list, tuple)):
        return ("l" if isinstance(item, list) else "t", [_flatten(v, leaves) for v in item])
    leaves.append(item)
    return ("x", len(leaves) - 1)

def _build(spec, leaves):
    k, v = spec
    if k == "d":
        return {key: _build(s, leaves) for key, s in v}
    if k in "lt":
        out = [_build(s, leaves) for s in v]
        return out if k == "l" else tuple(out)
    return leaves[v]

class AsyncPrefetcher:
    def __init__(self, iterable, device="cuda:0", depth=2, pool=None, max_pinned_bytes=None, staging_threads=None):
        self._src = iter(iterable)
        self._dev = torch.device(device)
        self._q = queue.Queue(maxsize=depth)
        self._stop = False
        self._stream = torch.cuda.Stream(device=self._dev, priority=-1)
        self._st = dict(batches=0, bytes=0, wait_s_total=0.0, staging_s_total=0.0, next_s_total=0.0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
    def _run(self):
        torch.cuda.set_device(self._dev)
        try:
            while not self._stop:
                t0 = time.perf_counter()
                try:
                    item = next(self._src)
                except StopIteration:
                    self._q.put(("end", None)); return
                self._st["next_s_total"] += time.perf_counter() - t0
                leaves = []
                spec = _flatten(item, leaves)
                t1 = time.perf_counter()
                outs = []
                with torch.cuda.stream(self._stream):
                    for a in leaves:
                        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
                        p = t.pin_memory()
                        outs.append(p.to(self._dev, non_blocking=True))
                        self._st["bytes"] += t.nbytes
                    ev = torch.cuda.Event(); ev.record(self._stream)
                self._st["staging_s_total"] += time.perf_counter() - t1
                self._q.put(("ok", (spec, outs, ev)))
        except Exception as e:
            self._q.put(("err", e))
    def __iter__(self):
        return self
    def __next__(self):
        t0 = time.perf_counter()
        kind, val = self._q.get()
        self._st["wait_s_total"] += time.perf_counter() - t0
        if kind == "end":
            self._q.put(("end", None)); raise StopIteration
        if kind == "err":
            raise val
        spec, outs, ev = val
        self._st["batches"] += 1
        return _build(spec, [DeviceArray(o, ev) for o in outs])
    def stats(self):
        return dict(self._st)
    def close(self):
        self._stop = True
        while self._thread.is_alive():
            try:
                self._q.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()
