"""Data-parallel training fed by pinloader.ArrayLoader.

Run with one process per GPU:

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py

Each process trains a small MLP on its shard of a synthetic regression data set held as NumPy
arrays; the ArrayLoader gives each rank a disjoint shard of every epoch (the rank and world
size come from the initialised process group) and delivers the batches on the process's GPU
(``cuda:LOCAL_RANK``), gathered by native threads straight into pinned memory. Without a GPU
it runs on the CPU with the gloo backend and pinloader's host backend.

``--plain`` trains the same way with plain NumPy indexing in the same index order
(``loader.indices(epoch)``): the printed losses are identical, bit for bit.

Checkpoint and resume: ``--checkpoint PATH`` saves the model, the optimizer and the loader's
state (``loader.state_dict()``: the epoch and the items handed out, not those prefetched) after
every step, ``--stop-after N`` stops after N steps, and ``--resume PATH`` continues from the
checkpoint, mid-epoch: the losses printed are those the uninterrupted run prints from there on.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import pinloader
import pinloader.torch


def make_data(rows: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    w = rng.standard_normal((features, 1), dtype=np.float32)
    y = np.tanh(x @ w) + 0.1 * rng.standard_normal((rows, 1), dtype=np.float32)
    return x, y.astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4099)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain", action="store_true", help="plain indexing in the same index order")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU exists")
    ap.add_argument("--checkpoint", help="save a checkpoint to this file after every step")
    ap.add_argument("--stop-after", type=int, help="stop after this many steps")
    ap.add_argument("--resume", help="continue from this checkpoint")
    args = ap.parse_args()

    use_cuda = torch.cuda.is_available() and not args.cpu
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    x, y = make_data(args.rows, args.features)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    # rank and world size come from the process group
    loader = pinloader.ArrayLoader((x, y), args.batch_size, seed=args.seed)
    batches = pinloader.torch.prefetch(loader, device=device)

    start_epoch, start_step, resume_position = 0, 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        # rank 0's loader state resumes every rank: the position is global (DDP's lockstep)
        loader.load_state_dict(ckpt["loader"])
        start_epoch, resume_position = ckpt["loader"]["epoch"], ckpt["loader"]["position"]
        start_step = ckpt["step"] + 1 if start_epoch == ckpt["epoch"] else 0
    steps = 0

    def plain_batches(epoch: int):
        # a resumed epoch's items: loader.indices_after(epoch, position); else indices(epoch)
        position = resume_position if epoch == start_epoch else 0
        order = loader.indices_after(epoch, position)
        for lo in range(0, len(order), args.batch_size):
            rows = order[lo:lo + args.batch_size]
            yield (torch.from_numpy(x[rows]).to(device, non_blocking=True),
                   torch.from_numpy(y[rows]).to(device, non_blocking=True))

    for epoch in range(start_epoch, args.epochs):
        batches.set_epoch(epoch)
        it = plain_batches(epoch) if args.plain else batches
        first = start_step if epoch == start_epoch else 0
        for step, (xb, yb) in enumerate(it, first):
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            # every rank's loss, printed by rank 0 (one writer: lines never interleave)
            losses = [torch.empty_like(loss) for _ in range(world)]
            dist.all_gather(losses, loss.detach())
            if rank == 0:
                shown = " ".join(repr(v.item()) for v in losses)
                print(f"epoch {epoch} step {step} losses {shown}", flush=True)
            steps += 1
            if args.checkpoint and rank == 0:
                # the loader's state as of this step's batch, whatever is prefetched
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "loader": batches.state_dict(), "epoch": epoch, "step": step},
                           args.checkpoint)
            if args.stop_after is not None and steps == args.stop_after:
                break
        if args.stop_after is not None and steps == args.stop_after:
            break
    # A deterministic shutdown: the prefetcher first, then every rank meets the others (no rank
    # tears its gloo pairs down while another still talks to it), then the process group, then
    # the process ends without the interpreter's teardown, where torch's gloo backend can abort
    # ("terminate called without an active exception") when its threads' C++ objects are
    # destroyed at exit.
    batches.close()
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
