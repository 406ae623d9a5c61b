"""benchmarks/bench_images.py --smoke on the host backend: every ImageLoader row and the tiny
model run and land in the result files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_benchmark_smoke

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_images.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="benchmarks/ is not in the sdist")
pytest.importorskip("torch", reason="bench_images.py needs PyTorch")


def test_smoke_run(tmp_path):
    p = run_benchmark_smoke("bench_images.py", tmp_path)
    assert "Traceback" not in p.stderr, p.stderr[-6000:]
    data = json.loads((tmp_path / "images.json").read_text())
    assert (tmp_path / "images.md").is_file()
    rows = data["loader_bound"]["imagenet"]
    assert list(rows) == ["imageloader_packed", "imageloader_tar", "imageloader_folder"]
    for name, v in rows.items():
        assert len(v["ips"]) == 2 and min(v["ips"]) > 0, (name, v)
        # 48 images in batches of 8: 6 a epoch, 1 skipped + 6 timed wants 2 epochs a run
        assert v["epochs_per_run"] == 2 and len(v["fill_ms"]) == 2, (name, v)
    tiny = data["models"]["tiny"]
    assert tiny["rounds_done"] == 2 and set(tiny["rows"]) == {"bound", "imageloader_packed"}
    assert all(len(v["ratio"]) == 2 for v in tiny["rows"].values())
    # the training thread's time in next() per step, every row, every round, in the table
    assert all(len(v["next_ms"]) == 2 for v in tiny["rows"].values())
    # the bound's feed hands out pre-made tensors; ImageLoader's decodes on the host backend here
    assert max(tiny["rows"]["bound"]["next_ms"]) < min(tiny["rows"]["imageloader_packed"]["next_ms"])
    assert "next() per step, ms" in (tmp_path / "images.md").read_text()


def _bench_images():
    from helpers import bench_module
    return bench_module("bench_images")


def test_a_kept_dataset_of_another_size_is_made_anew(tmp_path):
    """--data-dir keeps the datasets between runs; one made for another --images is not reused
    (it would run the rows on the wrong number of images and report the asked-for one)."""
    bench_images = _bench_images()
    first = bench_images.dataset(tmp_path, "imagenet", 6, smoke=True)
    again = bench_images.dataset(tmp_path, "imagenet", 6, smoke=True)
    other = bench_images.dataset(tmp_path, "imagenet", 9, smoke=True)
    assert first["n"] == again["n"] == 6 and other["n"] == 9
    import numpy as np
    assert len(np.load(tmp_path / "imagenet" / "packed" / "labels.npy")) == 9
    assert sum(1 for _ in (tmp_path / "imagenet" / "folder").rglob("*.jpg")) == 9


def test_the_decode_call_by_step_is_rendered():
    """A model row's decode call by step (JpegDecoder.info()'s *_ns, as a GPU run records them)
    reaches the Markdown table's notes; the host backend never fills them, so this renders a
    recorded model directly."""
    import argparse
    bench_images = _bench_images()
    row = {"ips": [100.0, 110.0], "ratio": [0.8, 0.9], "next_ms": [1.0, 2.0], "decode_call_ms": [30.0, 40.0]}
    for k in bench_images.DECODE_STEPS:
        row[f"decode_{k}_ms"] = [1.5, 2.5]
    rec = {"size_class": "imagenet", "rounds_done": 2,
           "rows": {"bound": {"ips": [120.0, 120.0], "ratio": [1.0, 1.0], "next_ms": [0.1, 0.1]},
                    "imageloader_packed": row}}
    for v in rec["rows"].values():  # as run_models summarizes
        for key in list(v):
            v[f"{key}_summary"] = bench_images.C.summarize(v[key])
    args = argparse.Namespace(smoke=True, images=8, batch=4, dtype="bfloat16", rounds=2, steps=2)
    text = bench_images.render({}, {"resnet18": rec}, {}, args)
    assert "| imageloader_packed | 105 (100–110) | 0.85 (0.80–0.90) | 1.50 (1.00–2.00) | 35.0 (30.0–40.0) |" in text
    assert ("imageloader_packed's decode call per batch by step, ms (the C decoder's own clock): headers 2.00 "
            "(1.50–2.50); engines_wait 2.00 (1.50–2.50); engines 2.00") in text


@pytest.mark.parametrize("spec", ["nointerp:PINLOADER_JPEG_INTERPOLATE=0", "d4:PINLOADER_JPEG_DECODERS=4",
                                  "s0:PINLOADER_JPEG_SORT=1+PINLOADER_JPEG_INTERPOLATE=0"])
def test_a_variant_names_a_pinloader_variable(spec):
    """--variant NAME:VAR=VALUE[+VAR=VALUE...], a packed ImageLoader row made and run with those
    variables set."""
    assert _bench_images()._variant(spec) == spec


@pytest.mark.parametrize("spec", ["nointerp", "x:PATH=1", "no interp:PINLOADER_JPEG_INTERPOLATE=0",
                                  "n:PINLOADER_JPEG_INTERPOLATE", ":PINLOADER_JPEG_INTERPOLATE=0",
                                  "s20:PINLOADER_JPEG_CUDA_SHARE=0.2", "t:PINLOADER_JPEG_INTERPOLATEX=0",
                                  "s:PINLOADER_JPEG_SORT=1+", "s:PINLOADER_JPEG_SORT=1+PATH=1",
                                  "s:PINLOADER_JPEG_SORT=1+PINLOADER_JPEG_SORT=0"])
def test_a_bad_variant_is_refused(spec):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=r"--variant wants NAME:VAR=VALUE\[\+VAR=VALUE...\] with each VAR once, one of PINLOADER_JPEG_INTERPOLATE"):
        _bench_images()._variant(spec)


def test_a_variant_row_runs_every_epoch_with_its_variable_set(monkeypatch):
    """The loader reads some switches at every epoch (PINLOADER_JPEG_DECODERS), so the variable is
    set from an epoch's first batch to its end, not changed between its batches (the loader's
    threads may read the environment), and restored after it, also when it fails."""
    import os

    bench_images = _bench_images()
    seen = []

    def fake_row(ds, key, args, torch):
        seen.append(("made", os.environ.get("PINLOADER_JPEG_DECODERS")))

        def run(r):
            for b in range(2):
                seen.append((r, b, os.environ.get("PINLOADER_JPEG_DECODERS")))
                yield 1
            seen.append((r, "end", os.environ.get("PINLOADER_JPEG_DECODERS")))
        return run, object()

    monkeypatch.setattr(bench_images, "row_imageloader", fake_row)
    monkeypatch.setenv("PINLOADER_JPEG_DECODERS", "2")
    run, _ = bench_images.row_imageloader_variant({}, "d4:PINLOADER_JPEG_DECODERS=4", None, None)
    assert os.environ["PINLOADER_JPEG_DECODERS"] == "2"
    for r in (0, 1):
        for n in run(r):
            assert n == 1 and os.environ["PINLOADER_JPEG_DECODERS"] == "4"
        assert os.environ["PINLOADER_JPEG_DECODERS"] == "2"
    assert seen == [("made", "4")] + [(r, b, "4") for r in (0, 1) for b in (0, 1, "end")]

    # several variables: each set through the epoch, each restored after it
    monkeypatch.delenv("PINLOADER_JPEG_SORT", raising=False)
    monkeypatch.setattr(bench_images, "row_imageloader", fake_row)
    run, _ = bench_images.row_imageloader_variant({}, "x:PINLOADER_JPEG_DECODERS=3+PINLOADER_JPEG_SORT=1", None, None)
    for n in run(0):
        assert (os.environ["PINLOADER_JPEG_DECODERS"], os.environ["PINLOADER_JPEG_SORT"]) == ("3", "1")
    assert os.environ["PINLOADER_JPEG_DECODERS"] == "2" and "PINLOADER_JPEG_SORT" not in os.environ

    def failing(r):
        yield 1
        raise RuntimeError("decode failed")
    monkeypatch.setattr(bench_images, "row_imageloader", lambda *a: (failing, object()))
    run, _ = bench_images.row_imageloader_variant({}, "d4:PINLOADER_JPEG_DECODERS=4", None, None)
    with pytest.raises(RuntimeError, match="decode failed"):
        list(run(0))
    assert os.environ["PINLOADER_JPEG_DECODERS"] == "2"


def test_a_dali_sweep_is_parsed_and_bad_configurations_are_refused():
    import argparse
    bi = _bench_images()
    assert bi._dali_config("0.65:8, 0.9:12") == [(0.65, 8), (0.9, 12)]
    assert bi.dali_row_name(0.9, 12) == "dali_0.9_12t"
    for bad in ("0.9", "1.5:8", "0.9:0", "x:8", "0.9:eight"):
        with pytest.raises(argparse.ArgumentTypeError, match="LOAD:THREADS"):
            bi._dali_config(bad)


def test_imageloader_is_compared_with_the_fastest_dali_row_of_each_round():
    bi = _bench_images()
    rows = {
        "imageloader_packed": {"ips": [100.0, 100.0, 100.0], "cpu_per_1000": [1.0, 1.0, 1.0]},
        "dali_0.65_8t": {"ips": [50.0, 80.0, 40.0], "cpu_per_1000": [4.0, 4.0, 4.0]},
        "dali_0.9_8t": {"ips": [60.0, 50.0, 50.0], "cpu_per_1000": [2.0, 2.0, 2.0]},
    }
    text = "\n".join(bi.ratio_lines(rows))
    line = next(x for x in text.splitlines() if "fastest of its rows" in x)
    # rounds: 100/60, 100/80, 100/50 -> median 1.67 (1.25-2.00); CPU: 1/2, 1/4, 1/2
    assert "1.67 (1.25–2.00)" in line or "1.67 (1.25-2.00)" in line, line
    assert "0.50 (0.25–0.50)" in line or "0.50 (0.25-0.50)" in line, line


def test_rows_are_compared_round_by_round_when_a_round_failed():
    bi = _bench_images()
    rows = {
        # ImageLoader lost round 1, DALI round 0: only round 2 is common to both
        "imageloader_packed": {"ips": [100.0, 300.0], "cpu_per_1000": [1.0, 1.0], "rounds": [0, 2]},
        "dali_default": {"ips": [10.0, 150.0], "cpu_per_1000": [2.0, 2.0], "rounds": [1, 2]},
    }
    text = "\n".join(bi.ratio_lines(rows))
    line = next(x for x in text.splitlines() if x.startswith("| dali_default"))
    assert "| 2.00 |" in line and "| 0.50 |" in line, line  # 300 / 150 and 1 / 2, round 2 alone


class _Clock:
    """perf_counter and sleep of a clock the fake rows advance themselves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept += s
        self.now += s


