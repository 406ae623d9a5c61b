"""ImageLoader's GPU path with several decoders on threads (Note [decoder threads] in
pinloader/_image_epochs.py), on the host backend against tests/image_gpu_fakes.py's
FakeJpegDecoder: the same batches as one decoder and as the host path, the same skips and errors
in the same order, close mid-epoch, a decoder that cannot be made, the default count, a bad
count, fork while a decoder thread counts."""
from __future__ import annotations

import textwrap
import threading
import time

import numpy as np
import pytest

from pinloader import ImageDecodeError, ImageLoader, _C

from helpers import WAIT_CHILD, describe, run_py

Image = pytest.importorskip("PIL.Image")
from image_gpu_fakes import (  # the fixtures gpu, data and mixed among them
    FakeJpegDecoder, _baseline, _image_threads, _member, _settle, arrays, collect, data,
    digest, gpu, gpu_run, host_run, mixed, same)


# ---- several decoders on threads (Note [decoder threads] in pinloader/_image_epochs.py) ----

@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("source", ["folder", "tars", "packed"])
def test_decoder_threads_give_the_host_paths_batches(gpu, data, monkeypatch, source, k):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", str(k))
    for train in (True, False):
        kw = dict(size=(12, 14), seed=5, train=train, dtype="float32")
        want, hs = host_run(data[source], 4, **kw)
        got, s = gpu_run(data[source], 4, **kw)
        same(got, want)
        assert s["samples"] == hs["samples"] == 18 and s["skipped"] == 0
        assert s["gpu_decoder"]["decoders"] == k
        assert s["gpu_decoder"]["batches"] == 5 and s["gpu_decoder"]["cuda"] == 18
        # batch b went to decoder b % k, and the loader's close() closed every one
        assert len(gpu.made) == k and all(d.closed for d in gpu.made)
        assert [len(d.calls) for d in gpu.made] == [len(range(j, 5, k)) for j in range(k)]
        # on the decoder threads, which call CUDA as the producer does: each ignores the graph
        # captures other threads begin (Note [the producer and graph captures] in
        # src/py/pf_producer.c), as the producer does for itself
        calls = [c for d in gpu.made for c in d.calls]
        assert all(c["thread"].startswith("pl-image-decode") and c["capture_local"] for c in calls)
        gpu.made.clear()


def test_decoder_threads_skip_and_raise_as_one_decoder_does(gpu, mixed, monkeypatch):
    """The same samples skipped, counted and host-decoded; with on_error='raise' the same first
    error, after the same batches (a later batch's error, met first on another thread, waits
    for its turn)."""
    seen = {}
    for k in ("1", "3"):
        monkeypatch.setenv("PINLOADER_JPEG_DECODERS", k)
        got, s = gpu_run(mixed["packed"], 2, size=(10, 12), seed=3, shuffle=False, on_error="skip")
        names = sorted(_member(x["name"]) for x in s["skipped_samples"])
        delivered, error = [], None
        with ImageLoader(mixed["packed"], 2, size=8, shuffle=False) as loader:
            try:
                for b in loader:
                    delivered.append(arrays(b)["label"].tolist())
            except ImageDecodeError as e:
                error = str(e)
        seen[k] = (got, s["skipped"], names, s["host_decoded_reasons"], delivered, error)
    same(seen["1"][0], seen["3"][0])
    assert seen["1"][1:] == seen["3"][1:] and seen["1"][5] is not None


def test_close_mid_epoch_with_decoder_threads(gpu, data, monkeypatch):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")
    threads0 = _baseline(data)
    for k in range(4):
        loader = ImageLoader(data["packed" if k % 2 else "folder"], 2, size=8, workers=2)
        it = iter(loader)
        next(it)  # the next batches' decodes are under way on the other threads
        loader.close()
        assert len(gpu.made) == 3 and all(d.closed for d in gpu.made)
        gpu.made.clear()
    assert _image_threads() == []
    assert _settle(threads0) <= threads0


