"""The iterator shared by the framework adapters (torch, JAX, CuPy).

Note [per-batch import]
A batch's leaves are imported together: the batch is flattened once, its DeviceArray leaves are
handed to the adapter's ``_import_leaves`` in one list, and the structure is rebuilt once. How
the leaves are exported depends on the adapter:

- torch, and CuPy where the native module has ``export_capsules``: the consumer's stream is
  resolved once, and every DeviceArray is exported for that stream in one call
  (``export_leaves``: the stream waits on the batch's copy once, and each capsule records the
  stream for the stream-ordered free); each capsule is then imported by the framework. On the
  host backend (no stream) ``export_leaves`` calls each leaf's ``__dlpack__`` instead.
- JAX (and CuPy without ``export_capsules``): each leaf is imported through the framework's own
  ``from_dlpack(leaf)``, which passes the framework's stream to that leaf's ``__dlpack__``: one
  export, and one stream lookup, per leaf (JAX takes only legacy capsules and names its stream
  itself).

A framework import of a DeviceArray itself (``torch.from_dlpack(leaf)``) looks the current
stream up again for every leaf: that is what the one-call export saves.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

from . import _C, _resume
from ._C import AsyncPrefetcher, DeviceArray
from ._stats import PrefetcherStats

_native_export = getattr(_C, "export_capsules", None)


def refuse_bool_device(who: str, device: Any) -> None:
    """bool is an int to Python, and True would name device 1 ('cuda:1'): refuse it."""
    if isinstance(device, bool):
        raise TypeError(f"{who}: device must be a str, an int, a device object or None, not bool "
                        f"({device!r})")


def export_leaves(leaves: list[Any], stream: Any) -> list[Any]:
    """DLPack capsules of ``leaves`` (DeviceArrays; other objects are passed through) for the
    consumer's ``stream`` (a DLPack stream handle, None for the host backend)."""
    if _native_export is not None and stream is not None:
        # One call for the batch: the stream waits once. Host-backend leaves (stream None) need
        # no stream wait, so each leaf's own __dlpack__() costs as little.
        out: list[Any] = _native_export(leaves, stream)
        return out
    return [leaf.__dlpack__(stream=stream) if type(leaf) is DeviceArray else leaf
            for leaf in leaves]


# ---- flatten once, rebuild once ----

_LEAF = object()  # spec of a DeviceArray position
_KEEP = 0         # (_KEEP, obj, None): a subtree without DeviceArrays, returned as it is
_DICT, _LIST, _TUPLE, _NAMEDTUPLE, _DICT_SUB, _LIST_SUB, _DATACLASS = range(1, 8)


def _children(values: Any, leaves: list[Any]) -> list[Any]:
    # DeviceArray children inline: most batches are flat dicts or tuples of arrays.
    out = []
    for v in values:
        if type(v) is DeviceArray:
            leaves.append(v)
            out.append(_LEAF)
        else:
            out.append(flatten(v, leaves))
    return out


def flatten(obj: Any, leaves: list[Any]) -> Any:
    """Append ``obj``'s DeviceArray leaves to ``leaves`` (in order) and return the spec that
    :func:`rebuild` turns back into the structure. Containers are those the prefetcher
    produces: list, tuple, namedtuple, dict, dict subclasses (rebuilt from a shallow copy, so
    a defaultdict keeps its factory), list subclasses, dataclasses; a subtree without
    DeviceArrays is kept as it is."""
    t = type(obj)
    if t is DeviceArray:
        leaves.append(obj)
        return _LEAF
    n = len(leaves)
    spec: tuple[int, Any, list[Any]]
    if t is dict:
        spec = (_DICT, tuple(obj), _children(obj.values(), leaves))
    elif t is list:
        spec = (_LIST, None, _children(obj, leaves))
    elif t is tuple:
        spec = (_TUPLE, None, _children(obj, leaves))
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        spec = (_NAMEDTUPLE, t, _children(obj, leaves))
    elif isinstance(obj, dict):
        spec = (_DICT_SUB, obj, _children(obj.values(), leaves))
    elif isinstance(obj, list):
        spec = (_LIST_SUB, t, _children(obj, leaves))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj) if f.init)
        spec = (_DATACLASS, (obj, names), _children([getattr(obj, k) for k in names], leaves))
    else:
        return (_KEEP, obj, None)
    return spec if len(leaves) > n else (_KEEP, obj, None)


def rebuild(spec: Any, it: Any) -> Any:
    """The structure of ``spec`` with its leaves taken in order from the iterator ``it``."""
    if spec is _LEAF:
        return next(it)
    kind, meta, children = spec
    if kind == _KEEP:
        return meta
    values = [next(it) if c is _LEAF else rebuild(c, it) for c in children]
    if kind == _DICT:
        return dict(zip(meta, values))
    if kind == _LIST:
        return values
    if kind == _TUPLE:
        return tuple(values)
    if kind == _NAMEDTUPLE:
        return meta(*values)
    if kind == _DICT_SUB:
        # OrderedDict, defaultdict...: a shallow copy keeps the type and its extra state, as the
        # prefetcher itself rebuilt it; then the values are replaced.
        out = copy.copy(meta)
        keys = list(meta)
        out.clear()
        out.update(zip(keys, values))
        return out
    if kind == _LIST_SUB:
        return meta(values)
    obj, names = meta
    return dataclasses.replace(obj, **dict(zip(names, values)))


class FrameworkPrefetcher:
    """Wraps an :class:`AsyncPrefetcher`; each batch's DeviceArray leaves go through
    ``convert`` (the framework's DLPack import) as the batch is handed out.

    Subclasses that resolve the consumer's stream themselves override :meth:`_consumer_stream`
    and :meth:`_import_leaves`; see Note [per-batch import]."""

    def __init__(self, iterable: Iterable[Any], device: Any, depth: int,
                 convert: Callable[[Any], Any], **opts: Any) -> None:
        self._convert = convert
        adopt = getattr(iterable, "_pinloader_prefetcher", None)
        if adopt is not None:
            # An ArrayLoader already is a prefetcher: use it rather than stack a second one.
            self._pf = adopt(device, depth, **opts)
        elif _resume.is_stateful(iterable):
            # Each item travels with the source's state (Note [consumer-side position] in
            # pinloader/_resume.py), so state_dict() is as of the last batch handed out.
            self._pf = _resume.StatefulPrefetcher(iterable, device=device, depth=depth, **opts)
        else:
            self._pf = AsyncPrefetcher(iterable, device=device, depth=depth, **opts)

    def _consumer_stream(self) -> Any:
        """The DLPack stream handle the batch is handed to, looked up once per batch."""
        return None

    def _import_leaves(self, leaves: list[Any]) -> list[Any]:
        """The framework arrays for one batch's DeviceArray leaves (the default: ``convert``
        of each DeviceArray, which resolves the framework's stream itself)."""
        convert = self._convert
        return [convert(leaf) for leaf in leaves]

    def __iter__(self) -> "FrameworkPrefetcher":
        iter(self._pf)
        return self

    def __next__(self) -> Any:
        batch = next(self._pf)
        if type(batch) is DeviceArray:
            return self._import_leaves([batch])[0]
        leaves: list[Any] = []
        spec = flatten(batch, leaves)
        if not leaves:
            return batch
        return rebuild(spec, iter(self._import_leaves(leaves)))

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

    def __enter__(self) -> "FrameworkPrefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self._pf!r})"
