#!/usr/bin/env python3
"""Where a training step's GPU time goes when ImageLoader feeds it: every kernel on every stream
(the model's, pinloader's image kernels, nvJPEG's), under torch.profiler (CUPTI sees kernels
launched by any library in the process), beside the same model on pre-made batches.

Fed by ImageLoader, a model trains slower than on pre-decoded crops already on the GPU by a
similar GPU time per batch for ResNet-18 and ResNet-50 (benchmarks/results/h100_2026-12-05d),
and the interpreter's switch interval makes no difference, so the GIL is not what costs it.
This says which GPU work does: the loader's own kernels, or the model's kernels when they run
beside the loader's.

Rows (one process, after --warmup steps each, --steps profiled steps each):

  decoder_alone   _C.JpegDecoder.decode over the packed bytes with ImageLoader's crops, no model:
                  the decoder's kernels per batch, on an otherwise idle GPU
  bound           --model trained on four pre-made batches already on the GPU
  imageloader     --model fed by ImageLoader (packed file, train=True, 224 px bf16, NHWC) through
                  pinloader.torch.prefetch, as bench_images.py's model rows

For each row: the wall time per step timed without the profiler (median of --rounds runs of
--steps steps), and under the profiler the GPU time per step of each group of kernels:
pinloader (pl_*), nvJPEG (a name with "jpeg", any case), copies (memcpy/memset), and the model
(every other kernel); then the kernels that took the most. A group's time is the sum of its
kernels' durations, so groups on different streams may overlap in wall time.

  python benchmarks/prof_images.py --model resnet18 --data-dir /tmp/pinloader_images

--smoke runs tiny sizes on the CPU (no kernels to see; tests/test_bench_prof_images.py runs it).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import bench_images as BI  # noqa: E402

GROUPS = ("pinloader", "nvjpeg", "copies", "model")


def group_of(name: str) -> str:
    low = name.lower()
    if name.startswith("pl_"):
        return "pinloader"
    if "jpeg" in low:
        return "nvjpeg"
    if "memcpy" in low or "memset" in low:
        return "copies"
    return "model"


def kernel_times(prof: Any) -> list[tuple[str, int, float]]:
    """(name, count, total device µs) of every GPU activity the profiler saw."""
    from torch.autograd import DeviceType
    out = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            out.append((e.key, int(e.count), float(t)))
    return sorted(out, key=lambda r: -r[2])


def profile_row(step: Callable[[], None], args: Any, torch: Any, cuda: bool) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(args.warmup):
        step()
    walls = []
    for _ in range(args.rounds):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        walls.append(1000 * (time.perf_counter() - t0) / args.steps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    kernels = kernel_times(prof)
    groups = {g: 0.0 for g in GROUPS}
    for name, _, t in kernels:
        groups[group_of(name)] += t / 1000 / args.steps
    return {"wall_ms": C.summarize(walls), "gpu_ms_per_step": groups,
            "top": [{"name": n, "count": c, "ms_per_step": t / 1000 / args.steps, "group": group_of(n)}
                    for n, c, t in kernels[:args.top]]}


def decoder_step(ds: dict, args: Any) -> tuple[Callable[[], None], Any]:
    """One batch of the GPU decoder alone with ImageLoader's crops, in the order of epoch 0;
    and the decoder (to close)."""
    pd = BI.PackedDecode(ds["packed"], args.device, args.dtype)
    order = np.random.default_rng(0).permutation(len(pd.offsets))
    per_epoch = max(1, len(order) // args.batch)
    k = [0]

    def step() -> None:
        b = k[0] % per_epoch
        k[0] += 1
        arr = pd.batch(order[b * args.batch:(b + 1) * args.batch], 0)
        del arr
    return step, pd.dec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18", choices=sorted(BI.MODELS))
    ap.add_argument("--images", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed run and under the profiler")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="timed runs (without the profiler) per row")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per row")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "uint8"])
    ap.add_argument("--data-dir", type=Path, default=None, help="the datasets of bench_images.py, made if missing")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    C.add_output_args(ap, "prof_images")
    args = ap.parse_args(argv)
    if args.smoke:
        C.smoke_out(args)
        args.device, args.model, args.images, args.batch = "cpu", "tiny", 48, 8
        args.steps, args.warmup, args.rounds, args.dtype = 2, 1, 1, "float32"
        import torch
    else:
        torch = C.require_cuda(args.device)
    cuda = torch.device(args.device).type == "cuda"
    size_class = BI.MODELS[args.model]
    info = C.machine_info(torch if cuda else None, args.device)
    with BI.data_root(args.data_dir, "pl-prof-images-") as root:
        ds = BI.dataset(root, size_class, args.images, args.smoke)
        rows: dict[str, Any] = {}
        if cuda:
            dstep, dec = decoder_step(ds, args)
            try:
                rows["decoder_alone"] = profile_row(dstep, args, torch, cuda)
            finally:
                dec.close()
        rows.update(model_rows(ds, args, torch, cuda))
        payload = {"args": vars(args), "machine": info, "rows": rows}
        C.publish(args.out, args.name, payload, render(rows, info, args))
    return 0


def model_rows(ds: dict, args: Any, torch: Any, cuda: bool) -> dict[str, Any]:
    import pinloader
    import pinloader.torch as pt
    dev = torch.device(args.device)
    model = BI._model(args.model, torch, args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train(x: Any, y: Any) -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    bx = torch.randn(args.batch * 4, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    by = torch.randint(0, BI.CLASSES, (args.batch * 4,), device=dev)
    k = [0]

    def bound_step() -> None:
        i = k[0] % 4
        k[0] += 1
        train(bx[i * args.batch:(i + 1) * args.batch], by[i * args.batch:(i + 1) * args.batch])

    loader = pinloader.ImageLoader(ds["packed"], args.batch, size=224, dtype=args.dtype, layout="NHWC",
                                   device=args.device, drop_last=True)
    door = pt.prefetch(loader, device=args.device)

    gen = BI.training_batches(loader, door)

    def loader_step() -> None:
        train(*next(gen))

    out: dict[str, Any] = {}
    try:
        out["bound"] = profile_row(bound_step, args, torch, cuda)
        out["imageloader"] = profile_row(loader_step, args, torch, cuda)
    finally:
        gen.close()
        loader.close()
    return out


def render(rows: dict[str, Any], info: dict, args: Any) -> str:
    lines = ["# Where a training step's GPU time goes (prof_images.py)", ""]
    lines += C.machine_summary_lines(info)
    lines += ["", f"{args.model}, batch {args.batch}, {args.steps} steps per row (median wall time over "
              f"{args.rounds} runs without the profiler, then one run under it)", ""]
    table = []
    for name, r in rows.items():
        g = r["gpu_ms_per_step"]
        table.append([name, C.fmt_summary(r["wall_ms"], 2)] + [f"{g[k]:.2f}" for k in GROUPS])
    lines.append(C.md_table(["row", "wall ms/step"] + [f"GPU ms/step: {k}" for k in GROUPS], table,
                            "l" + "r" * (1 + len(GROUPS))))
    for name, r in rows.items():
        lines += ["", f"## {name}: the kernels that took the most", ""]
        lines.append(C.md_table(["kernel", "group", "launches/step", "GPU ms/step"],
                                [[t["name"][:90], t["group"], f"{t['count'] / args.steps:.1f}",
                                  f"{t['ms_per_step']:.3f}"] for t in r["top"]], "llrr"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