def test_a_decoder_that_cannot_be_made_leaves_the_others(gpu, data, monkeypatch):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")

    def two_at_most(device, libraries=(), **options):
        if len(FakeJpegDecoder.made) >= 2:
            raise RuntimeError("JpegDecoder: out of device memory for a workspace")
        return FakeJpegDecoder(device, libraries=libraries, **options)

    monkeypatch.setattr(_C, "JpegDecoder", two_at_most)
    want, _ = host_run(data["packed"], 4, size=8, seed=1)
    got, s = gpu_run(data["packed"], 4, size=8, seed=1)
    same(got, want)
    assert s["gpu_decoder"]["decoders"] == 2 and s["gpu_decoder"]["batches"] == 5


def test_two_decoders_by_default(gpu, data, monkeypatch):
    monkeypatch.delenv("PINLOADER_JPEG_DECODERS")
    got, s = gpu_run(data["packed"], 4, size=8, seed=1)
    assert s["gpu_decoder"]["decoders"] == 2 and s["gpu_decoder"]["batches"] == 5
    assert len(gpu.made) == 2


# digits other than ASCII's pass str.isdigit(): int() takes "٣" and "３" (refused: no silent
# conversion) but not "²" or "⑦"; and past 4,300 digits int() refuses even ASCII ones
@pytest.mark.parametrize("text", ["0", "9", "two", "-1", "1.5", "2 3", "²", "⑦", "٣", "３", "long"])
def test_a_bad_decoder_count_is_refused_where_the_loader_is_made(data, monkeypatch, text):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "0" * 5000 + "2" if text == "long" else text)
    with pytest.raises(ValueError, match="PINLOADER_JPEG_DECODERS must be an integer from 1 to 8"):
        ImageLoader(data["packed"], 4, size=8, device="cpu")


def test_close_while_an_epoch_makes_its_decoders(gpu, data, monkeypatch, capfd):
    """close() on another thread while the producer makes the epoch's extra decoders (slow on a
    GPU, so close() detaches the producer): every decoder made is closed and no decoder or
    reader thread is left, once the producer's epoch ends."""
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")
    threads0 = _baseline(data)
    gpu.made.clear()
    entered, release = threading.Event(), threading.Event()

    def slow(device, libraries=(), **options):
        if len(FakeJpegDecoder.made) >= 1:  # the extra decoders, made on the producer thread
            entered.set()
            release.wait(20)
        return FakeJpegDecoder(device, libraries=libraries, **options)

    monkeypatch.setattr(_C, "JpegDecoder", slow)
    loader = ImageLoader(data["packed"], 2, size=8)
    iter(loader)
    assert entered.wait(20), "the producer never began the epoch"
    timer = threading.Timer(0.5, release.set)  # the decoder is made while close() runs
    timer.start()
    loader.close()
    timer.join()
    assert _settle(threads0) <= threads0
    assert _image_threads() == []
    assert len(gpu.made) >= 2 and all(d.closed for d in gpu.made), [d.closed for d in gpu.made]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


def test_decoder_threads_record_the_first_skipped_samples_in_order(gpu, mixed, monkeypatch):
    """stats()["skipped_samples"] holds the first samples skipped in the batches' order, as one
    decoder gives them, even when a later batch's decode, on another thread, skips first (here
    batch 2's decode waits until batch 3 has skipped its sample)."""
    kw = dict(size=8, shuffle=False, on_error="skip")
    got = {}
    for k in ("1", "3"):
        monkeypatch.setenv("PINLOADER_JPEG_DECODERS", k)
        with ImageLoader(mixed["packed"], 2, **kw) as loader:
            runner = loader._runner
            corrupt = next(i for i in range(len(loader.source))
                           if loader.source.name(i).endswith("s05_corrupt.jpg"))
            late = digest(loader.source.read_one(corrupt))

            def after_batch_3(data, call):
                if digest(data) == late:  # batch 2's: wait for batch 3's skip (s06_text.jpg)
                    deadline = time.monotonic() + 20
                    while runner.counts["skipped"] < 1 and time.monotonic() < deadline:
                        time.sleep(0.005)
                return 0

            gpu.inject = staticmethod(after_batch_3 if k == "3" else (lambda data, call: 0))
            collect(loader)
            got[k] = loader.stats()["skipped_samples"]
    assert [_member(x["name"]) for x in got["1"]] == ["s04_truncated.jpg", "s05_corrupt.jpg", "s06_text.jpg"]
    assert got["3"] == got["1"]


