"""What ArrayLoader and ImageLoader share: beginning an epoch, handing out a batch, and the
framework doors over a loader (Note [doors over a loader])."""
from __future__ import annotations

import difflib
import os
import sys
from abc import ABC, abstractmethod
from typing import Any, TypeVar

import numpy as np

from . import _device, _resume
from ._door import DEFAULT_DEPTH as _DOOR_DEFAULT_DEPTH
from ._C import AsyncPrefetcher
from ._epoch_plan import Plan, prepare_alongside, prepare_order
from ._iter_state import IterState

Settings = tuple[Any, int, dict[str, Any]]
_L = TypeVar("_L", bound="EpochLoader")


# An epoch number must fit the int64 of a state and the uint64 the permutation is keyed by,
# without wrapping (epoch 2**64 would repeat epoch 0).
_EPOCH_LIMIT = 1 << 63


def epoch_arg(who: str, epoch: Any) -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
        raise TypeError(f"{who}: epoch must be an int, not {type(epoch).__name__}")
    if not 0 <= epoch < _EPOCH_LIMIT:
        raise ValueError(f"{who}: epoch must be in [0, 2**63), got {epoch}")
    return int(epoch)


# AsyncPrefetcher options that only change how a batch is handed out (Note [handout] in
# src/py/handout.h), not what is read or copied.
HANDOUT_OPTS = frozenset({"output", "stream", "convert", "static", "out"})
# The AsyncPrefetcher keywords a loader passes on (its **prefetch_opts).
PREFETCH_OPTS = frozenset({"pool", "max_pinned_bytes", "staging_threads", "copy_stream_priority"}) | HANDOUT_OPTS


