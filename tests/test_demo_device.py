"""The demo checks its device before doing any work: unknown devices exit 2 with the reason
(with or without torch), CUDA that cannot be used (no usable GPU for pinloader, a torch built
without CUDA, no torch) falls back to the host backend and says so; and `info` says plainly
what was not found."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pinloader
from pinloader import demo
from pinloader.__main__ import _print_info


SMALL = ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--image-size", "16",
         "--compute-ms", "1"]


def _demo(*args: str, hide_torch: bool = False) -> subprocess.CompletedProcess[str]:
    pre = "import sys; sys.modules['torch'] = None; " if hide_torch else ""
    code = pre + "import sys; from pinloader.__main__ import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ)
    pkg_parent = str(Path(pinloader.__file__).resolve().parent.parent)  # the pinloader under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code, "demo", *args], capture_output=True,
                          text=True, timeout=240, env=env)


@pytest.mark.parametrize("hide_torch", [False, True], ids=["torch-if-installed", "no-torch"])
@pytest.mark.parametrize("device", ["foo", "cuda:x", "gpu", "cpu:1", "cuda:-1"])
def test_unknown_device_exits_2_with_the_reason(device, hide_torch):
    out = _demo("--device", device, *SMALL, hide_torch=hide_torch)
    assert out.returncode == 2, out.stderr
    assert "unknown device" in out.stderr and repr(device) in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(pinloader.backend() == "cuda", reason="CUDA is usable here")
@pytest.mark.parametrize("hide_torch", [False, True], ids=["torch-if-installed", "no-torch"])
def test_cuda_without_a_usable_gpu_falls_back_and_says_so(hide_torch):
    out = _demo("--device", "cuda", *SMALL, "--json", hide_torch=hide_torch)
    assert out.returncode == 0, out.stderr
    assert "running on the host backend instead" in out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_only_torch_on_a_gpu_host_falls_back(monkeypatch):
    monkeypatch.setattr(pinloader, "backend", lambda: "cuda")
    monkeypatch.setattr(pinloader, "device_count", lambda: 1)
    for requested in (None, "cuda", "cuda:0"):
        device, note = demo._resolve_device(requested, have_torch=True, torch_cuda=False)
        assert device == "cpu"
        assert note and "without CUDA" in note and "host backend" in note
    device, note = demo._resolve_device("cuda:0", have_torch=False, torch_cuda=False)
    assert device == "cpu" and "needs torch" in note
    assert demo._resolve_device("cuda:0", True, True) == ("cuda:0", None)
    assert demo._resolve_device(None, True, True) == ("cuda", None)
    with pytest.raises(demo.DeviceError, match="1 CUDA device"):
        demo._resolve_device("cuda:3", True, True)


def test_demo_counts_the_batches_it_timed_and_a_warm_p99():
    out = _demo("--device", "cpu", *SMALL)
    assert out.returncode == 0, out.stderr
    assert "3 batches copied (1 warm-up + 2 timed)" in out.stdout
    assert "p99 over the timed steps" in out.stdout


def test_demo_cpus_follow_the_cpu_budget(monkeypatch):
    from pinloader import _C

    monkeypatch.setattr(_C, "cpu_budget", lambda: {"online": 16, "affinity": 16, "quota": 2.5,
                                                    "local_ranks": 1})
    assert demo._cpus() == 3
    monkeypatch.setattr(_C, "cpu_budget", lambda: {"online": 16, "affinity": 4, "quota": None,
                                                    "local_ranks": 1})
    assert demo._cpus() == 4


def _info(**kw):
    base = dict(version="0", backend="host", device_count=0, library="", runtime_version=0,
                driver_version=0, error="", nvtx=False)
    base.update(kw)
    return base


def test_info_says_no_cuda_driver_found(capsys):
    _print_info(_info(library="libcudart.so.13", runtime_version=13000,
                      error="cudaErrorInsufficientDriver: no NVIDIA driver is installed"))
    text = capsys.readouterr().out
    assert "no CUDA driver found" in text and "CUDA none" not in text
    assert "pinloader[cuda]" not in text


def test_info_without_libcudart_points_at_the_cuda_extra(capsys):
    _print_info(_info(error="no CUDA runtime library found"))
    text = capsys.readouterr().out
    assert 'pip install "pinloader[cuda]"' in text and "CUDA none" not in text
