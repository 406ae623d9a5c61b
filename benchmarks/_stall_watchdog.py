"""The outside half of ``_common.watch_for_stalls``: a separate process that watches a benchmark
whose own watch thread cannot run (a thread that holds the GIL and blocks in C stops every
Python thread of the process, the watch's too).

    python benchmarks/_stall_watchdog.py PID HEARTBEAT SECONDS REPORT

When HEARTBEAT (a file that ``_common.log`` touches) has not changed for SECONDS, it writes to
REPORT what each of PID's threads is blocked in, as the kernel says (``/proc/PID/task/*``: name,
state, wait channel, system call, kernel stack where readable), the native and Python stacks from
``py-spy dump --native`` when py-spy is installed, the GPU's memory and use, the kernel log's tail; then it sends SIGUSR2,
on which the benchmark's faulthandler writes every thread's Python stack (a signal handler: no
GIL needed) to REPORT.python, and kills PID (SIGKILL, so that the script's later steps get their
time). It ends by itself when PID ends.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError as e:
        return f"({e.strerror})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return Path(f"/proc/{pid}").exists() and "zombie" not in _read(Path(f"/proc/{pid}/status"))


def threads_report(pid: int) -> str:
    """Each thread of ``pid``: name, state, wait channel, system call and kernel stack."""
    lines = []
    tasks = Path(f"/proc/{pid}/task")
    try:
        tids = sorted(tasks.iterdir(), key=lambda p: int(p.name))
    except OSError as e:
        return f"/proc/{pid}/task: {e.strerror}\n"
    for t in tids:
        state = next((ln.split(":", 1)[1].strip() for ln in _read(t / "status").splitlines()
                      if ln.startswith("State:")), "?")
        lines.append(f"thread {t.name} {_read(t / 'comm')!r}: {state}; wchan {_read(t / 'wchan')}; "
                     f"syscall {_read(t / 'syscall').split(' ')[0]}")
        stack = _read(t / "stack")
        if stack and not stack.startswith("("):
            lines.extend("    " + ln for ln in stack.splitlines())
    return "\n".join(lines) + "\n"


def report(pid: int, seconds: float, path: Path) -> None:
    with open(path, "w") as f:
        f.write(f"no progress logged for {seconds:.0f} s and the process's own watch did not end it; "
                f"seen from outside (pid {pid}):\n\n")
        f.write(threads_report(pid))
        f.flush()
        commands_report(pid, f)


# what the stall report runs: native stacks, the GPU's memory and engines' use (a JPEG engine
# job that never ends shows as JPEG utilisation with nothing else running), the kernel's log
# (an Xid error names a GPU fault)
COMMANDS = (("py-spy", "dump", "--native", "--pid", "{pid}"),
            ("nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu", "--format=csv"),
            ("nvidia-smi", "-q", "-d", "UTILIZATION"),
            ("dmesg", "--ctime"))


def commands_report(pid: int, f) -> None:  # type: ignore[no-untyped-def]
    for cmd in ([a.format(pid=pid) for a in c] for c in COMMANDS):
        if not shutil.which(cmd[0]):
            f.write(f"\n{cmd[0]} is not installed\n")
            continue
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            out = r.stdout if cmd[0] != "dmesg" else "\n".join(r.stdout.splitlines()[-30:]) + "\n"
            f.write(f"\n$ {' '.join(cmd)}\n{out}{r.stderr}")
        except subprocess.TimeoutExpired:
            f.write(f"\n$ {' '.join(cmd)}\n(no answer in 60 s)\n")
        f.flush()


def main(argv: list[str]) -> int:
    pid, heartbeat, seconds, out = int(argv[0]), Path(argv[1]), float(argv[2]), Path(argv[3])
    while _alive(pid):
        try:
            quiet = time.time() - heartbeat.stat().st_mtime
        except OSError:
            return 0  # the benchmark took its heartbeat away: it is ending
        if quiet < seconds:
            time.sleep(max(0.05, min(1.0, (seconds - quiet) / 2)))
            continue
        report(pid, seconds, out)
        try:
            os.kill(pid, signal.SIGUSR2)
            py_stacks = Path(f"{out}.python")
            deadline = time.monotonic() + 5.0
            time.sleep(0.5)
            while time.monotonic() < deadline and not (py_stacks.exists() and py_stacks.stat().st_size):
                time.sleep(0.1)  # the handler runs when the thread next may take a signal
            time.sleep(0.5)  # and writes every thread's stack
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with open(out, "a") as f:
            f.write(f"\nkilled pid {pid}; its Python stacks (faulthandler, on SIGUSR2): {out}.python\n")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
