"""`python -m pinloader`: --version, info (readable and --json), demo options; device strings
and the errors a newcomer meets first.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pinloader
from pinloader import _C


def _run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(pinloader.__file__).resolve().parent.parent), e.get("PYTHONPATH")) if p)
    if env:
        e.update(env)
    return subprocess.run([sys.executable, "-m", "pinloader", *args], capture_output=True,
                          text=True, timeout=timeout, env=e)


def test_version_flag_prints_the_one_version():
    from pinloader._version import __version__

    out = _run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pinloader {__version__}"
    assert pinloader.__version__ == __version__


def test_info_is_readable_by_default_and_json_on_request():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"pinloader {pinloader.__version__}")
    assert f"backend:   {pinloader.backend()}" in out.stdout
    assert "NVTX:" in out.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.stdout)
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["version"] == pinloader.__version__
    assert info["backend"] == pinloader.backend()
    assert info["nvtx"] == bool(_C.NVTX)
    assert set(info) >= {"usable", "library", "driver_version", "runtime_version",
                         "device_count", "error", "error_code"}


def test_info_command():
    out = _run("info", "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["backend"] == pinloader.backend()
    assert set(info) >= {"usable", "library", "device_count", "error"}


def test_every_demo_option_has_help_and_a_default():
    out = _run("demo", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split("options:", 1)[1].split())
    for opt, default in [("--batch-size", "64"), ("--image-size", "224"), ("--steps", "40"),
                         ("--warmup", "5"), ("--compute-ms", "3x the pinned copy"),
                         ("--device", "the current GPU"), ("--staging-threads", "the cores left"),
                         ("--json", None)]:
        assert opt in text, opt
        tail = text.split(opt, 1)[1].split(" --", 1)[0]
        if default is None:  # a flag: off unless given
            assert len(tail.split()) > 3, (opt, tail)
        else:
            assert f"(default: {default}" in tail, (opt, tail)
            assert tail.count("(default:") == 1, (opt, tail)


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--batch-size", "-1"], ["--compute-ms", "0"],
                                 ["--staging-threads", "0"]])
def test_demo_rejects_nonsense_options(bad):
    out = _run("demo", "--device", "cpu", *bad, "--json")
    assert out.returncode == 2
    assert "must be" in out.stderr


def _demo_json(*extra: str) -> dict:
    out = _run("demo", "--device", "cpu", "--steps", "3", "--warmup", "1", "--batch-size", "4",
               "--image-size", "32", "--compute-ms", "2", "--json", *extra, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", "--json prints nothing but the document"
    return json.loads(out.stdout)


def test_demo_runs_on_the_host_backend_and_prints_json():
    out = _run("demo", "--device", "cpu", "--steps", "3", "--warmup", "1", "--batch-size", "4",
               "--image-size", "32", "--compute-ms", "2", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "pinloader" in result["rows"] and len(result["rows"]) >= 2
    assert result["pinloader_stats"]["batches"] >= 3
    for row in result["rows"].values():
        # on the CPU no "idle" figure: the step's compute time, which contention can raise
        assert row["samples_per_s"] > 0 and row["compute_ms"] > 0
        assert "idle_pct" not in row


def test_demo_table_on_the_cpu_shows_compute_time_and_says_contention_is_not_idle():
    out = _run("demo", "--device", "cpu", "--steps", "3", "--warmup", "1", "--batch-size", "4",
               "--image-size", "32", "--compute-ms", "2", timeout=300)
    assert out.returncode == 0, out.stderr
    header = next(line for line in out.stdout.splitlines() if line.startswith("| loading"))
    assert "compute ms/step" in header and "idle" not in header
    text = " ".join(out.stdout.split())
    assert "CPU contention, not idle time" in text


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs `python -m pinloader ARGS` with stdout a pipe whose reading end is already closed:
    its first write fails with EPIPE, as when `| head` has exited."""
    r, w = os.pipe()
    os.close(r)
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(pinloader.__file__).resolve().parent.parent), e.get("PYTHONPATH")) if p)
    try:
        return subprocess.run([sys.executable, "-m", "pinloader", *args], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=e)
    finally:
        os.close(w)


@pytest.mark.parametrize("args", [("info",), ("info", "--json"),
                                  ("demo", "--device", "cpu", "--steps", "2", "--warmup", "0",
                                   "--batch-size", "2", "--image-size", "8", "--compute-ms", "1")])
