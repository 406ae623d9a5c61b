"""Mapping over the nested batches that AsyncPrefetcher yields (shared by the adapters)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ._C import DeviceArray


def map_leaves(obj: Any, fn: Callable[[DeviceArray], Any]) -> Any:
    """Rebuild ``obj`` with every DeviceArray leaf replaced by ``fn(leaf)``.

    Containers are rebuilt with the same types the prefetcher produced: list, tuple,
    namedtuple, dict (and dict subclasses built from pairs), dataclasses.
    """
    if type(obj) is DeviceArray:
        return fn(obj)
    if type(obj) is dict:
        return {k: map_leaves(v, fn) for k, v in obj.items()}
    if type(obj) is list:
        return [map_leaves(v, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(map_leaves(v, fn) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_leaves(v, fn) for v in obj))
    if isinstance(obj, dict):
        return type(obj)((k, map_leaves(v, fn)) for k, v in obj.items())
    if isinstance(obj, list):
        return type(obj)(map_leaves(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_leaves(getattr(obj, f.name), fn)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def to_capsules(obj: Any, stream: Any) -> Any:
    """``output="capsule"``: every DeviceArray exported as a DLPack capsule for ``stream``."""
    return map_leaves(obj, lambda leaf: leaf.__dlpack__(stream=stream))
