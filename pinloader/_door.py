"""The iterator shared by the framework doors (torch, JAX, CuPy).

Note [per-batch import]
A framework door is an :class:`AsyncPrefetcher` told how to deliver each array leaf (see Note
[handout] in src/py/handout.h): the producer walks each item once, and when the batch is handed
out the native module exports its leaves and applies the framework's import to each, building
the structure once, in C:

- torch and CuPy: ``output="capsule"`` with ``stream=`` a callable returning the framework's
  current stream (called once per batch): every leaf is exported for that stream in one pass
  (the stream waits on the batch's copy once, and each capsule records the stream for the
  stream-ordered free), then ``convert`` imports each capsule. On the host backend the stream
  is None.
- JAX: ``output="array"`` and ``convert`` calls ``jax.dlpack.from_dlpack(leaf)``, which
  passes JAX's own stream to that leaf's ``__dlpack__`` (JAX takes only legacy capsules and
  names its stream itself): one export, and one stream lookup, per leaf.

A framework import of a DeviceArray itself (``torch.from_dlpack(leaf)``) looks the current
stream up again for every leaf: that is what the one-pass export saves.
"""
from __future__ import annotations

from typing import Any, Iterable

from . import _stateful
from ._C import AsyncPrefetcher
from ._stats import PrefetcherStats


class _DoorDepth(int):
    """The type of DEFAULT_DEPTH (an int equal to 2)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "2"


# The doors' default depth. An adopting loader (ArrayLoader._pinloader_prefetcher) tells it
# apart from an explicit depth=2 by identity: a door given no depth leaves the loader's own
# depth (or the loader's default) in force, while an explicit depth, 2 included, wins.
DEFAULT_DEPTH: int = _DoorDepth(2)


class Door:
    """Wraps an :class:`AsyncPrefetcher` (or an ArrayLoader's, or a
    :class:`~pinloader.StatefulPrefetcher`) that delivers framework arrays: ``handout`` holds
    the prefetcher's ``output``, ``stream``, ``convert``, ``static`` and ``out`` (see Note
    [per-batch import])."""

    def __init__(self, iterable: Iterable[Any], device: Any, depth: int,
                 handout: dict[str, Any], **opts: Any) -> None:
        clash = sorted(set(handout) & set(opts))
        if clash:
            raise TypeError(f"{type(self).__name__}: {', '.join(clash)} is set by the framework "
                            "door itself")
        opts.update(handout)
        adopt = getattr(iterable, "_pinloader_prefetcher", None)
        if adopt is not None:
            # An ArrayLoader already is a prefetcher: use it rather than stack a second one.
            self._pf = adopt(device, depth, **opts)
        elif _stateful.is_stateful(iterable):
            # Each item travels with the source's state (Note [consumer-side position] in
            # pinloader/_resume.py), so state_dict() is as of the last batch handed out.
            self._pf = _stateful.StatefulPrefetcher(iterable, device=device, depth=depth, **opts)
        else:
            self._pf = AsyncPrefetcher(iterable, device=device, depth=depth, **opts)

    @property
    def _pinloader_stateful(self) -> bool:
        """Whether this door has a state to checkpoint (an ArrayLoader's, a stateful source's):
        a door over a door of a plain iterable has none (see _stateful.is_stateful)."""
        return callable(getattr(self._pf, "state_dict", None))

    def __iter__(self) -> "Door":
        iter(self._pf)
        return self

    def __next__(self) -> Any:
        return next(self._pf)

    @property
    def valid_rows(self) -> int | None:
        """The real rows of the last batch handed out when batches are static
        (``static=True``; see the door's notes on static batches), else None."""
        rows: int | None = getattr(self._pf, "valid_rows", None)
        return rows

    def __len__(self) -> int:
        return len(self._pf)

    def state_dict(self) -> Any:
        """The state as of the last batch handed out (torch's ``Stateful`` protocol): an
        ArrayLoader's :meth:`~pinloader.ArrayLoader.state_dict`, or a stateful source's own
        state (a torchdata ``StatefulDataLoader``...; see
        :class:`pinloader.StatefulPrefetcher`)."""
        fn = getattr(self._pf, "state_dict", None)
        if fn is None:
            raise TypeError(f"{type(self).__name__}.state_dict: the source has no state_dict(); "
                            "iterate an ArrayLoader or a source with state_dict() / "
                            "load_state_dict() (torchdata's StatefulDataLoader...) to checkpoint it")
        return fn()

    def load_state_dict(self, state: Any, **kwargs: Any) -> None:
        """Continue from ``state`` (from :meth:`state_dict`); what was prefetched is discarded.
        Keyword arguments go to the ArrayLoader's ``load_state_dict`` (``allow_changed``)."""
        fn = getattr(self._pf, "load_state_dict", None)
        if fn is None:
            raise TypeError(f"{type(self).__name__}.load_state_dict: the source has no "
                            "load_state_dict()")
        fn(state, **kwargs)

    def stats(self) -> PrefetcherStats:
        """See :meth:`pinloader.AsyncPrefetcher.stats`."""
        st: PrefetcherStats = self._pf.stats()
        return st

    def close(self) -> None:
        """Stop the producer and free what is not handed out. Idempotent."""
        self._pf.close()

    def __enter__(self) -> "Door":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self._pf!r})"
