#!/usr/bin/env python3
"""A training step captured in a CUDA graph, fed three ways, against the same step eager.

Workload: torchvision ResNet-18 (random init), bf16 autocast, channels_last, SGD with momentum,
batch 256 of 3x112x112 uint8 images in RAM (normalised on the GPU inside the step), labels
int64. Rows, each built once and warmed up, then timed over --rounds interleaved rounds of
--steps steps (each round runs every row in turn):
  eager            pinloader.torch.prefetch(ArrayLoader): tensors handed out, step run eagerly
  graph_static     prefetch(ArrayLoader, static=True): every batch in the same tensors; the
                   whole step (normalise, forward, backward, optimizer) captured once in a
                   torch.cuda.CUDAGraph and replayed per batch: no copy or sync by the user
  graph_user_copy  prefetch(ArrayLoader) as usual, and the user's own copy of each batch into
                   static tensors (static.copy_(x, non_blocking=True)) before each replay
  graph_on_gpu     the data set already on the GPU, each batch gathered into the static
                   tensors by index_select on the GPU, then the replay (the bound)
Reports images/s per row (median and range over rounds) and each row's ratio to graph_on_gpu
in the same round.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROWS = ["eager", "graph_static", "graph_user_copy", "graph_on_gpu"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_output_args(ap, "static")
    ap.add_argument("--images", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch = C.require_cuda(args.device)
    try:
        import torchvision
    except ImportError as e:
        C.fail(f"this benchmark needs torchvision ({e})")
    import pinloader
    import pinloader.torch as pt

    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (args.images, 3, 112, 112), dtype=np.uint8)
    labels = rng.integers(0, 1000, args.images).astype(np.int64)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255
    model = torchvision.models.resnet18().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x, y):
        xf = ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(xf), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    def loader(static=False):
        L = pinloader.ArrayLoader((images, labels), args.batch, device=args.device, drop_last=True, seed=1)
        return L, pt.prefetch(L, static=static)

    def endless(batches):
        while True:
            it = iter(batches)
            while True:
                try:
                    yield next(it)
                except StopIteration:
                    break

    # static tensors and the captured step
    sx = torch.zeros((args.batch, 3, 112, 112), dtype=torch.uint8, device=dev)
    sy = torch.zeros(args.batch, dtype=torch.int64, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):  # warm-up: cudnn autotuning, optimizer state
            step(sx, sy)
    torch.cuda.current_stream().wait_stream(side)

    def capture(x, y):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(x, y)
        return g

    L_eager, B_eager = loader()
    L_static, B_static = loader(static=True)
    it_static = endless(B_static)
    first = next(it_static)
    g_static = capture(first[0], first[1])  # the static tensors the loader delivers into
    L_copy, B_copy = loader()
    it_copy = endless(B_copy)
    g_user = capture(sx, sy)
    gpu_images = torch.from_numpy(images).to(dev)
    gpu_labels = torch.from_numpy(labels).to(dev)
    gx = torch.zeros_like(sx)
    gy = torch.zeros_like(sy)
    g_gpu = capture(gx, gy)
    gen = torch.Generator(device=dev).manual_seed(0)
    it_eager = endless(B_eager)

    def run(row, n):
        if row == "eager":
            for _ in range(n):
                x, y = next(it_eager)
                step(x, y)
        elif row == "graph_static":
            for _ in range(n):
                next(it_static)
                g_static.replay()
        elif row == "graph_user_copy":
            for _ in range(n):
                x, y = next(it_copy)
                sx.copy_(x, non_blocking=True)
                sy.copy_(y, non_blocking=True)
                g_user.replay()
        else:
            for _ in range(n):
                idx = torch.randint(0, args.images, (args.batch,), device=dev, generator=gen)
                torch.index_select(gpu_images, 0, idx, out=gx)
                torch.index_select(gpu_labels, 0, idx, out=gy)
                g_gpu.replay()

    for row in ROWS:  # warm each row
        run(row, 5)
    torch.cuda.synchronize()
    per: dict[str, list] = {r: [] for r in ROWS}
    for rnd in range(args.rounds):
        for row in ROWS:
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            run(row, args.steps)
            torch.cuda.synchronize()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            per[row].append({"images_per_s": args.steps * args.batch / dt,
                             "cpu_ms_per_step": cpu / args.steps * 1e3, "round": rnd})
            C.log(f"round {rnd} {row:16s} {per[row][-1]['images_per_s']:9.0f} img/s")
    for L in (L_eager, L_static, L_copy):
        L.close()

    results = {"machine": C.machine_info(torch, args.device), "args": vars(args), "rows": per}
    lines = C.machine_summary_lines(results["machine"]) + [
        "", f"ResNet-18, bf16 autocast, channels_last, SGD momentum, batch {args.batch} of 3x112x112 uint8 "
        f"images, {args.rounds} interleaved rounds of {args.steps} steps per row.", ""]
    table = []
    for row in ROWS:
        rat = [r["images_per_s"] / b["images_per_s"] for r, b in zip(per[row], per["graph_on_gpu"])]
        table.append([f"`{row}`", C.fmt_summary(C.summarize(r["images_per_s"] for r in per[row]), 0),
                      C.fmt_summary(C.summarize(rat), 3),
                      C.fmt_summary(C.summarize(r["cpu_ms_per_step"] for r in per[row]), 2)])
    lines.append(C.md_table(["row", "images/s", "ratio to graph_on_gpu (same round)", "host CPU ms/step"], table))
    text = "\n".join(lines)
    C.publish(args.out, args.name, results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
