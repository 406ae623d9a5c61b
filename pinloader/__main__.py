"""``python -m pinloader``: ``demo`` runs the main job side by side, ``info`` says what was found,
``--version`` prints the version."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ._version import __version__


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it (or it is a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or isinstance(action, argparse._StoreTrueAction):
            return text
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pinloader",
        description="pinloader: pinned-memory prefetching of Python batches to the GPU.")
    parser.add_argument("--version", action="version", version=f"pinloader {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,info,pack}")
    fmt = _Formatter
    demo = sub.add_parser(
        "demo", formatter_class=fmt,
        help="a synthetic training loop fed by plain loading and by pinloader, side by side",
        description="Feed the same synthetic training step from the same batches in ordinary "
                    "(pageable) host memory, once with plain loading and once with pinloader, "
                    "and print samples/s, data wait per step and, on a GPU, the GPU's idle time "
                    "(on the CPU: each step's compute time, which copying threads slow down). "
                    "Uses torch when it is installed, NumPy otherwise.")
    demo.add_argument("--batch-size", type=int, default=64, help="samples per batch")
    demo.add_argument("--image-size", type=int, default=224,
                      help="each sample is a 3 x SIZE x SIZE float32 image and an int64 label")
    demo.add_argument("--steps", type=int, default=40, help="timed steps per loading method")
    demo.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed run")
    demo.add_argument("--compute-ms", type=float, default=None,
                      help="compute per step in ms (default: 3x the pinned copy time on a GPU, "
                           "20 ms on the CPU)")
    demo.add_argument("--device", default=None,
                      help="'cuda', 'cuda:N' or 'cpu' (default: the current GPU if CUDA is "
                           "usable, else 'cpu')")
    demo.add_argument("--staging-threads", type=int, default=None,
                      help="pinloader's staging threads (default: the cores left over by the "
                           "compute, at least 1)")
    demo.add_argument("--json", action="store_true",
                      help="print one JSON document instead of the table (no progress output)")
    info = sub.add_parser("info", formatter_class=fmt,
                          help="what pinloader found: version, backend, CUDA library, driver, devices",
                          description="Say which backend pinloader will use and why.")
    info.add_argument("--json", action="store_true", help="print one JSON document")
    from ._image_pack import add_parser as add_pack

    add_pack(sub, fmt)
    return parser


def _version_str(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


def info_dict() -> dict[str, Any]:
    import pinloader
    from . import _C

    return dict(pinloader.cuda_info(), backend=pinloader.backend(), version=pinloader.__version__,
                nvtx=bool(_C.NVTX))


CUDA_EXTRA_HINT = ('no CUDA runtime library (libcudart) was found: on a GPU host with only the '
                   'NVIDIA driver (no toolkit, no torch/CuPy/JAX), pip install "pinloader[cuda]" '
                   'brings it (the nvidia-cuda-runtime wheel, CUDA 13, driver 580 or newer; '
                   '"pinloader[cuda12]" for CUDA 12, driver 525 or newer), or set '
                   'PINLOADER_CUDART=/path/to/libcudart.so')


def _print_info(info: dict[str, Any]) -> None:
    print(f"pinloader {info['version']}")
    if info["backend"] == "cuda":
        print(f"  backend:   cuda ({info['device_count']} device(s) visible)")
    else:
        print("  backend:   host (no usable CUDA device: device=None and 'cpu' run on the host "
              "backend)")
    print(f"  libcudart: {info['library'] or 'not found'}")
    if info["runtime_version"]:
        print(f"  runtime:   CUDA {_version_str(info['runtime_version'])}")
    else:
        print("  runtime:   no CUDA runtime loaded")
    if info["driver_version"]:
        print(f"  driver:    supports CUDA {_version_str(info['driver_version'])}")
    elif info["library"]:
        print("  driver:    no CUDA driver found (libcuda.so.1 could not be loaded)")
    else:
        print("  driver:    not checked (no CUDA runtime to ask)")
    if info["error"]:
        print(f"  why not:   {info['error']}")
    if not info["library"]:
        print(f"  hint:      {CUDA_EXTRA_HINT}")
    print(f"  NVTX:      {'ranges pinloader.stage and pinloader.copy' if info['nvtx'] else 'off (built without nvtx3 headers)'}")


# The exit status when the reader of stdout goes away (``| head``): what a shell reports for a
# program that SIGPIPE ends (128 + 13), as for other Unix tools.
EXIT_BROKEN_PIPE = 141


def _run(args: argparse.Namespace) -> int:
    if args.command == "info":
        info = info_dict()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_info(info)
        return 0
    if args.command == "pack":
        from ._image_pack import run as run_pack

        return run_pack(args)
    from .demo import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        status = _run(args)
        # what is still buffered is written here, inside the try, so that a closed pipe
        # surfaces now and not at interpreter exit
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The reader closed the pipe (``python -m pinloader info | head -1``): stop quietly.
        # stdout now points at /dev/null so that the interpreter's own flush at exit cannot
        # raise again (the recipe of the Python documentation's signal module notes).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
