"""StatefulPrefetcher: an :class:`~pinloader.AsyncPrefetcher` over a source with its own
``state_dict`` / ``load_state_dict`` (torchdata's ``StatefulDataLoader``...), whose state is the
source's as of the last batch handed out (Note [consumer-side position] in
pinloader/_resume.py): each item travels through the pipeline with the source's state taken
right after it was pulled."""
from __future__ import annotations

import inspect
from typing import Any, Iterator

from ._C import AsyncPrefetcher

__all__ = ["StatefulPrefetcher"]


class _Stamp:
    """The source's state right after an item was pulled: a pass-through leaf."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state


_NO_STATE: Any = object()


class _Stamped:
    """Re-iterable over a stateful source: yields ``(item, _Stamp)``; once the source's epoch
    ends, its state at that end is kept in ``end_state`` (not sent as an item: an item without
    arrays would not fit a static batch), for the consumer to take when the prefetcher's
    epoch ends. The producer sets it before it queues the epoch's end, which the consumer sees
    only after every item of the epoch."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._fresh: Any = None
        self.end_state: Any = _NO_STATE

    def __len__(self) -> int:
        return len(self._source)

    def __iter__(self) -> Iterator[Any]:
        # The AsyncPrefetcher calls iter() on its source twice as it starts an epoch (the first
        # to tell a one-shot iterator), but a stateful source's iter() is an epoch (and a
        # DataLoader's starts its workers): a generator not yet started is given again.
        fresh = self._fresh
        if fresh is not None and inspect.getgeneratorstate(fresh) == inspect.GEN_CREATED:
            return fresh  # type: ignore[no-any-return]
        self.end_state = _NO_STATE
        self._fresh = _stamped(self, iter(self._source))
        return self._fresh  # type: ignore[no-any-return]


def _stamped(holder: _Stamped, it: Iterator[Any]) -> Iterator[Any]:
    snap = holder._source.state_dict
    for item in it:
        yield (item, _Stamp(snap()))
    holder.end_state = snap()


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has a state to checkpoint: ``state_dict()`` and ``load_state_dict()``.
    A framework door has both methods whatever it wraps; it says itself whether its source
    has a state (``_pinloader_stateful``), so that a door over a door of a plain iterable is
    iterated as the iterable it is."""
    says = getattr(obj, "_pinloader_stateful", None)
    if says is not None:
        return bool(says)
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class StatefulPrefetcher:
    """An :class:`~pinloader.AsyncPrefetcher` over a source with ``state_dict()`` /
    ``load_state_dict()`` (torchdata's ``StatefulDataLoader``, or any object with the two):
    batches as the AsyncPrefetcher gives them, and a ``state_dict()`` that is the *source's*
    state as of the last batch handed out, not of the batches prefetched since (see Note
    [consumer-side position] in pinloader/_resume.py).

    ``state_dict()`` returns the source's own state object (load it into the source itself, or
    into this prefetcher); after the end of an epoch it is the source's state at that end.
    ``load_state_dict(state)`` discards what was prefetched, passes ``state`` to the source's
    ``load_state_dict`` and starts again from there: the source's next iteration is the one the
    state describes. The framework doors (``pinloader.torch.prefetch``...) use this class for a
    stateful source by themselves. States are not copied: a source whose ``state_dict()``
    returns an object it later mutates must return a copy.

    Parameters
    ----------
    source : iterable with ``state_dict()`` and ``load_state_dict()``
        The stateful source of batches, e.g. torchdata's ``StatefulDataLoader``.
    device : str or int, optional
        As for :class:`~pinloader.AsyncPrefetcher` (None: the current CUDA device, else the
        host backend).
    depth : int, default 2
        Batches in flight or waiting.
    **opts
        Passed to :class:`~pinloader.AsyncPrefetcher` (``pool``, ``max_pinned_bytes``,
        ``staging_threads``, ``static``, ...).

    Notes
    -----
    Cost, besides the source's own ``state_dict()`` per item: the item travels as
    ``(item, state)`` and is unpacked by a Python ``__next__``, a few microseconds per batch
    on top of the prefetcher's own (the extra tuple walked per batch and the thread
    hand-offs; the Python work on the producer's side is a fraction of a microsecond).
    """

    def __init__(self, source: Any, device: Any = None, depth: int = 2, **opts: Any) -> None:
        if not is_stateful(source):
            raise TypeError(f"StatefulPrefetcher: the source ({type(source).__name__}) has no "
                            "state_dict() / load_state_dict()")
        self.source: Any = source
        self._args = (device, depth, opts)
        self._closed = False
        self._load_error: BaseException | None = None
        self._state = self.source.state_dict()  # before the prefetcher pulls anything
        self._pf = self._make()

    def _make(self) -> AsyncPrefetcher:
        device, depth, opts = self._args
        self._stamped = _Stamped(self.source)
        return AsyncPrefetcher(self._stamped, device=device, depth=depth, **opts)

    def _check(self) -> None:
        if self._closed:
            raise ValueError("StatefulPrefetcher is closed")
        if self._load_error is not None:
            e = self._load_error
            raise ValueError(f"StatefulPrefetcher: the source's load_state_dict() failed "
                             f"({type(e).__name__}: {e}), so where the source is is unknown; "
                             "load a state again, or make a new prefetcher") from e

    def __iter__(self) -> "StatefulPrefetcher":
        self._check()
        iter(self._pf)
        return self

    def __next__(self) -> Any:
        self._check()
        try:
            item, stamp = next(self._pf)
        except StopIteration:
            end = self._stamped.end_state
            if end is not _NO_STATE:  # the source's state at the epoch's end
                self._state = end
            raise
        self._state = stamp.state
        return item

    @property
    def valid_rows(self) -> int | None:
        """See :attr:`pinloader.AsyncPrefetcher.valid_rows`."""
        rows: int | None = self._pf.valid_rows
        return rows

    def state_dict(self) -> Any:
        """The source's state as of the last batch handed out."""
        return self._state

    def load_state_dict(self, state: Any) -> None:
        """Discard what was prefetched and give ``state`` to the source. If the source's
        ``load_state_dict`` raises, the error propagates and the prefetcher refuses to iterate
        (saying why) until a state loads; after :meth:`close` it is a ValueError."""
        if self._closed:
            raise ValueError("StatefulPrefetcher is closed")
        self._pf.close()  # the producer is out of the source before the source is changed
        try:
            self.source.load_state_dict(state)
        except BaseException as e:
            self._load_error = e
            raise
        self._load_error = None
        self._state = state
        self._pf = self._make()

    def __len__(self) -> int:
        return len(self._pf)

    def stats(self) -> Any:
        return self._pf.stats()

    def close(self) -> None:
        self._closed = True
        self._pf.close()

    def __enter__(self) -> "StatefulPrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"pinloader.StatefulPrefetcher({self._pf!r})"