def int_arg(who: str, name: str, value: Any, lo: int) -> int:
    """A loader's integer argument: an int (not a bool) in [lo, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{who}: {name} must be an int, not {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{who}: {name} must be >= {lo}, got {value}")
    if value >= 1 << 63:
        raise ValueError(f"{who}: {name} must be < 2**63, got {value}")
    return int(value)


def prefetch_opts_arg(who: str, opts: dict[str, Any], keywords: tuple[str, ...]) -> dict[str, Any]:
    """The loader's **prefetch_opts, checked when the loader is made (not at its first
    iteration): an unknown keyword is a TypeError naming the nearest known one."""
    unknown = sorted(set(opts) - PREFETCH_OPTS)
    if unknown:
        name = unknown[0]
        near = difflib.get_close_matches(name, keywords + tuple(sorted(PREFETCH_OPTS)), 1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise TypeError(f"{who}() got an unexpected keyword argument {name!r}{hint}")
    return dict(opts)


def rank_world(who: str, rank: Any, world_size: Any) -> tuple[int, int]:
    """(rank, world_size): the arguments, or where one is None, torch.distributed's when it is
    initialised, else the RANK and WORLD_SIZE environment variables (as torchrun sets them),
    else 0 and 1."""
    if rank is None or world_size is None:
        torch = sys.modules.get("torch")
        dist = getattr(torch, "distributed", None) if torch is not None else None
        if dist is not None and dist.is_available() and dist.is_initialized():
            d_rank, d_world = dist.get_rank(), dist.get_world_size()
        else:
            try:
                d_rank, d_world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
            except ValueError as e:
                raise ValueError(f"{who}: RANK / WORLD_SIZE environment variables are not integers ({e})") from None
        rank = d_rank if rank is None else rank
        world_size = d_world if world_size is None else world_size
    world = int_arg(who, "world_size", world_size, 1)
    r = int_arg(who, "rank", rank, 0)
    if r >= world:
        raise ValueError(f"{who}: rank must be < world_size, got rank={r}, world_size={world}")
    return r, world


def _same_opt(a: Any, b: Any) -> bool:
    """Two prefetcher options are the same: equal plain values, or the very same object (a
    door's stream and convert callables, out= tensors, which == would compare elementwise),
    or lists/tuples of the very same objects (a door's out=)."""
    plain = (str, int, float, bool, type(None))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_opt(x, y) for x, y in zip(a, b))
    return a is b or (isinstance(a, plain) and isinstance(b, plain) and a == b)


def _same_settings(a: tuple[Any, int, dict[str, Any]], b: tuple[Any, int, dict[str, Any]]) -> bool:
    """Two (device, depth, prefetcher options) are the same prefetcher's."""
    return (str(a[0]) == str(b[0]) and a[1] == b[1] and a[2].keys() == b[2].keys()
            and all(_same_opt(v, b[2][k]) for k, v in a[2].items()))


# Note [doors over a loader]
# A framework door (pinloader.torch.prefetch(loader), jax, cupy) over an ArrayLoader or an
# ImageLoader does not stack a second prefetcher: it iterates the loader's own, made with the door's settings (its
# output, stream, convert, static, out, and a device, depth or option the loader was not given;
# a door setting that contradicts one the loader was made with is a ValueError naming it). The
# settings are the door's, not the loader's: they apply to the iterations through that door
# only, and the loader keeps its own. So a door can be made once per epoch, doors with other
# options can take turns with each other and with plain iterations of the loader, and each
# iteration is what its own door asks for. Each iter() begins an epoch (a new one, or the
# loader's fresh one); when its settings differ from those the running prefetcher was made
# with, that prefetcher is closed there and a new one made: its static buffers go with it. A
# door's settings are compared by value and, for callables and buffers, by identity, so the
# doors keep one callable per device (pinloader/torch.py) and a door made per epoch over one
# loader keeps the same prefetcher, and the same static buffers, across epochs. A next() on
# a door whose settings are not the running prefetcher's begins an epoch with them; a plain
# next() continues whatever runs. A closed loader refuses new doors ("ArrayLoader is closed").
# Devices are compared as read by pinloader/_device.py (Note [device spellings]): "cpu" and
# torch.device("cpu") agree, and a loader made with "cuda" runs a door's "cuda:N" on device N,
# the device the door's arrays are made for.
# EpochLoader below is that logic, shared by both loaders.


class EpochLoader(ABC):
    """A loader that is its own iterator over a prefetcher made per settings (its own or a
    door's). The subclass sets the attributes below and makes the prefetcher."""

    _NAME = "loader"
    _DEFAULT_DEPTH = 3
    _pf: AsyncPrefetcher | None
    _pf_settings: Settings | None
    _it: IterState
    _plan: Plan
    _closed: bool
    _device: str | None  # canonical (Note [device spellings] in pinloader/_device.py)
    _depth: int | None
    _opts: dict[str, Any]

    @abstractmethod
    def _make_prefetcher(self, settings: Settings) -> AsyncPrefetcher:
        """The prefetcher for these settings (each loader makes its own)."""

    @abstractmethod
    def close(self) -> None:
        """Free the loader's prefetcher and sources (each loader frees its own)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self: _L) -> _L:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self._NAME} is closed")

    def _own_settings(self) -> Settings:
        return self._device, self._DEFAULT_DEPTH if self._depth is None else self._depth, self._opts

    def __iter__(self) -> Any:
        return self._begin(self._own_settings())

    def _begin(self, settings: Settings) -> Any:
        """Begin an epoch with these settings (the loader's own, or a door's: Note [doors over a
        loader])."""
        self._check_open()
        it = self._it
        epoch = it.next_epoch()
        if epoch >= _EPOCH_LIMIT:
            raise ValueError(f"{self._NAME}: epoch {epoch} is past the last epoch (2**63 - 1); "
                             "set_epoch() to continue")
        it.resumed = _resume.begin_epoch(it, self._plan, epoch)  # the resumed epoch's, or None
        pf = self._pf
        if pf is not None and (self._pf_settings is None or not _same_settings(self._pf_settings, settings)):
            pf.close()  # made for other settings (Note [doors over a loader])
            pf = self._pf = None
        if pf is not None and (it.failed or (not it.consumed and not it.done and epoch != it.epoch)):
            # A prefetcher whose source failed is finished for good, and one that has handed
            # out nothing keeps its untouched epoch (Note [epochs] in src/py/prefetcher.c): start
            # over with a new one.
            pf.close()
            pf = self._pf = None
        it.failed = False
        prev = self._plan.epoch
        self._plan.epoch = epoch
        try:
            if it.resumed is None:  # the next epoch's order, made while this one's is drawn
                prepare_alongside(self._plan, epoch + 1)
            if pf is None:
                self._pf = self._make_prefetcher(settings)
            else:
                iter(pf)
        except BaseException:
            # The epoch did not begin (a Ctrl-C while its order was drawn, a source that could
            # not be read): the next iteration begins it again with a new prefetcher, and
            # state_dict() still says where the loader is.
            self._plan.epoch, it.requested, it.failed = prev, epoch, True
            raise
        it.epoch, it.consumed, it.done = epoch, 0, False
        # the order of the epoch that comes next by default, made while this one runs (Note
        # [orders made ahead] in pinloader/_epoch_plan.py)
        prepare_order(self._plan, epoch + 1, whole=it.resumed is None)
        return self

    def __next__(self) -> Any:
        """The next batch (a loader whose items carry more than the batch overrides this)."""
        batch = self._take()
        self._it.consumed += 1
        return batch

    def _take(self) -> Any:
        """The running prefetcher's next item, the epoch's end and failures recorded."""
        self._check_open()
        if self._pf is None:
            iter(self)
        assert self._pf is not None
        try:
            return next(self._pf)
        except StopIteration:
            self._it.done = True
            raise
        except Exception:
            self._it.failed = True
            raise
        # (a KeyboardInterrupt leaves the prefetcher as it was: the batch it interrupted comes
        # with the next next(), Note [interrupted handout] in src/py/pf_producer.c)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return int(self._plan.n_batches)

    # ---- the framework doors (pinloader/_door.py) ----

    def _next_with(self, settings: Settings) -> Any:
        """A door's next(): begins an epoch with the door's settings unless they are the
        running prefetcher's (Note [doors over a loader])."""
        self._check_open()
        if self._pf is None or self._pf_settings is None or not _same_settings(self._pf_settings, settings):
            self._begin(settings)
        return next(self)

    def _pinloader_prefetcher(self, device: Any, depth: int, **opts: Any) -> "_LoaderDoor":
        """Let a door iterate this loader (no second pipeline): the door's device, depth and
        options fill in what the loader was not given, for the door's iterations only (Note
        [doors over a loader]); a conflict is an error."""
        self._check_open()

        def clash(name: str, mine: Any, theirs: Any) -> ValueError:
            return ValueError(f"{self._NAME} was made with {name}={mine!r}, but the door asks for "
                              f"{name}={theirs!r}: pass it to one of them only")
        device = _device.canonical(device, f"{self._NAME} (through a framework door)")
        if not _device.agree(self._device, device):
            raise clash("device", self._device, device)
        want_device = _device.narrower(self._device, device)
        # the doors' default depth (that object, not any 2) means "not given": the loader's own
        # depth applies; an explicit depth wins
        given = depth is not _DOOR_DEFAULT_DEPTH
        want_depth = self._depth if self._depth is not None else depth if given else self._DEFAULT_DEPTH
        if self._depth is not None and given and depth != self._depth:
            raise clash("depth", self._depth, depth)
        merged = dict(self._opts)
        for k, v in opts.items():
            if k in merged and not _same_opt(merged[k], v):
                raise clash(k, merged[k], v)
            merged[k] = v
        return _LoaderDoor(self, (want_device, want_depth, merged))


class _LoaderDoor:
    """What a framework door iterates when its source is an ArrayLoader or an ImageLoader: the
    loader, with the door's settings for the door's iterations (Note [doors over a loader])."""

    def __init__(self, loader: Any, settings: tuple[Any, int, dict[str, Any]]) -> None:
        self._loader = loader
        self._settings = settings

    def __iter__(self) -> "_LoaderDoor":
        self._loader._begin(self._settings)
        return self

    def __next__(self) -> Any:
        return self._loader._next_with(self._settings)

    def __len__(self) -> int:
        return len(self._loader)

    @property
    def valid_rows(self) -> int | None:
        rows: int | None = self._loader.valid_rows
        return rows

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], **kwargs: Any) -> None:
        self._loader.load_state_dict(state, **kwargs)

    def stats(self) -> dict[str, Any]:
        st: dict[str, Any] = self._loader.stats()
        return st

    def close(self) -> None:
        self._loader.close()

    @property
    def closed(self) -> bool:
        return bool(self._loader.closed)

    def __repr__(self) -> str:
        return repr(self._loader)
