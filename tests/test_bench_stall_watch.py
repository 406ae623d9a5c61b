"""benchmarks/_common.py's watch_for_stalls: a GPU run that stops making progress leaves the
process's stacks behind (the runs are bounded by a timeout that kills them, and then nothing
else would say where they were). Also: its result files name the settings a run had."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# benchmarks/ stays in the repository: the sdist (whose tests CI also runs) does not carry it.
pytestmark = pytest.mark.skipif(not (BENCH / "_common.py").is_file(),
                                reason="benchmarks/ is not in the sdist")


def _common():
    """benchmarks/_common.py, imported in this process."""
    from helpers import bench_module
    return bench_module("_common")


def _run(tmp_path, body):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(BENCH)!r})
        import _common as C
        from pathlib import Path
        out = Path({str(tmp_path)!r}) / "sub" / "run_stall.txt"
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_stall_writes_every_threads_stack_once_and_the_run_goes_on(tmp_path):
    r = _run(tmp_path, """
        def stuck_in_a_named_place():
            deadline = time.monotonic() + 60
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # the file is complete once the watch has logged
        C.watch_for_stalls(0.3, out)
        stuck_in_a_named_place()
        print("went on")
    """)
    assert r.returncode == 0, r.stderr
    assert "went on" in r.stdout
    text = (tmp_path / "sub" / "run_stall.txt").read_text()
    assert "no progress logged for 0 s" in text
    assert "stuck_in_a_named_place" in text  # the main thread's frame
    assert "in watch" in text  # every thread's
    assert r.stderr.count("stalled: no progress logged") == 1


def test_logging_holds_the_watch_off(tmp_path):
    r = _run(tmp_path, """
        C.watch_for_stalls(1.0, out)
        for _ in range(12):
            C.log("progress")
            time.sleep(0.2)
        print("exists" if out.exists() else "absent")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "absent"


def test_zero_seconds_is_off():
    C = _common()
    import threading
    before = {t.name for t in threading.enumerate()}
    C.watch_for_stalls(0)
    assert "stall-watch" not in {t.name for t in threading.enumerate()} - before


def test_with_an_exit_code_the_stalled_run_ends_there(tmp_path):
    r = _run(tmp_path, """
        C.watch_for_stalls(0.3, out, exit_code=3)
        time.sleep(60)
        print("not reached")
    """)
    assert r.returncode == 3
    assert "not reached" not in r.stdout
    assert "Python stacks" in (tmp_path / "sub" / "run_stall.txt").read_text()


def test_a_thread_that_holds_the_gil_is_seen_from_outside_and_the_run_ends(tmp_path):
    # sum() over a range runs in C and never lets the GIL go: the process's own watch thread
    # cannot run (10**11 additions: minutes, far past the outside watch's 1.3 s)
    r = _run(tmp_path, """
        C.watch_for_stalls(0.3, out, exit_code=3, grace=1.0)
        def blocked_in_c_holding_the_gil():
            sum(range(10**11))
        blocked_in_c_holding_the_gil()
        print("not reached")
    """)
    assert r.returncode == -9, (r.returncode, r.stderr)  # killed by the outside watch
    assert "not reached" not in r.stdout
    outside = (tmp_path / "sub" / "run_stall.txt.outside").read_text()
    assert "seen from outside" in outside
    assert "wchan" in outside and "thread " in outside
    py = (tmp_path / "sub" / "run_stall.txt.outside.python").read_text()
    assert "blocked_in_c_holding_the_gil" in py
    # the process's own watch never wrote (it needed the GIL)
    assert not (tmp_path / "sub" / "run_stall.txt").exists()


def test_a_run_that_ends_well_leaves_no_watch_files(tmp_path):
    r = _run(tmp_path, """
        C.watch_for_stalls(30, out, exit_code=3)
        C.log("progress")
        print("done")
    """)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == []


def test_result_files_name_the_settings_a_run_had():
    # an A/B of settings (benchmarks/ab_gpu.sh's ENV_A / ENV_B) is told apart in its result files
    C = _common()
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "PINLOADER_JPEG_DECODERS": "4", "HOME": "/root",
           "OMP_NUM_THREADS": "1", "PATH": "/bin", "CUDA_HOME": "/usr/local/cuda", "CUDA_VERSION": "13.0",
           "TORCH_HOME": "/root/.cache/torch"}
    got = C.settings_in_environment(env)
    assert got == {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "OMP_NUM_THREADS": "1", "PINLOADER_JPEG_DECODERS": "4"}
    lines = C.machine_summary_lines({"settings": got})
    assert lines[-1] == "- Settings: CUDA_DEVICE_MAX_CONNECTIONS=32 OMP_NUM_THREADS=1 PINLOADER_JPEG_DECODERS=4"
    assert not C.machine_summary_lines({"settings": {}})[-1].startswith("- Settings")
