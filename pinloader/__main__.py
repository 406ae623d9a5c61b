"""``python -m pinloader demo``: the main job, side by side. ``python -m pinloader info``: what was found."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pinloader")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a synthetic training loop: plain loading vs pinloader")
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    demo.add_argument("--warmup", type=int, default=5)
    demo.add_argument("--compute-ms", type=float, default=None,
                      help="compute per step (default: about 3x the pinned copy time on a GPU, 20 ms on the CPU)")
    demo.add_argument("--image-size", type=int, default=224)
    demo.add_argument("--device", default=None, help="'cuda', 'cuda:N' or 'cpu' (default: the GPU if there is one)")
    demo.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    sub.add_parser("info", help="backend, CUDA library and devices found")
    args = parser.parse_args(argv)

    if args.command == "info":
        import pinloader
        info = dict(pinloader.cuda_info(), backend=pinloader.backend(), version=pinloader.__version__)
        print(json.dumps(info, indent=2))
        return 0
    from .demo import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
