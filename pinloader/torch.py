"""pinloader for PyTorch: ``pinloader.torch.prefetch(loader)`` yields CUDA tensors.

Importing this module imports torch; ``import pinloader`` alone never does.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch as _torch
from torch.utils.dlpack import from_dlpack as _torch_from_dlpack

from . import _adapter
from ._adapter import FrameworkPrefetcher
from ._C import backend as _pl_backend

__all__ = ["prefetch", "TorchPrefetcher"]

_warned_pin_memory = False

# torch.from_dlpack of a capsule ends in torch._C._from_dlpack; calling it directly skips the
# Python-level dispatch (the capsules come from pinloader, nothing else).
_from_capsule = getattr(_torch._C, "_from_dlpack", None) or _torch_from_dlpack


def _pinloader_device(device: Any) -> tuple[str, _torch.device]:
    _adapter.refuse_bool_device("pinloader.torch.prefetch", device)
    if device is None:  # pinloader's default: the current GPU if CUDA is usable, else the host
        device = "cuda" if _pl_backend() == "cuda" else "cpu"
    dev = _torch.device(device)
    if dev.type == "cpu":
        return "cpu", dev
    if dev.type != "cuda":
        raise ValueError(f"pinloader.torch.prefetch: device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}")
    if dev.index is None:
        if not _torch.cuda.is_available():
            # Let pinloader say why CUDA is unusable.
            return "cuda", dev
        dev = _torch.device("cuda", _torch.cuda.current_device())
    return f"cuda:{dev.index}", dev


class TorchPrefetcher(FrameworkPrefetcher):
    """Iterate a DataLoader (or any iterable) with batches delivered as torch tensors on a device.

    Each batch is ready on ``torch.cuda.current_stream()`` as it is when the batch is handed out:
    that stream is looked up once per batch and waits on the copy's event (no host
    synchronisation). Tensors stay valid for as
    long as they are referenced; they are freed in stream order after use.

    Parameters
    ----------
    loader : iterable
        A ``torch.utils.data.DataLoader`` (use ``pin_memory=False``) or any iterable of nested
        tuples, lists, dicts, namedtuples or dataclasses of tensors and arrays.
    device : str or torch.device, optional
        Target device. Default (None): torch's current CUDA device when pinloader can use CUDA,
        else "cpu" (pinloader's host backend), as for :class:`pinloader.AsyncPrefetcher`.
    depth : int, default 2
        Batches in flight or waiting.
    **opts
        Passed to :class:`pinloader.AsyncPrefetcher` (``max_pinned_bytes``, ``staging_threads``,
        ``pool``, ``copy_stream_priority``).
    """

    def __init__(self, loader: Iterable[Any], device: Any = None, depth: int = 2, **opts: Any) -> None:
        global _warned_pin_memory
        if getattr(loader, "pin_memory", False) and not _warned_pin_memory:
            _warned_pin_memory = True
            warnings.warn(
                "pinloader.torch.prefetch: the DataLoader has pin_memory=True, so every batch is "
                "pinned twice (once by the DataLoader's pin thread, once by pinloader). Pass "
                "pin_memory=False to the DataLoader.", UserWarning, stacklevel=3)
        pl_device, self.device = _pinloader_device(device)
        self.loader = loader
        self._cuda_index = self.device.index if self.device.type == "cuda" else None
        super().__init__(loader, pl_device, depth, _from_capsule, **opts)

    def _consumer_stream(self) -> Any:
        # Once per batch (see Note [per-batch import] in pinloader/_adapter.py). torch's
        # default stream (handle 0) is the legacy default stream, 1 in DLPack's numbering, as
        # torch.from_dlpack itself passes it.
        if self._cuda_index is None:
            return None
        handle = _torch.cuda.current_stream(self._cuda_index).cuda_stream
        return handle if handle else 1

    def _import_leaves(self, leaves: list[Any]) -> list[Any]:
        capsules = _adapter.export_leaves(leaves, self._consumer_stream())
        convert = self._convert
        return [convert(c) for c in capsules]

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the loader's sampler (a DistributedSampler) when it has set_epoch."""
        for holder in (self.loader, getattr(self.loader, "sampler", None),
                       getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if holder is not None and hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
                return


def prefetch(loader: Iterable[Any], device: Any = None, depth: int = 2, **opts: Any) -> TorchPrefetcher:
    """Wrap ``loader`` so that it yields the same structures with torch tensors on ``device``.

    See :class:`TorchPrefetcher`.
    """
    return TorchPrefetcher(loader, device=device, depth=depth, **opts)
