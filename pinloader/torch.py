"""pinloader for PyTorch: ``pinloader.torch.prefetch(loader)`` yields CUDA tensors.

Importing this module imports torch; ``import pinloader`` alone never does.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch as _torch
from torch.utils.dlpack import from_dlpack as _torch_from_dlpack

from . import _door, _device
from ._door import Door

__all__ = ["prefetch", "TorchPrefetcher"]

_warned_pin_memory = False
_real_current_stream = _torch.cuda.current_stream

# torch.from_dlpack of a capsule ends in torch._C._from_dlpack; calling it directly skips the
# Python-level dispatch (the capsules come from pinloader, nothing else).
_from_capsule = getattr(_torch._C, "_from_dlpack", None) or _torch_from_dlpack


class TorchPrefetcher(Door):
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
    device : str, int or torch.device, optional
        Target device: "cuda" (torch's current CUDA device), "cuda:N" or N, "cpu" (pinloader's
        host backend), or a ``torch.device``. Default (None): torch's current CUDA device when
        pinloader can use CUDA, else "cpu", as for :class:`pinloader.AsyncPrefetcher`. The
        spellings are every door's (Note [device spellings] in pinloader/_device.py).
    depth : int, default 2
        Batches in flight or waiting. Left out over an :class:`~pinloader.ArrayLoader`, the
        loader's depth applies (its default is 3); an explicit value, 2 included, wins.
    static : bool, default False
        Deliver every batch in the same device tensors, one per leaf, for a step captured in a
        CUDA graph (``torch.cuda.CUDAGraph``, ``torch.compile(mode="reduce-overhead")``): see
        the notes below.
    out : sequence (or dict) of tensors, or one tensor, optional
        The static tensors to deliver into (one tensor: the buffer of a batch's one array
        leaf), one per array leaf of a batch in the order
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
    handed out, pinloader queues on the current stream a wait on that copy and one
    device-to-device copy per leaf into its static tensor. The current stream is the one the
    step runs on, so that copy comes after the step's previous use of the static tensors and
    before its next work, without any host synchronisation. Rules:

    * A static batch is valid until the next one is taken: taking the next batch overwrites the
      tensors (in stream order). Keep a ``.clone()`` of anything needed longer.
    * Use one stream for the steps (as a captured graph does); a step on another stream than
      the one current when the batch was taken must wait for that stream first.
    * The batches keep their structure (the same containers, pass-through leaves as they
      are); their array leaves are the static tensors, the same objects every batch.
    * A batch whose leaf has the static tensor's dtype and trailing dimensions but fewer rows
      (the short last batch of an epoch) fills the first rows; the rest are zero, and
      :attr:`valid_rows` says how many rows of that batch are real (the fewest over its
      leaves with rows: a 0-d leaf, a scalar, has none, and a batch of 0-d leaves only has
      ``valid_rows`` None; the full size for every other batch). Any other difference (dtype, trailing
      dimensions, more rows, another number of array leaves) is a ``ValueError`` naming the
      leaf (its position in that order). Use ``drop_last=True`` on the loader to get only full
      batches.
    * Without ``out=`` the static tensors are pinloader's, laid out from the first batch,
      made before it is handed out (outside any graph capture), and marked static for
      ``torch.compile`` (``torch._dynamo.mark_static_address``) so that it never copies them.
      With ``out=`` they are yours (C-contiguous, on ``device``, no two overlapping in
      memory), delivered as they are. Over an :class:`~pinloader.ArrayLoader` they hold
      ``batch_size`` rows, even when an epoch resumed near its end begins with a short batch.
    """

    def __init__(self, loader: Iterable[Any], device: Any = None, depth: int = _door.DEFAULT_DEPTH, *,
                 static: bool = False, out: Any = None, **opts: Any) -> None:
        global _warned_pin_memory
        if getattr(loader, "pin_memory", False) and not _warned_pin_memory:
            _warned_pin_memory = True
            warnings.warn(
                "pinloader.torch.prefetch: the DataLoader has pin_memory=True, so every batch is "
                "pinned twice (once by the DataLoader's pin thread, once by pinloader). Pass "
                "pin_memory=False to the DataLoader.", UserWarning, stacklevel=3)
        dev = _device.for_torch(device)
        self.device: _torch.device = dev.native
        self.loader = loader
        if isinstance(out, _torch.Tensor):
            # one tensor is one leaf's buffer: list(tensor) would split it into its rows
            out = [out]
        if out is not None:
            out = list(out.values()) if isinstance(out, dict) else list(out)
            for i, t in enumerate(out):
                if not isinstance(t, _torch.Tensor):
                    raise TypeError(f"pinloader.torch.prefetch: out[{i}] must be a torch.Tensor, "
                                    f"not {type(t).__name__}")
                if t.device != self.device:
                    raise ValueError(f"pinloader.torch.prefetch: out[{i}] is on {t.device}, not {self.device}")
        static = bool(static) or out is not None
        convert = _from_capsule_static if static and out is None else _from_capsule
        stream = _stream_of(self.device.index) if self.device.type == "cuda" else None
        handout = dict(output="capsule", stream=stream, convert=convert)
        if static:
            handout.update(static=True, out=out)
        super().__init__(loader, dev.core, depth, handout, **opts)

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the loader's sampler (a DistributedSampler) when it has set_epoch."""
        for holder in (self.loader, getattr(self.loader, "sampler", None),
                       getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if holder is not None and hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
                return


# One stream callable per device (and per torch.cuda.current_stream in use): a door made per
# epoch over one ArrayLoader then asks for the same settings each time, and keeps the loader's
# prefetcher and its static buffers (Note [doors over a loader] in pinloader/_loader_base.py).
_streams: dict[tuple[Any, ...], Any] = {}


def _stream_of(index: int | None) -> Any:
    raw = getattr(_torch._C, "_cuda_getCurrentRawStream", None)
    current = _torch.cuda.current_stream
    use_raw = raw is not None and current is _real_current_stream
    key = (index, use_raw, raw if use_raw else current)
    fn = _streams.get(key)
    if fn is not None:
        return fn
    if raw is not None and use_raw:
        get_raw = raw

        def stream() -> int:
            # Once per batch: torch's current stream handle, without making a Stream object.
            # torch's default stream (handle 0) is the legacy default stream, 1 in DLPack's
            # numbering, as torch.from_dlpack itself passes it.
            return get_raw(index) or 1
    else:  # an older torch, or current_stream replaced (a profiler, a test): ask it

        def stream() -> int:
            return current(index).cuda_stream or 1
    if len(_streams) >= 64:  # replaced current_stream functions come and go (tests, profilers)
        _streams.clear()
    _streams[key] = stream
    return stream


def _from_capsule_static(capsule: Any) -> Any:
    """A static buffer as a tensor (once per buffer), marked for torch.compile: its address
    never changes, so its CUDA graphs need no input copies."""
    t = _from_capsule(capsule)
    mark = getattr(getattr(_torch, "_dynamo", None), "mark_static_address", None)
    if mark is not None:
        try:
            mark(t)
        except Exception:  # an older torch without the feature for this tensor
            pass
    return t


def prefetch(loader: Iterable[Any], device: Any = None, depth: int = _door.DEFAULT_DEPTH, *, static: bool = False,
             out: Any = None, **opts: Any) -> TorchPrefetcher:
    """Wrap ``loader`` so that it yields the same structures with torch tensors on ``device``;
    with ``static=True`` (or ``out=``) always the same tensors, for CUDA graphs.

    See :class:`TorchPrefetcher`.
    """
    return TorchPrefetcher(loader, device=device, depth=depth, static=static, out=out, **opts)
