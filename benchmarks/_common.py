"""Shared helpers for the pinloader benchmarks.

Machine description, result files (JSON and Markdown), summary statistics, CUDA-event and
host-time helpers, and guarded execution of benchmark rows. Nothing here imports torch at
module level, so every script can parse its arguments (and answer ``--help``) on a machine
without PyTorch or a GPU.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "results"
EXIT_NO_CUDA = 2


def _prefer_repo_pinloader() -> None:
    """Benchmark the working tree's pinloader when it has been built in place.

    A script run as ``python benchmarks/bench_x.py`` has ``benchmarks/`` on sys.path, not the
    repository root; without this an in-place build (``setup.py build_ext --inplace``) would
    not be found, or an older installed copy would be measured instead."""
    pkg = REPO_ROOT / "pinloader"
    if (pkg / "__init__.py").is_file() and any(pkg.glob("_C*.so")):
        root = str(REPO_ROOT)
        if root not in sys.path:
            sys.path.insert(1, root)


_prefer_repo_pinloader()

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}


# --------------------------------------------------------------------------- argument parsing

def parse_size(text: str) -> int:
    """Parse '64K', '256MiB', '1G', '4096' into bytes (binary multiples)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 64K, 16M, 1G)")
    value = float(m.group(1)) * _SIZE_MULT[m.group(2).upper()]
    if value <= 0 or value != int(value):
        raise ValueError(f"size must be a positive whole number of bytes: {text!r}")
    return int(value)


def format_size(n: int) -> str:
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n} B"


def csv_list(kind: Callable[[str], Any]) -> Callable[[str], list]:
    """argparse type: a comma-separated list converted element-wise with ``kind``."""

    def convert(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise ValueError("empty list")
        return [kind(t) for t in items]

    convert.__name__ = f"list of {getattr(kind, '__name__', 'value')}"
    return convert


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of ``choices`` (``all`` selects every one)."""

    def convert(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if items == ["all"]:
            return list(choices)
        unknown = [t for t in items if t not in choices]
        if unknown or not items:
            raise ValueError(f"unknown {unknown or text!r}; choose from {', '.join(choices)}")
        return [c for c in choices if c in items]

    convert.__name__ = "choice list"
    return convert


def smoke_out(args) -> None:
    """A --smoke run writes its files to a new temporary folder unless --out names one: a smoke
    run's numbers are not results, and benchmarks/results holds results only."""
    if args.out == DEFAULT_OUT:
        import tempfile
        args.out = Path(tempfile.mkdtemp(prefix="pinloader-smoke-"))
        log(f"--smoke: writing to {args.out}")


def add_output_args(parser, default_name: str) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for the JSON and Markdown results (default: %(default)s)")
    parser.add_argument("--name", default=default_name,
                        help="base name of the result files (default: %(default)s)")
    parser.add_argument("--device", default="cuda:0",
                        help="CUDA device to benchmark (default: %(default)s)")


# --------------------------------------------------------------------------- environment

def fail(message: str, code: int = EXIT_NO_CUDA) -> NoReturn:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "benchmark"
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(code)


def require_cuda(device: str = "cuda:0"):
    """Import torch and check that ``device`` is usable; exit with code 2 otherwise."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising something else
        fail(f"this benchmark needs PyTorch with CUDA; importing torch failed: {exc}")
    if not torch.cuda.is_available():
        fail("this benchmark needs a CUDA GPU, and torch.cuda.is_available() is False "
             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    dev = torch.device(device)
    if dev.type != "cuda":
        fail(f"--device must be a CUDA device, got {device!r}")
    index = dev.index if dev.index is not None else 0
    if index >= torch.cuda.device_count():
        fail(f"{device} requested but only {torch.cuda.device_count()} CUDA device(s) visible")
    torch.cuda.set_device(index)
    return torch


def import_pinloader() -> tuple[Any, str | None]:
    """Return (module, None) or (None, 'ErrorType: message')."""
    try:
        module = importlib.import_module("pinloader")
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return module, None


def require_pinloader_cuda():
    """Import pinloader and check that it runs on its CUDA backend; raise otherwise."""
    module, err = import_pinloader()
    if module is None:
        raise RuntimeError(f"pinloader is not importable ({err})")
    backend = module.backend()
    if backend != "cuda":
        raise RuntimeError(f"pinloader backend is {backend!r}, not 'cuda'")
    return module


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _cpu_model() -> str | None:
    text = _read_text("/proc/cpuinfo")
    if text:
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    return platform.processor() or None


def _mem_total_gib() -> float | None:
    text = _read_text("/proc/meminfo")
    if text:
        m = re.search(r"^MemTotal:\s+(\d+)\s+kB", text, re.MULTILINE)
        if m:
            return round(int(m.group(1)) / (1024 * 1024), 2)
    return None


def _numa_nodes() -> int | None:
    try:
        return len([p for p in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", p)])
    except OSError:
        return None


def _nvidia_smi(fields: str) -> list[list[str]] | str:
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"
    if proc.returncode != 0:
        return f"unavailable: exit {proc.returncode}: {proc.stderr.strip()[:200]}"
    return [[c.strip() for c in line.split(",")] for line in proc.stdout.strip().splitlines()]


# Environment variables that change what a run measures: pinloader's own, the CUDA driver's and
# runtime's (CUDA_DEVICE_MAX_CONNECTIONS, CUDA_VISIBLE_DEVICES, ...) and the thread pools'.
# Where a variable only says where something is installed (CUDA_HOME, TORCH_HOME, ...), it is
# left out.
_SETTING_PREFIXES = ("PINLOADER_", "CUDA_", "NCCL_", "PYTORCH_", "TORCH_")
_SETTING_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONHASHSEED")
_NOT_SETTINGS = ("_HOME", "_PATH", "_ROOT", "_DIR", "_VERSION")


def settings_in_environment(environ=None) -> dict[str, str]:
    """The environment variables of _SETTING_PREFIXES / _SETTING_NAMES set for this run, sorted,
    so that a result file says what ran under which settings (an A/B of ENV_A / ENV_B, say)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env)
            if (k.startswith(_SETTING_PREFIXES) and not k.endswith(_NOT_SETTINGS)) or k in _SETTING_NAMES}


