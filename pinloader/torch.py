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
    static : bool, default False
        Deliver every batch in the same device tensors, one per leaf, for a step captured in a
        CUDA graph (``torch.cuda.CUDAGraph``, ``torch.compile(mode="reduce-overhead")``): see
        the notes below.
    out : sequence (or dict) of tensors, optional
        The static tensors to deliver into, one per array leaf of a batch in the order
        pinloader walks it (dict insertion order, sequence order, depth first; a dict's values
        are taken in order), on ``device``; implies ``static=True``. Default: made from the
        first batch.
    **opts
        Passed to :class:`pinloader.AsyncPrefetcher` (``max_pinned_bytes``, ``staging_threads``,
        ``pool``, ``copy_stream_priority``).

    Notes
    -----
    **Static batches.** With ``static=True`` (or ``out=``) the copy from host memory still
    runs on pinloader's copy stream, overlapping the previous step as usual; when the batch is
    handed out, one
    device-to-device copy per leaf into the static tensor is queued on the current stream,
    behind the stream's wait on the batch's copy. The current stream is the one the step runs
    on, so that copy comes after the step's previous use of the static tensors and before its
    next work, without any host synchronisation. Rules:

    * A static batch is valid until the next one is taken: taking the next batch overwrites the
      tensors (in stream order). Keep a ``.clone()`` of anything needed longer.
    * Use one stream for the steps (as a captured graph does); a step on another stream than
      the one current when the batch was taken must wait for that stream first.
    * The batches keep their structure (the same containers, pass-through leaves as they
      are); their array leaves are the static tensors.
    * A batch whose leaf has the static tensor's dtype and trailing dimensions but fewer rows
      (the short last batch of an epoch) fills the first rows; the rest are zero, and
      :attr:`valid_rows` says how many rows of that batch are real (it is the full size for
      every other batch). Any other difference (dtype, trailing dimensions, more rows, another
      number of array leaves) is a ``ValueError`` naming the leaf (its position in that
      order). Use ``drop_last=True`` on the loader to get only full batches.
    * The static tensors are made from the first batch (``torch.empty_like``) before it is
      handed out, outside any graph capture, and marked static for ``torch.compile``
      (``torch._dynamo.mark_static_address``) so that it never copies them.
    """

    def __init__(self, loader: Iterable[Any], device: Any = None, depth: int = 2, *,
                 static: bool = False, out: Any = None, **opts: Any) -> None:
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
        self._static = bool(static) or out is not None
        self._static_leaves: list[Any] | None = None
        self.valid_rows: int | None = None
        if out is not None:
            out = list(out.values()) if isinstance(out, dict) else list(out)
            for i, t in enumerate(out):
                if not isinstance(t, _torch.Tensor):
                    raise TypeError(f"pinloader.torch.prefetch: out[{i}] must be a torch.Tensor, "
                                    f"not {type(t).__name__}")
                if t.device != self.device:
                    raise ValueError(f"pinloader.torch.prefetch: out[{i}] is on {t.device}, not {self.device}")
            self._static_leaves = out
        super().__init__(loader, pl_device, depth, _from_capsule, **opts)

    def _consumer_stream(self) -> Any:
        # Once per batch (see Note [per-batch import] in pinloader/_adapter.py). torch's
        # default stream (handle 0) is the legacy default stream, 1 in DLPack's numbering, as
        # torch.from_dlpack itself passes it.
        if self._cuda_index is None:
            return None
        handle = _torch.cuda.current_stream(self._cuda_index).cuda_stream
        return handle if handle else 1

    # ---- static batches (see the class documentation) ----

    def _import_leaves(self, leaves: list[Any]) -> list[Any]:
        capsules = _adapter.export_leaves(leaves, self._consumer_stream())
        convert = self._convert
        tensors = [convert(c) for c in capsules]
        return self._to_static(tensors) if self._static else tensors

    def _to_static(self, tensors: list[Any]) -> list[Any]:
        statics = self._static_leaves
        if statics is None:
            statics = []
            for t in tensors:
                buf = _torch.empty_like(t)
                _mark_static(buf)
                statics.append(buf)
            self._static_leaves = statics
        if len(tensors) != len(statics):
            raise ValueError(f"pinloader.torch.prefetch(static=True): the batch has {len(tensors)} "
                             f"array leaves, the static batch {len(statics)}")
        valid = min((_fill_static(i, buf, t) for i, (t, buf) in enumerate(zip(tensors, statics))),
                    default=None)
        self.valid_rows = valid
        return list(statics)

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the loader's sampler (a DistributedSampler) when it has set_epoch."""
        for holder in (self.loader, getattr(self.loader, "sampler", None),
                       getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if holder is not None and hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
                return


def _mark_static(t: Any) -> None:
    """Tell torch.compile that t's address never changes (no input copies in its CUDA graphs)."""
    mark = getattr(getattr(_torch, "_dynamo", None), "mark_static_address", None)
    if mark is not None:
        try:
            mark(t)
        except Exception:  # an older torch without the feature for this tensor
            pass


def _fill_static(i: int, buf: Any, t: Any) -> int:
    """Queue the copy of batch leaf t into static tensor buf on the current stream; the number
    of valid rows."""
    if t.dtype != buf.dtype or t.dim() != buf.dim() or (t.dim() and t.shape[1:] != buf.shape[1:]):
        raise ValueError(f"pinloader.torch.prefetch(static=True): leaf {i} is {tuple(t.shape)} "
                         f"{t.dtype}, the static tensor {tuple(buf.shape)} {buf.dtype}")
    if t.dim() == 0 or t.shape[0] == buf.shape[0]:
        buf.copy_(t, non_blocking=True)
        return int(buf.shape[0]) if buf.dim() else 1
    n = int(t.shape[0])
    if n > buf.shape[0]:
        raise ValueError(f"pinloader.torch.prefetch(static=True): leaf {i} has {n} rows, more than "
                         f"the static tensor's {buf.shape[0]}")
    buf[:n].copy_(t, non_blocking=True)
    buf[n:].zero_()
    return n


def prefetch(loader: Iterable[Any], device: Any = None, depth: int = 2, *, static: bool = False,
             out: Any = None, **opts: Any) -> TorchPrefetcher:
    """Wrap ``loader`` so that it yields the same structures with torch tensors on ``device``;
    with ``static=True`` (or ``out=``) always the same tensors, for CUDA graphs.

    See :class:`TorchPrefetcher`.
    """
    return TorchPrefetcher(loader, device=device, depth=depth, static=static, out=out, **opts)