def test_fork_while_a_decoder_thread_counts(data):
    """fork() while a decoder thread of the parent holds the lock on the counts (it counts a
    batch): the child's epoch, on its own threads, does not wait for ever on that lock."""
    code = textwrap.dedent("""
    import os, sys, threading, time, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads, 3.12+
    sys.path.insert(0, "tests")
    from pinloader import ImageLoader, _C
    import image_gpu_fakes as T
    _C.JpegDecoder, _C.cuda_available = T.FakeJpegDecoder, lambda: True
    os.environ["PINLOADER_JPEG_DECODERS"] = "2"
    """) + WAIT_CHILD.format(timeout=30.0, poll=0.01) + textwrap.dedent("""
    L = ImageLoader(sys.argv[1], 4, size=8, seed=1)
    want = [T.arrays(b)["label"].tolist() for b in L]
    assert L.stats()["decoder"] == "gpu" and L.stats()["gpu_decoder"]["decoders"] == 2
    held, done = threading.Event(), threading.Event()

    def counting():  # as a decoder thread in Runner.count() at the moment of fork
        with L._runner.lock:
            held.set()
            done.wait(60)

    t = threading.Thread(target=counting)
    t.start()
    assert held.wait(30)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            L.set_epoch(0)
            try:  # the parent's prefetcher refuses (tests/test_image_loader.py's fork test)
                next(iter(L))
            except RuntimeError as e:
                assert "fork" in str(e), e
            L.set_epoch(0)  # then a new one, and new decoder threads
            got = [T.arrays(b)["label"].tolist() for b in L]
            code = 0 if got == want else 3
        finally:
            os._exit(code)
    status = wait_child(pid)
    done.set()
    t.join()
    assert status == 0, status
    L.close()
    print("OK")
    """)
    p = run_py(code, timeout=120, argv=[data["packed"]])
    assert p.returncode == 0 and "OK" in p.stdout, describe(p)


def test_the_interpolate_switch_is_read_as_the_decoder_takes_it(data, monkeypatch):
    from pinloader._image_epochs import decoder_options
    for text, want in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv("PINLOADER_JPEG_INTERPOLATE", text)
        assert decoder_options() == {"interpolate": want}
    monkeypatch.delenv("PINLOADER_JPEG_INTERPOLATE")
    assert decoder_options() == {"interpolate": True}


@pytest.mark.parametrize("text", ["2", "on", "off", "true", " 0", "00"])
def test_a_bad_interpolate_switch_is_refused_where_the_loader_is_made(data, monkeypatch, text):
    monkeypatch.setenv("PINLOADER_JPEG_INTERPOLATE", text)
    with pytest.raises(ValueError, match='PINLOADER_JPEG_INTERPOLATE must be "0" or "1"'):
        ImageLoader(data["packed"], 4, size=8, device="cpu")


def test_every_decoder_is_made_with_the_options_of_the_environment(gpu, data, monkeypatch):
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "3")
    monkeypatch.setenv("PINLOADER_JPEG_INTERPOLATE", "0")
    gpu.made.clear()
    with ImageLoader(data["packed"], 4, size=8) as loader:
        for _ in loader:
            pass
    assert len(gpu.made) == 3
    assert [d.options for d in gpu.made] == [{"interpolate": False}] * 3