def machine_info(torch=None, device: str = "cuda:0") -> dict:
    """Describe the machine, the software and (when torch is given) the GPU."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    info: dict[str, Any] = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "numa_nodes": _numa_nodes(),
        "mem_total_gib": _mem_total_gib(),
        "settings": settings_in_environment(),
    }
    versions: dict[str, Any] = {
        "numpy": _dist_version("numpy"),
        "torch": _dist_version("torch"),
        "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"),
        "matplotlib": _dist_version("matplotlib"),
    }
    module, err = import_pinloader()
    if module is None:
        versions["pinloader"] = None
        info["pinloader_import_error"] = err
    else:
        versions["pinloader"] = getattr(module, "__version__", None) or _dist_version("pinloader")
        try:
            info["pinloader_backend"] = module.backend()
        except Exception as exc:
            info["pinloader_backend"] = f"error: {type(exc).__name__}: {exc}"
        info["pinloader_path"] = getattr(module, "__file__", None)
    info["versions"] = versions

    if torch is not None:
        gpu: dict[str, Any] = {"torch_cuda_runtime": torch.version.cuda}
        try:
            dev = torch.device(device)
            idx = dev.index if dev.index is not None else 0
            props = torch.cuda.get_device_properties(idx)
            gpu.update({
                "index": idx,
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "total_memory_gib": round(props.total_memory / GiB, 2),
                "multiprocessors": props.multi_processor_count,
            })
        except Exception as exc:
            gpu["error"] = f"{type(exc).__name__}: {exc}"
        try:
            gpu["cudnn"] = torch.backends.cudnn.version()
        except Exception:
            gpu["cudnn"] = None
        info["gpu"] = gpu

    smi = _nvidia_smi("pcie.link.gen.current,pcie.link.width.current,driver_version,name")
    if isinstance(smi, str):
        info["nvidia_smi"] = smi
    else:
        rows = []
        for cols in smi:
            row = dict(zip(("pcie_gen_current", "pcie_width_current", "driver", "name"), cols))
            rows.append(row)
        maxes = _nvidia_smi("pcie.link.gen.max,pcie.link.width.max")
        if not isinstance(maxes, str):
            for row, cols in zip(rows, maxes):
                row.update(dict(zip(("pcie_gen_max", "pcie_width_max"), cols)))
        info["nvidia_smi"] = rows
    return info


def machine_summary_lines(info: dict) -> list[str]:
    """A few Markdown lines that identify the machine in a result file."""
    gpu = info.get("gpu", {})
    smi = info.get("nvidia_smi")
    link = driver = None
    if isinstance(smi, list) and smi:
        idx = gpu.get("index", 0)
        row = smi[idx] if idx < len(smi) else smi[0]
        link = f"PCIe Gen{row.get('pcie_gen_current')} x{row.get('pcie_width_current')}"
        if row.get("pcie_gen_max"):
            link += f" (max Gen{row.get('pcie_gen_max')} x{row.get('pcie_width_max')})"
        driver = row.get("driver")
    v = info.get("versions", {})
    return [
        f"- GPU: {gpu.get('name', '?')} (CC {gpu.get('compute_capability', '?')}, "
        f"{gpu.get('total_memory_gib', '?')} GiB), driver {driver or '?'}, "
        f"torch CUDA {gpu.get('torch_cuda_runtime', '?')}, link {link or '?'}",
        f"- CPU: {info.get('cpu_model') or '?'}, {info.get('cpu_affinity') or info.get('cpu_count')} "
        f"usable cores, {info.get('numa_nodes') or '?'} NUMA node(s), {info.get('mem_total_gib') or '?'} GiB RAM",
        f"- Python {info.get('python')}, torch {v.get('torch')}, numpy {v.get('numpy')}, "
        f"cupy {v.get('cupy')}, pinloader {v.get('pinloader')} "
        f"(backend {info.get('pinloader_backend', info.get('pinloader_import_error', '?'))})",
        f"- Run at {info.get('created_utc')}: `{' '.join(info.get('argv', []))}`",
    ] + ([f"- Settings: {' '.join(f'{k}={v}' for k, v in info['settings'].items())}"]
         if info.get("settings") else [])


# --------------------------------------------------------------------------- result files

def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    item = getattr(obj, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _jsonable(item())
        except Exception:
            pass
    return repr(obj)


def write_json(out_dir: Path, name: str, payload: dict) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(_jsonable(payload), fh, indent=1, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def write_markdown(out_dir: Path, name: str, text: str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return path


def publish(out_dir: Path, name: str, payload: dict, text: str) -> None:
    """Print a run's Markdown and write it with its JSON: <out_dir>/<name>.{md,json}."""
    print(text)
    write_json(out_dir, name, payload)
    write_markdown(out_dir, name, text)


