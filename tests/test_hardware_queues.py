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
    """_C's cuda_driver_initialized, answering `state`, counting the questions."""

    def __init__(self, state):
        self.state = state
        self.asked = 0

    def cuda_driver_initialized(self):
        self.asked += 1
        return self.state


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(hq, "_done", None)

    def use(state):
        d = _Driver(state)
        monkeypatch.setattr(hq, "_C", d)
        return d
    yield use
    os.environ.pop(VAR, None)  # monkeypatch restores what was there before ask() set it


def test_a_driver_not_yet_initialized_gets_32_once(driver):
    d = driver(False)
    got = hq.ask()
    assert got[0] == 32 and "not yet initialized" in got[1]
    assert os.environ[VAR] == "32"
    assert hq.ask() == got and d.asked == 1  # decided once per process


def test_an_initialized_driver_leaves_the_variable_unset(driver):
    driver(True)
    queues, why = hq.ask()
    assert queues == 8 and "before CUDA is first used" in why
    assert VAR not in os.environ


def test_an_unknown_answer_leaves_the_variable_unset(driver):
    driver(None)
    queues, why = hq.ask()
    assert queues is None and why.startswith("unknown")
    assert VAR not in os.environ


@pytest.mark.parametrize("text,value", [("1", 1), ("16", 16), (" 4 ", 4), ("x", None), ("\u0663", None),
                                        ("9" * 5000, None)])
def test_the_users_value_is_reported_never_changed(driver, monkeypatch, text, value):
    d = driver(False)
    monkeypatch.setenv(VAR, text)
    queues, why = hq.ask()
    assert queues == value and "was set before the loader" in why
    assert os.environ[VAR] == text
    assert d.asked == 0


def test_a_fork_child_asks_again(driver, monkeypatch):
    driver(True)
    monkeypatch.setattr(hq, "_done", (os.getpid() + 1, 32, "the parent's"))
    assert hq.ask()[0] == 8


def test_driver_initialized_without_a_driver():
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        driver_loaded = "libcuda.so" in f.read()
    got = _C.cuda_driver_initialized()
    assert got is False if not driver_loaded else got in (True, False, None)
    with pytest.raises(TypeError):
        _C.cuda_driver_initialized(0)


def test_a_host_loader_does_not_ask(tmp_path, monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(hq, "_done", None)
    from PIL import Image
    path = tmp_path / "a.jpg"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    for kw in ({"device": "cpu"}, {"decoder": "host"}):
        loader = pinloader.ImageLoader([(str(path), 0)], 1, **kw)
        st = loader.stats()
        loader.close()
        assert "cuda_connections" not in st
        assert VAR not in os.environ