def test_a_run_is_timed_from_its_last_skipped_batch_and_charged_its_cpu(monkeypatch):
    """A loader that had its first batches ready before the run began (DALI's prefetch queue runs on
    into the next epoch) is not credited with them: images/s counts the batches after the skipped
    ones over the time after the last skipped one returned."""
    import types
    bi = _bench_images()
    clock = _Clock()
    cpu = [0.0]
    monkeypatch.setattr(bi, "cpu_seconds", lambda: cpu[0])
    epochs_seen = []

    def sleep(s):
        clock.sleep(s)
        cpu[0] += 0.3  # the loader goes on working while the bench waits
    monkeypatch.setattr(bi, "time", types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=sleep))

    def run(epoch):
        epochs_seen.append(epoch)
        for k in range(4):
            # epoch 7: two batches ready at the start (0.01 s each), the rest 0.1 s each
            clock.now += 0.01 if epoch == 7 and k < 2 else 0.1
            cpu[0] += 0.2
            yield 10
        clock.now += 0.05  # the wait for the device at the epoch's end
    got = bi.timed_run(run, 7, 3, 2, 0.5)
    assert epochs_seen == [7, 8, 9]
    # 10 timed batches of 10 images over 10 x 0.1 s + 3 x 0.05 s of waits
    assert got["ips"] == pytest.approx(100 / 1.15)
    assert got["fill_ms"] == pytest.approx(20.0)
    assert clock.slept == 0.5
    # 12 batches' CPU (2.4 s) and the wait's (0.3 s) over the 120 images returned
    assert got["cpu_per_1000"] == pytest.approx(2.7 / 120 * 1000)
    # with nothing skipped the ready batches count, and the rate is higher
    assert bi.timed_run(run, 7, 3, 0, 0.0)["ips"] == pytest.approx(120 / 1.17)
    with pytest.raises(RuntimeError, match="--skip-batches 12 leaves none to time"):
        bi.timed_run(run, 0, 3, 12, 0.0)

    def failing(epoch):
        yield 10
        raise ValueError("bad batch")
    clock.slept = 0.0
    with pytest.raises(ValueError, match="bad batch"):
        bi.timed_run(failing, 0, 2, 0, 0.5)
    assert clock.slept == 0.5  # the wait after a failed run too


