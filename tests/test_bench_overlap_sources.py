"""benchmarks/_overlap_sources.py on the CPU: the batches bench_overlap.py's sources give its
rows (the GPU runs of the script are the only other place they run)."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
pytestmark = pytest.mark.skipif(not (BENCH / "_overlap_sources.py").is_file(),
                                reason="benchmarks/ is not in the sdist")
torch = pytest.importorskip("torch", reason="the overlap sources need PyTorch")


def _sources():
    from helpers import bench_module
    return bench_module("_overlap_sources")


def _args(**kw):
    base = dict(dataset_samples=6, batch_size=4, workers=2, prefetch_factor=2, ring=3,
                collated_workers=0)
    return argparse.Namespace(**{**base, **kw})


def test_crops_are_windows_of_their_images_through_worker_processes():
    src = _sources()
    source = src.SOURCE_KINDS["crops"](torch, _args(), 3)
    try:
        # Each pixel of image k holds (its row, its column, k): a crop shows where it was taken.
        n, (hh, ww) = source.dataset.images.shape[0], src.CROP_SOURCE_HW
        rows = torch.arange(hh, dtype=torch.uint8).view(1, hh, 1).expand(n, hh, ww)
        cols = torch.arange(ww, dtype=torch.uint8).view(1, 1, ww).expand(n, hh, ww)
        ks = torch.arange(n, dtype=torch.uint8).view(n, 1, 1).expand(n, hh, ww)
        source.dataset.images = torch.stack((rows, cols, ks), dim=3).contiguous()
        labels = source.dataset.labels
        h, w = src.IMAGE_SHAPE[1:]
        batches = list(source.pageable())
        assert len(batches) == 3
        for x, y in batches:
            assert x.shape == (4, *src.IMAGE_SHAPE) and x.dtype == torch.uint8
            for (r, c, k), label in zip(x.long(), y):
                top, left = int(r[0, 0]), int(c[0].min())
                assert torch.equal(r, (top + torch.arange(h)).view(h, 1).expand(h, w))
                along = left + torch.arange(w)
                flipped = bool(c[0, 0] != left)
                assert torch.equal(c, (along.flip(0) if flipped else along).expand(h, w))
                assert top + h <= hh and left + w <= ww
                assert (k == k[0, 0]).all() and labels[int(k[0, 0])] == label
        with pytest.raises(RuntimeError, match="worker processes"):
            source.pinned_buffers()
    finally:
        source.close()


@pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true:UserWarning")
def test_collated_source_serves_its_ring_pageable_and_through_the_dataloader():
    src = _sources()
    source = src.SOURCE_KINDS["collated"](torch, _args(), 5)
    try:
        pageable = list(source.pageable())
        assert len(pageable) == 5
        for i, (x, y) in enumerate(pageable):
            assert x is source.xs[i % 3] and y is source.ys[i % 3]
        loaded = list(source.pinned())
        assert len(loaded) == 5
        for (x, y), (px, py) in zip(loaded, pageable):
            np.testing.assert_array_equal(x.numpy(), px)
            np.testing.assert_array_equal(y.numpy(), py)
        ring = source.gpu_ring("cpu")
        assert [tuple(t.shape) for t in ring[0]] == [(4, *src.IMAGE_SHAPE), (4,)]
    finally:
        source.close()
