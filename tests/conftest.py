"""Shared fixtures for the pinloader test suite.

* ``gpu`` marker: tests that need a CUDA device. They are skipped, with a reason that starts
  with "no CUDA device", when ``pinloader.cuda_available()`` is False (no GPU, no driver, or
  ``PINLOADER_BACKEND=host``).
* ``backend_device``: parametrizes a test over the backends: ``"cpu"`` (the host backend,
  always) and ``"cuda:0"`` (gpu-marked).
* ``prim``: a ``pinloader._C._Prim`` for ``backend_device``.
* ``run_python`` / ``python_env``: run code in a fresh interpreter importing this checkout.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pinloader
from pinloader import _C

CUDA = pinloader.cuda_available()


def _no_cuda_reason() -> str:
    try:
        detail = pinloader.cuda_info().get("error") or ""
    except Exception as e:  # pragma: no cover - cuda_info itself failing is reported elsewhere
        detail = repr(e)
    if os.environ.get("PINLOADER_BACKEND") == "host":
        detail = "PINLOADER_BACKEND=host"
    return "no CUDA device" + (f" ({detail})" if detail else "")


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated so that running from another rootdir works.
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped with a reason elsewhere)")
    config.addinivalue_line("markers", "slow: long soak or stress test")
    config.addinivalue_line(
        "markers", "fuzz: the hostile-input fuzz target (tests/test_fuzz.py; CI also runs it under "
        "the ASan build with PINLOADER_FUZZ_EXAMPLES and a fixed --hypothesis-seed)")


def pytest_terminal_summary(terminalreporter):
    # The fuzz job reports how many inputs it tried (read from tests/test_fuzz.py's counters).
    fuzz = sys.modules.get("test_fuzz")
    tried = getattr(fuzz, "TRIED", None)
    if tried and tried["examples"]:
        terminalreporter.write_line(
            "fuzz: {examples} examples, {items} items, {leaves} leaves tried "
            "({delivered} items delivered, {refused} refused)".format(**tried))
    loader = getattr(fuzz, "TRIED_LOADER", None)
    if loader and loader["examples"]:
        terminalreporter.write_line(
            "fuzz: {examples} ArrayLoader examples, {batches} batches checked, {refused} "
            "refused cleanly".format(**loader))


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason=_no_cuda_reason())
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


BACKEND_DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param("cuda:0", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKEND_DEVICES)
def backend_device(request):
    """The device string of one backend: "cpu" (host backend) or "cuda:0" (gpu-marked)."""
    dev = request.param
    if dev.startswith("cuda") and not CUDA:  # belt and braces: the marker already skips
        pytest.skip(_no_cuda_reason())
    return dev


@pytest.fixture
def prim(backend_device):
    p = _C._Prim(backend_device)
    assert p.backend == ("host" if backend_device == "cpu" else "cuda")
    return p


def _run_python(code: str, env_extra: dict | None = None, timeout: float = 60.0,
                env_remove: tuple = ()) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that imports this checkout's pinloader."""
    env = dict(os.environ)
    for k in env_remove:
        env.pop(k, None)
    if env_extra:
        env.update(env_extra)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=root)


@pytest.fixture
def run_python():
    """``run_python(code, env_extra=None, timeout=60, env_remove=())`` -> CompletedProcess."""
    return _run_python


@pytest.fixture
def python_env():
    """Environment for a child interpreter (Popen) that imports this checkout's pinloader."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env
