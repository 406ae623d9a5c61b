"""ImageLoader's request for the CUDA driver's hardware work queues (pinloader/_hardware_queues.py,
Note [hardware work queues] in src/core/backend_cuda.c), with the driver's answers faked: the
GPU side is tests/test_jpeg_decoder_gpu.py's."""
from __future__ import annotations

import os

import numpy as np
import pytest

import pinloader
from pinloader import _C, _hardware_queues as hq

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


class _Driver:
    """_C's cuda_driver_state, answering `state`, counting the questions."""

    def __init__(self, state):
        self.state = state
        self.asked = 0

    def cuda_driver_state(self):
        self.asked += 1
        return self.state


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.delenv("PINLOADER_BACKEND", raising=False)
    monkeypatch.setattr(hq, "_done", None)
    monkeypatch.setattr(hq, "_set_here", False)

    def use(state):
        d = _Driver(state)
        monkeypatch.setattr(hq, "_C", d)
        return d
    yield use
    os.environ.pop(VAR, None)  # monkeypatch restores what was there before ask() set it


def test_a_driver_not_yet_initialized_gets_32_once(driver):
    d = driver("uninitialized")
    got = hq.ask()
    assert got[0] == 32 and "not yet initialized" in got[1]
    assert os.environ[VAR] == "32"
    assert hq.ask() == got and d.asked == 1  # decided once per process


def test_an_initialized_driver_leaves_the_variable_unset(driver):
    driver("initialized")
    queues, why = hq.ask()
    assert queues == 8 and "before CUDA is first used" in why
    assert VAR not in os.environ


@pytest.mark.parametrize("state,start", [("unknown", "unknown"), ("absent", "no CUDA driver")])
def test_no_answer_or_no_driver_leaves_the_variable_unset(driver, state, start):
    driver(state)
    queues, why = hq.ask()
    assert queues is None and why.startswith(start)
    assert VAR not in os.environ


@pytest.mark.parametrize("text,value", [("1", 1), ("16", 16), (" 4 ", 4), ("64", 32), ("0", None), ("x", None),
                                        ("\u0663", None), ("9" * 5000, None)])
def test_the_users_value_is_reported_never_changed(driver, monkeypatch, text, value):
    d = driver("uninitialized")
    monkeypatch.setenv(VAR, text)
    queues, why = hq.ask()
    assert queues == value and "was set before the loader" in why and len(why) < 120
    assert os.environ[VAR] == text
    assert d.asked == 0
    monkeypatch.setenv(VAR, "2")  # decided once: a later change is not what the driver read
    assert hq.ask() == (queues, why)


def test_a_fork_child_asks_again(driver, monkeypatch):
    driver("initialized")
    monkeypatch.setattr(hq, "_done", (os.getpid() + 1, 32, "the parent's"))
    assert hq.ask()[0] == 8


def test_a_fork_child_of_a_process_that_set_it_says_so(driver, monkeypatch):
    driver("uninitialized")
    assert hq.ask()[0] == 32
    monkeypatch.setattr(hq, "_done", (os.getpid() + 1, 32, "the parent's"))  # as in a fork child
    queues, why = hq.ask()
    assert queues == 32 and "by pinloader in the process this one was forked from" in why


def test_the_forced_host_backend_asks_nothing(driver, monkeypatch):
    d = driver("uninitialized")
    monkeypatch.setenv("PINLOADER_BACKEND", "host")
    assert hq.ask() == (None, "PINLOADER_BACKEND=host")
    assert d.asked == 0 and VAR not in os.environ


_FORK_HELD = r"""
import os, sys, time
from pinloader import _hardware_queues as hq

class Driver:
    def cuda_driver_state(self):
        return "initialized"

hq._C = Driver()
with hq._lock:  # as a parent thread in ask() at the fork would
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if hq.ask()[0] == 8 else 1
        finally:
            os._exit(code)
"""


def test_a_fork_child_asks_though_the_parent_held_the_lock():
    # in a child interpreter of one thread: a fork of the test process, whose earlier tests left
    # threads, could hang on another lock than this one
    from helpers import WAIT_CHILD, describe, run_py
    code = _FORK_HELD + WAIT_CHILD.format(timeout=30, poll=0.02) + 'print("child", wait_child(pid))\n'
    p = run_py(code, timeout=90, env_remove=(VAR, "PINLOADER_BACKEND"))
    assert p.returncode == 0 and p.stdout.split() == ["child", "0"], describe(p)


def test_threads_ask_once(driver):
    import threading
    d = driver("uninitialized")
    got = []
    barrier = threading.Barrier(8)

    def one():
        barrier.wait()
        got.append(hq.ask())
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.asked == 1 and len(set(got)) == 1 and got[0][0] == 32


def test_driver_state_here():
    # this machine's answer, never initializing the driver: with no libcuda to load, "absent"
    import ctypes
    got = _C.cuda_driver_state()
    assert got in ("absent", "uninitialized", "initialized", "unknown")
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert got == "absent"
    with pytest.raises(TypeError):
        _C.cuda_driver_state(0)


def test_a_host_loader_does_not_ask_and_a_default_one_asks_once(tmp_path, driver):
    from PIL import Image
    path = tmp_path / "a.jpg"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    d = driver("absent")
    for kw in ({"device": "cpu"}, {"decoder": "host"}):
        loader = pinloader.ImageLoader([(str(path), 0)], 1, **kw)
        st = loader.stats()
        loader.close()
        assert "cuda_connections" not in st
    assert d.asked == 0
    loader = pinloader.ImageLoader([(str(path), 0)], 1)  # device=None: the GPU's where there is one
    loader.close()
    assert d.asked == 1 and VAR not in os.environ
