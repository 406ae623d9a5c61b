"""The peer loaders the benchmarks measure pinloader against: side-stream copy loops written
the way users write them, kept in one place so that every script runs the same code.

Neither class imports torch: each takes the torch module as an argument, because the scripts
import torch only once their arguments are parsed, and bench_models.py's --smoke run passes a
stand-in whose torch.cuda calls do nothing (the host run has no streams).
"""

from __future__ import annotations


class AsyncGPUDataLoader:
    """The seed write-up's loader, as published: a priority -1 side stream, the next batch's
    copies issued on it, and the compute stream made to wait for that stream before the
    previous batch is yielded. It never calls record_stream.

    The body is the write-up's, bugs included (no record_stream; the wait also covers the copy
    just issued for the next batch; an empty loader fails at the last yield); only ``torch`` is
    an argument here instead of the write-up's module-level import."""

    def __init__(self, dataloader, device, torch):
        self.torch = torch
        self.loader = dataloader
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)

    def __iter__(self):
        torch = self.torch
        first = True
        for next_inputs, next_targets in self.loader:
            with torch.cuda.stream(self.stream):
                next_inputs = next_inputs.to(self.device, non_blocking=True)
                next_targets = next_targets.to(self.device, non_blocking=True)
            if not first:
                torch.cuda.current_stream().wait_stream(self.stream)
                yield current_inputs, current_targets  # noqa: F821
            else:
                first = False
            current_inputs = next_inputs
            current_targets = next_targets
        torch.cuda.current_stream().wait_stream(self.stream)
        yield current_inputs, current_targets

    def __len__(self):
        return len(self.loader)


class SideStreamPrefetcher:
    """A correct side-stream prefetcher in the style of NVIDIA Apex's data_prefetcher.

    The copy of batch i+1 is issued after the compute stream was told to wait for batch i, so
    compute never waits for a copy it does not need, and record_stream keeps the caching
    allocator from reusing a batch's memory while the compute stream may still read it."""

    def __init__(self, loader, device, torch):
        self.torch = torch
        self.loader = loader
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def _preload(self, it):
        try:
            inputs, targets = next(it)
        except StopIteration:
            return None
        with self.torch.cuda.stream(self.stream):
            return (inputs.to(self.device, non_blocking=True),
                    targets.to(self.device, non_blocking=True))

    def __iter__(self):
        it = iter(self.loader)
        pending = self._preload(it)
        while pending is not None:
            current = self.torch.cuda.current_stream()
            current.wait_stream(self.stream)
            for t in pending:
                t.record_stream(current)
            batch, pending = pending, self._preload(it)
            yield batch

    def __len__(self):
        return len(self.loader)