def publish_timed(out_dir: Path, name: str, payload: dict, text: str) -> None:
    """Write a run's JSON and Markdown (<out_dir>/<name>.{json,md}), log both paths with the
    run's time (``payload["elapsed_s"]``), then print the Markdown."""
    jpath = write_json(out_dir, name, payload)
    mpath = write_markdown(out_dir, name, text)
    log(f"wrote {jpath} and {mpath} in {payload['elapsed_s']:.0f} s")
    print(text)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """Render a Markdown table; ``align`` is one character per column from 'l', 'r', 'c'."""
    headers = [str(h) for h in headers]
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join(marks[a] for a in align) + " |"]
    for row in rows:
        lines.append("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- statistics

def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 100]) of already sorted values."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac)


def summarize(values: Iterable[float | None]) -> dict:
    """Median, mean, stdev, min, max, p10, p90 and n of the finite values."""
    vals = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    n = len(vals)
    if n == 0:
        return {"n": 0, "median": None, "mean": None, "stdev": None,
                "min": None, "max": None, "p10": None, "p90": None}
    return {
        "n": n,
        "median": statistics.median(vals),
        "mean": statistics.fmean(vals),
        "stdev": statistics.stdev(vals) if n > 1 else 0.0,
        "min": vals[0],
        "max": vals[-1],
        "p10": percentile(vals, 10),
        "p90": percentile(vals, 90),
    }


def fmt_num(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if abs(value) >= 10000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def fmt_summary(summary: dict | None, digits: int = 2) -> str:
    """'median (min–max)' for several values, 'value' for one, '–' for none."""
    if not summary or not summary.get("n"):
        return "–"
    med = fmt_num(summary["median"], digits)
    if summary["n"] == 1:
        return med
    return f"{med} ({fmt_num(summary['min'], digits)}–{fmt_num(summary['max'], digits)})"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


# --------------------------------------------------------------------------- timers

class CudaTimer:
    """Times GPU work enqueued inside a ``with`` block on the current stream with CUDA events.

    ``elapsed_ms()`` waits for the end event (only that event, not the whole device).
    """

    def __init__(self, torch, stream=None):
        self._torch = torch
        self._stream = stream
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def _record(self, event) -> None:
        if self._stream is None:
            event.record()
        else:
            event.record(self._stream)

    def __enter__(self) -> "CudaTimer":
        self._record(self.start)
        return self

    def __exit__(self, *exc) -> None:
        self._record(self.end)

    def elapsed_ms(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


def wait_event(event, poll_s: float = 20e-6) -> None:
    """Wait for a CUDA event by polling with short sleeps, so the wait itself burns no CPU.

    ``torch.cuda.Event.synchronize`` may spin a core, which would count as host CPU time of
    whatever is being measured.
    """
    while not event.query():
        time.sleep(poll_s)


class HostTimer:
    """Wall-clock (perf_counter) and process CPU time (process_time, all threads) deltas."""

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._w0 = self._c0 = None

    def start(self) -> "HostTimer":
        self._w0 = time.perf_counter()
        self._c0 = time.process_time()
        return self

    def stop(self) -> "HostTimer":
        self.wall_s = time.perf_counter() - self._w0
        self.cpu_s = time.process_time() - self._c0
        return self

    def __enter__(self) -> "HostTimer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def per_step_ms(self, steps: int) -> dict:
        return {"wall_ms": 1e3 * self.wall_s / steps, "cpu_ms": 1e3 * self.cpu_s / steps}


# --------------------------------------------------------------------------- guarded rows

def error_record(exc: BaseException) -> dict:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb)[-4000:]}