def test_a_closed_pipe_ends_the_command_quietly_with_the_sigpipe_status(args):
    from pinloader.__main__ import EXIT_BROKEN_PIPE

    out = _run_into_closed_pipe(*args)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == EXIT_BROKEN_PIPE, out.stderr


@pytest.mark.parametrize("args", [("info",), ("demo", "--device", "cpu", "--steps", "3", "--warmup", "1",
                                            "--batch-size", "4", "--image-size", "16",
                                            "--compute-ms", "1")])
def test_a_reader_that_stops_after_the_first_line_gets_it_and_no_traceback(args):
    """What `python -m pinloader ARGS | head -1` does: the reader takes the first line and
    closes the pipe while the command may still be writing."""
    from pinloader.__main__ import EXIT_BROKEN_PIPE

    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(pinloader.__file__).resolve().parent.parent), e.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "pinloader", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e)
    try:
        first = proc.stdout.readline()
        proc.stdout.close()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first.startswith("pinloader ")
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    if args[0] == "demo":
        # its table comes seconds after the first line, into the closed pipe
        assert proc.returncode == EXIT_BROKEN_PIPE, err
    else:
        # info may have written everything before the pipe closed
        assert proc.returncode in (0, EXIT_BROKEN_PIPE), err


def test_demo_on_the_cpu_copies_in_every_row_and_says_what_it_shows():
    result = _demo_json()
    assert set(result["rows"]) >= {"pinloader"} and len(result["rows"]) == 2
    plain = [name for name in result["rows"] if name != "pinloader"][0]
    assert "copy" in plain, f"the plain row must copy the batch like pinloader does: {plain!r}"
    assert result["staging_threads"] >= 1
    assert result["compute_reps"] >= 1 and result["compute_ms"] > 0
    note = result["note"]
    assert "host backend" in note and "does not predict" in note
    assert f"{result['cpu_count']} core(s)" in note


def test_demo_staging_threads_option_reaches_the_prefetcher():
    assert _demo_json("--staging-threads", "2")["staging_threads"] == 2


def test_demo_progress_counts_the_steps_it_announces():
    out = _run("demo", "--device", "cpu", "--steps", "3", "--warmup", "2", "--batch-size", "4",
               "--image-size", "32", "--compute-ms", "2", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "calibrating compute, try 1/" in out.stderr
    assert "median of 5 runs" in out.stderr
    assert "(2 warm-up + 3 timed): 5 steps" in out.stderr
    assert "2 warm-up + 3 timed steps" in out.stdout
    assert "What this run shows" in out.stdout


@pytest.mark.parametrize("make", ["prefetcher", "pool", "prim"])
def test_cpu_0_is_the_host_device(make):
    if make == "prefetcher":
        with pinloader.AsyncPrefetcher([[1.0]], device="cpu:0") as pf:
            assert pf.device == "cpu"
    elif make == "pool":
        with pinloader.PinnedPool(device="cpu:0") as pool:
            assert pool.backend == "host"
    else:
        _C._testing.Prim("cpu:0")


def test_cpu_index_above_0_is_rejected():
    with pytest.raises(ValueError, match="'cpu:0'"):
        pinloader.PinnedPool(device="cpu:1")
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="one device"):
        pinloader.PinnedPool(device=torch.device("cpu", 1))


@pytest.mark.skipif(pinloader.cuda_available(), reason="CUDA is usable here")
def test_cuda_without_cuda_suggests_the_cpu(monkeypatch):
    monkeypatch.delenv("PINLOADER_BACKEND", raising=False)
    with pytest.raises(pinloader.CudaError) as ei:
        pinloader.PinnedPool(device="cuda")
    msg = str(ei.value)
    assert 'device="cpu"' in msg, msg
    info = pinloader.cuda_info()
    if info["library"] and info["driver_version"] == 0:
        assert "no NVIDIA driver is installed" in msg, msg


def test_front_doors_share_the_default_device():
    torch = pytest.importorskip("torch")
    import pinloader.torch as pt

    with pinloader.AsyncPrefetcher([[1.0]]) as pf, pt.prefetch([[torch.ones(1)]]) as tp:
        if pinloader.backend() == "host":
            assert pf.device == "cpu" and tp.device == torch.device("cpu")
        else:
            assert pf.device == f"cuda:{torch.cuda.current_device()}"
            assert tp.device == torch.device("cuda", torch.cuda.current_device())
