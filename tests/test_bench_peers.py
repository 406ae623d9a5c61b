"""benchmarks/_peers.py: the peer loaders bench_overlap.py and bench_models.py measure against.

Both scripts run the one copy of each class, and each class issues its stream calls in the
order its docstring describes: a stand-in for torch records every stream creation, copy,
wait and record_stream, so the sequences are checked on a machine without CUDA."""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
pytestmark = pytest.mark.skipif(not (BENCH / "_peers.py").is_file(),
                                reason="benchmarks/ is not in the sdist")


def _import(name):
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


class _Tensor:
    def __init__(self, log, cuda, name):
        self.log, self.cuda, self.name = log, cuda, name

    def to(self, device, non_blocking=False):
        self.log.append(("copy", self.name, self.cuda.issuing.name, device, non_blocking))
        return _Tensor(self.log, self.cuda, self.name + "@dev")

    def record_stream(self, stream):
        self.log.append(("record", self.name, stream.name))


class _RecordingCuda:
    """torch.cuda as far as the peers use it; every call lands in ``log``."""

    def __init__(self, log):
        self.log = log
        self.compute = _Stream(log, "compute")
        self.issuing = self.compute

    def Stream(self, **kwargs):  # noqa: N802 (torch's name)
        self.log.append(("new_stream", tuple(sorted(kwargs.items()))))
        return _Stream(self.log, "side")

    @contextlib.contextmanager
    def stream(self, s):
        before, self.issuing = self.issuing, s
        try:
            yield
        finally:
            self.issuing = before

    def current_stream(self):
        return self.issuing


class _RecordingTorch:
    def __init__(self):
        self.log = []
        self.cuda = _RecordingCuda(self.log)

    def batches(self, n):
        return [(_Tensor(self.log, self.cuda, f"x{i}"), _Tensor(self.log, self.cuda, f"y{i}"))
                for i in range(n)]


def _consume(loader, log):
    for x, y in loader:
        log.append(("yield", x.name, y.name))


def _copies(i):
    return [("copy", f"x{i}", "side", "dev", True), ("copy", f"y{i}", "side", "dev", True)]


def test_both_scripts_run_the_one_copy_of_each_peer():
    peers = _import("_peers")
    overlap = _import("bench_overlap")
    models = _import("bench_models")
    assert overlap.AsyncGPUDataLoader is peers.AsyncGPUDataLoader
    assert models.AsyncGPUDataLoader is peers.AsyncGPUDataLoader
    assert overlap.SideStreamPrefetcher is peers.SideStreamPrefetcher


def test_seed_loader_waits_on_its_side_stream_and_never_records():
    peers = _import("_peers")
    torch = _RecordingTorch()
    loader = peers.AsyncGPUDataLoader(torch.batches(3), "dev", torch)
    assert len(loader) == 3
    _consume(loader, torch.log)
    wait = ("wait", "compute", "side")
    assert torch.log == [
        ("new_stream", (("device", "dev"), ("priority", -1))),
        *_copies(0), *_copies(1), wait, ("yield", "x0@dev", "y0@dev"),
        *_copies(2), wait, ("yield", "x1@dev", "y1@dev"),
        wait, ("yield", "x2@dev", "y2@dev"),
    ]


def test_seed_loader_keeps_the_published_failure_on_an_empty_loader():
    peers = _import("_peers")
    torch = _RecordingTorch()
    with pytest.raises(UnboundLocalError):
        list(peers.AsyncGPUDataLoader([], "dev", torch))


def test_side_stream_prefetcher_records_each_batch_on_the_compute_stream():
    peers = _import("_peers")
    torch = _RecordingTorch()
    loader = peers.SideStreamPrefetcher(torch.batches(2), "dev", torch)
    assert len(loader) == 2
    _consume(loader, torch.log)
    wait = ("wait", "compute", "side")

    def record(i):
        return [("record", f"x{i}@dev", "compute"), ("record", f"y{i}@dev", "compute")]

    assert torch.log == [
        ("new_stream", (("device", "dev"),)),
        *_copies(0), wait, *record(0), *_copies(1), ("yield", "x0@dev", "y0@dev"),
        wait, *record(1), ("yield", "x1@dev", "y1@dev"),
    ]
    torch.log.clear()
    assert list(peers.SideStreamPrefetcher([], "dev", torch)) == []
