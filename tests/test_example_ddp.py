"""examples/ddp_train.py under torchrun, two ranks: the losses through ArrayLoader equal those of
plain indexing (on the CPU, marked slow; on two GPUs, gpu-marked), and a run stopped mid-epoch at
a checkpoint and resumed gives the uninterrupted run's losses (marked slow).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pinloader
from conftest import CUDA
from helpers import ROOT, child_env


@pytest.mark.slow
def test_ddp_example_matches_plain_indexing_on_cpu():
    pytest.importorskip("torch")
    env = child_env({"OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "ddp_train.py"), "--cpu", "--epochs", "2", "--rows", "1001"]
    # 1001 rows, 2 ranks: 501 rows each, 8 batches of 64, 2 epochs; both ranks' losses per line
    expected_lines = 2 * 8

    def run(extra):
        p = subprocess.run(cmd + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout.splitlines()

    lines = [run([]), run(["--plain"])]
    assert len(lines[0]) == expected_lines
    assert lines[0] == lines[1]
    assert lines[0][-1].startswith("epoch 1 step 7 losses ") and len(lines[0][-1].split()) == 7


def _two_gpus() -> bool:
    return CUDA and pinloader.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices (torchrun, one GPU per process)")
def test_two_gpu_ddp_example_matches_plain_indexing():
    pytest.importorskip("torch")
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "ddp_train.py"), "--epochs", "2"]
    outs = []
    for extra in ([], ["--plain"]):
        p = subprocess.run(cmd + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(p.stdout.splitlines())
    assert len(outs[0]) > 0 and outs[0] == outs[1]


@pytest.mark.slow
def test_ddp_example_resumes_mid_epoch_with_identical_losses(tmp_path):
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "ddp_train.py"), "--cpu", "--epochs", "2", "--rows", "1001"]
    ckpt = str(tmp_path / "ckpt.pt")
    env = child_env({"OMP_NUM_THREADS": "1"})

    def run(extra, expected_lines):
        # the same single retry as test_ddp_example_matches_plain_indexing_on_cpu, for torch
        # gloo's teardown abort after the whole run printed
        for attempt in range(2):
            p = subprocess.run(cmd + extra, env=env, cwd=ROOT, capture_output=True, text=True,
                               timeout=300)
            lines = p.stdout.splitlines()
            teardown_abort = (p.returncode != 0 and len(lines) == expected_lines
                              and "terminate called without an active exception" in p.stderr)
            if p.returncode == 0 or not teardown_abort or attempt == 1:
                assert p.returncode == 0, p.stderr[-3000:]
                return lines
        raise AssertionError("unreachable")

    whole = run([], 16)
    first = run(["--checkpoint", ckpt, "--stop-after", "5"], 5)
    rest = run(["--resume", ckpt], 11)
    assert first == whole[:5] and rest == whole[5:]
    # plain indexing of the resumed epoch's items (indices_after) trains the same
    assert run(["--resume", ckpt, "--plain"], 11) == rest
    assert rest[0].startswith("epoch 0 step 5 losses ")