def test_epochs_run_back_to_back_reach_the_batches_asked_for():
    bi = _bench_images()
    assert bi.epochs_per_run(4096, 256, 4, 20) == 2   # 16 a epoch
    assert bi.epochs_per_run(1024, 256, 4, 20) == 6   # 4 a epoch
    assert bi.epochs_per_run(1024, 256, 0, 4) == 1
    assert bi.epochs_per_run(1023, 256, 4, 20) == 8   # 3 a epoch (drop_last)
    with pytest.raises(SystemExit, match="less than one batch"):
        bi.epochs_per_run(100, 256, 4, 20)


@pytest.mark.parametrize("text", ["-1", "x", "1.5"])
def test_a_bad_count_is_refused(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 0"):
        _bench_images()._count(0)(text)


def test_a_row_that_failed_a_run_is_not_run_again(monkeypatch):
    """Its loader may be left mid-epoch (DALI then ignores a reset): the rounds it measured stand,
    the failure is recorded, and the later rounds leave it out."""
    import argparse
    bi = _bench_images()
    epochs_seen = []

    def fake_row(ds, key, args, torch):
        def run(epoch):
            epochs_seen.append(epoch)
            if epoch == 2:
                raise RuntimeError("lost the device")
            for _ in range(2):
                yield 4
        return run, None
    monkeypatch.setattr(bi, "row_imageloader", fake_row)
    args = argparse.Namespace(rows=["imageloader_packed"], variant=[], dali_sweep=[], images=8, batch=4,
                              skip_batches=1, min_batches=1, settle_s=0.0, rounds=4)
    rows = bi.loader_bound({}, args, None, "imagenet")
    v = rows["imageloader_packed"]
    assert v["rounds"] == [0, 1] and len(v["ips"]) == 2
    assert "lost the device" in v["error"] and v["stopped_in_round"] == 2
    assert epochs_seen == [10_000, 0, 1, 2]
    # the table says the row stopped, and why
    args.smoke, args.dtype, args.steps = True, "float32", 2
    text = bi.render({"imagenet": rows}, {}, {}, args)
    assert "imageloader_packed failed in round 2 and was not run again" in text and "lost the device" in text