def guarded(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, dict | None]:
    """Run ``fn``; return (result, None), or (None, error record) if it raised an Exception."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:
        return None, error_record(exc)


def close_quietly(obj: Any) -> dict | None:
    """Call ``obj.close()`` if it exists; return an error record if that raised."""
    close = getattr(obj, "close", None)
    if close is None:
        return None
    try:
        close()
    except Exception as exc:
        return error_record(exc)
    return None


_last_log = [0.0]
_heartbeat: list[Path | None] = [None]  # touched by log() for the outside watch (_stall_watchdog.py)


def log(message: str) -> None:
    _last_log[0] = time.monotonic()
    if _heartbeat[0] is not None:
        try:
            os.utime(_heartbeat[0])
        except OSError:
            pass
    print(message, file=sys.stderr, flush=True)


def watch_for_stalls(seconds: float, path: Path | None = None, exit_code: int | None = None,
                     grace: float = 90.0) -> None:
    """When nothing is logged for ``seconds``, write what this process is doing, once, to
    ``path`` (or stderr): every thread's Python stack (faulthandler: this process
    only, not its DataLoader workers), the native stacks from ``py-spy dump --native`` when
    py-spy is installed, what each thread is blocked in as the kernel says, and the GPU's
    memory and use from nvidia-smi (a CUDA call from here could block on whatever the stall
    holds) and the kernel log's tail (benchmarks/_stall_watchdog.py's report). A daemon
    thread; the run goes on, or with ``exit_code`` ends there (os._exit: a stalled thread would
    keep an orderly exit waiting), so that a script's later steps still get their time.

    A thread that blocks in C while holding the GIL stops this watch too. So with both ``path``
    and ``exit_code``, a second watch runs outside the process (benchmarks/_stall_watchdog.py):
    ``grace`` seconds after this one should have ended the run, it writes what each thread is
    blocked in to ``path``.outside, has faulthandler write the Python stacks (on SIGUSR2, no GIL
    needed) to ``path``.outside.python, and kills the process."""
    import faulthandler
    import threading
    if seconds <= 0:
        return
    _last_log[0] = time.monotonic()

    def watch() -> None:
        while time.monotonic() - _last_log[0] < seconds:
            time.sleep(min(5.0, seconds / 4))
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w") if path is not None else sys.stderr
        try:
            f.write(f"no progress logged for {seconds:.0f} s; Python stacks:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            sys.path.insert(0, str(BENCH_DIR))
            import _stall_watchdog  # what each thread is blocked in, as the kernel says
            f.write("\n" + _stall_watchdog.threads_report(os.getpid()))
            _stall_watchdog.commands_report(os.getpid(), f)
            f.flush()
        except Exception as e:  # a diagnostic: it must not end the run
            print(f"watch_for_stalls: {e!r}", file=sys.stderr)
        finally:
            if path is not None:
                f.close()
        log(f"stalled: no progress logged for {seconds:.0f} s (stacks in {path or 'stderr'})")
        if exit_code is not None:
            os._exit(exit_code)

    threading.Thread(target=watch, name="stall-watch", daemon=True).start()
    if path is not None and exit_code is not None:
        import signal
        outside = Path(f"{path}.outside")
        outside.parent.mkdir(parents=True, exist_ok=True)
        heartbeat = Path(f"{path}.alive")
        heartbeat.touch()
        _heartbeat[0] = heartbeat
        py_stacks = open(f"{outside}.python", "w")  # kept open: faulthandler writes it from a signal
        faulthandler.register(signal.SIGUSR2, file=py_stacks, all_threads=True)
        subprocess.Popen([sys.executable, str(BENCH_DIR / "_stall_watchdog.py"), str(os.getpid()),
                          str(heartbeat), str(seconds + grace), str(outside)], start_new_session=True)

        def tidy() -> None:  # a run that ends well leaves no watch files behind
            py_stacks.close()
            for leftover in (heartbeat, Path(f"{outside}.python")):
                try:
                    if leftover == heartbeat or leftover.stat().st_size == 0:
                        leftover.unlink()
                except OSError:
                    pass

        import atexit
        atexit.register(tidy)
