"""Shared fixtures and markers of the pinloader test suite (the shared helpers are in
tests/helpers.py; tests/README.md maps the test files to what they cover).

Markers (also declared in pyproject.toml):

* ``gpu``: tests that need a CUDA device. They are skipped, with a reason that starts with
  "no CUDA device", when ``pinloader.cuda_available()`` is False (no GPU, no driver, or
  ``PINLOADER_BACKEND=host``).
* ``slow``: long soak or stress tests (the sanitizer jobs leave them out).
* ``fuzz``: the fuzz target, tests/test_fuzz.py.
* ``fork``: tests that fork (all in tests/test_fork.py).
* ``hostile``: hostile input or user code (absurd sizes, headers that lie, re-entry, files cut
  under a mapping) that must get a clean error and never a crash or a hang.
* ``jax_gpu``: tests that start JAX's GPU client. They run after every other test of the session
  (pytest_collection_modifyitems): the client keeps a thread that polls its streams with
  cuStreamQuery, a call that invalidates any graph capture in global mode then in progress, so
  the tests that capture in torch's default mode (tests/test_static_cuda.py) must run before it
  exists.

Fixtures:

* ``backend_device``: parametrizes a test over the backends: ``"cpu"`` (the host backend,
  always) and ``"cuda:0"`` (gpu-marked).
* ``prim``: a ``pinloader._C._testing.Prim`` for ``backend_device``.
* ``make_pool``: ``make_pool(max_bytes, device="cpu")`` -> a PinnedPool closed at teardown.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

import pinloader
from pinloader import _C

CUDA = pinloader.cuda_available()

# A suite started as a shell's background job (`bash .ci/run &`) inherits SIGINT ignored, and
# so does every interpreter it starts: Python then installs no KeyboardInterrupt handler, and
# the Ctrl-C tests see their signal vanish. A handled signal is reset to its default by exec,
# so the children get Python's usual handler again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
        "markers", "fuzz: the hostile-input fuzz targets (tests/test_fuzz*.py; CI also runs them under "
        "the ASan build with PINLOADER_FUZZ_EXAMPLES and a fixed --hypothesis-seed)")
    config.addinivalue_line("markers", "fork: forks a child process (tests/test_fork.py)")
    config.addinivalue_line(
        "markers", "hostile: hostile input or user code that must get a clean error, never a crash")
    config.addinivalue_line(
        "markers", "jax_gpu: starts JAX's GPU client; run after every other test (tests/conftest.py)")


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
    static = getattr(fuzz, "TRIED_STATIC", None)
    if static and static["examples"]:
        terminalreporter.write_line(
            "fuzz: {examples} static/out= examples, {batches} batches checked, {refused} refused "
            "cleanly, {closed} closed during a handout".format(**static))
    resume = getattr(fuzz, "TRIED_RESUME", None)
    if resume and resume["examples"]:
        terminalreporter.write_line(
            "fuzz: {examples} resume/door examples, {batches} batches checked, {refused} states "
            "refused cleanly".format(**resume))
    images = getattr(sys.modules.get("test_fuzz_images"), "TRIED_IMAGES", None)
    if images and any(images.values()):
        terminalreporter.write_line(
            "fuzz images: {jpeg} JPEG headers, {tar} tar shards ({tar_read} read), {packed} packed "
            "datasets ({packed_read} read), {resume} resumed packs ({resume_done} done), {files} file "
            "lists, {wds} WebDataset shards ({wds_read} read), {loader} loaders".format(**images))


def pytest_collection_modifyitems(config, items):
    # jax_gpu tests last, in their own order (the module docstring says why)
    items.sort(key=lambda item: item.get_closest_marker("jax_gpu") is not None)
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
    p = _C._testing.Prim(backend_device)
    assert p.backend == ("host" if backend_device == "cpu" else "cuda")
    return p


@pytest.fixture
def make_pool():
    """``make_pool(max_bytes, device="cpu")`` -> a PinnedPool, closed at teardown."""
    pools = []

    def make(max_bytes, device="cpu"):
        p = pinloader.PinnedPool(max_bytes=max_bytes, device=device)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()
