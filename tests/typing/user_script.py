"""A user's training script, checked with `mypy --strict` (tests/test_packaging.py, .ci/run):
pinloader.torch.prefetch, PinnedPool, AsyncPrefetcher and the README's snippets, as a user
writes them, must type-check without casts or ignores."""
from __future__ import annotations

import numpy
import numpy.typing as npt
import torch
from torch.utils.dlpack import from_dlpack
from torch.utils.data import DataLoader, TensorDataset

import pinloader
import pinloader.torch as pt


def train(epochs: int = 2) -> int:
    dataset = TensorDataset(torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,)))
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0, pin_memory=False)
    batches = pt.prefetch(loader, depth=2)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)).to(batches.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    stats: pinloader.PrefetcherStats = batches.stats()
    batches.close()
    return stats["batches"]


def core_api() -> tuple[str, int, float]:
    any_iterable = ({"x": numpy.ones((64, 128), numpy.float32), "step": i} for i in range(4))
    with pinloader.AsyncPrefetcher(any_iterable, depth=2) as pf:
        for batch in pf:
            x = from_dlpack(batch["x"])
            assert x.shape == (64, 128)
        stats = pf.stats()
        device: str = pf.device
    n_bytes: int = stats["bytes"]
    wait_p99: float = stats["wait_ms_p99"]
    return device, n_bytes, wait_p99


def pinned_pool() -> int:
    pool = pinloader.PinnedPool(max_bytes=256 << 20, device="cpu:0")
    buf: pinloader.PinnedBuffer = pool.alloc(64 << 20, timeout=1.0)
    a: npt.NDArray[numpy.float32] = numpy.frombuffer(memoryview(buf), dtype=numpy.float32)
    a[:] = 1.0
    del a
    nbytes = buf.nbytes
    buf.release()
    pool_stats: pinloader.PoolStats = pool.stats()
    in_use: int = pool_stats["in_use_bytes"]
    pool.close()
    return nbytes + in_use


def info() -> bool:
    found: pinloader.CudaInfo = pinloader.cuda_info()
    usable: bool = found["usable"]
    return usable and pinloader.backend() == "cuda"


if __name__ == "__main__":
    print(train(), core_api(), pinned_pool(), info())
