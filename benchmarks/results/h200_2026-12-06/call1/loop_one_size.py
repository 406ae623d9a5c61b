"""Issue 35's loop at one row size, public API only (runs against any tree on PYTHONPATH)."""
import json, os, sys, time
import numpy as np
import torch
import pinloader

row = int(sys.argv[1]) if len(sys.argv) > 1 else 512
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
tag = sys.argv[3] if len(sys.argv) > 3 else "?"
batch = max(1, (4 << 20) // row) if row < 65536 else 256
n = (512 << 20) // row if row < 65536 else 8192
rng = np.random.default_rng(0)
src = rng.integers(0, 256, size=(n, row), dtype=np.uint8)
addr = src.ctypes.data

def numa_of(addr):
    out = []
    try:
        with open("/proc/self/numa_maps") as fh:
            for line in fh:
                a = int(line.split()[0], 16)
                if addr - (4 << 20) <= a < addr + src.nbytes:
                    out.append(" ".join(w for w in line.split() if w[0] in "Nak" and "=" in w))
    except OSError as e:
        return str(e)
    return out

cuda = torch.cuda.is_available()
dev = torch.device("cuda:0" if cuda else "cpu")
nbytes = batch * row
host = torch.empty(nbytes, dtype=torch.uint8) if not cuda else torch.empty(nbytes, dtype=torch.uint8).pin_memory()
dbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

def dma(k=50):
    dbuf.copy_(host, non_blocking=True); (torch.cuda.synchronize() if cuda else None)
    t0 = time.perf_counter()
    for _ in range(k):
        dbuf.copy_(host, non_blocking=True)
    (torch.cuda.synchronize() if cuda else None)
    return k * nbytes / (time.perf_counter() - t0) / 1e9

def loop(seed, warm=20, k=60):
    ld = pinloader.ArrayLoader(src, batch_size=batch, seed=seed, device=str(dev), drop_last=True)
    it = iter(ld)
    def take():
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(ld)
            return next(it)
    for _ in range(warm):
        x = torch.from_dlpack(take()); x.view(-1)[:1].add_(0)
    (torch.cuda.synchronize() if cuda else None)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(k):
        x = torch.from_dlpack(take()); x.view(-1)[:1].add_(0)
    (torch.cuda.synchronize() if cuda else None)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = {}
    try:
        s = ld.stats()
        st = {k2: s[k2] for k2 in ("gather", "path", "staging_threads") if k2 in s}
    except Exception as e:  # noqa
        st = {"err": str(e)}
    ld.close() if hasattr(ld, "close") else None
    return k * nbytes / dt / 1e9, cpu / k * 1e3, st

out = {"tag": tag, "row": row, "numa_src": numa_of(addr), "rounds": []}
for r in range(rounds):
    d = dma()
    g, cpu, st = loop(r % 2)
    out["rounds"].append({"dma": round(d, 2), "loader": round(g, 2), "ratio": round(g / d, 3), "cpu_ms": round(cpu, 4), "st": st})
print(json.dumps(out), flush=True)
