"""Checkpoint and resume: the ArrayLoader's state format and its validation, and the re-sharding
of a resumed epoch's remaining items (Resuming, in the module documentation of
:mod:`pinloader.array_loader`). The prefetcher over a source with its own ``state_dict`` /
``load_state_dict`` is :class:`~pinloader.StatefulPrefetcher`, in pinloader/_stateful.py.
The functions here take what they read as arguments: the loader's settings (its public
attributes), its epoch plan, and the IterState it keeps its iteration in
(pinloader/_iter_state.py); they set nothing of the loader but that IterState.

Note [consumer-side position]
A state describes what the *consumer* has been handed, never what the prefetcher has pulled:
with ``depth`` batches in flight the source is always ahead of the training loop, and a
checkpoint taken after step k must resume at step k + 1. The ArrayLoader counts the batches its
``__next__`` hands out; a :class:`StatefulPrefetcher` sends each item through the pipeline
together with the source's state taken right after the item was pulled (a pass-through leaf:
the prefetcher does not look inside objects that are not arrays or containers) and keeps the
state of the last item it handed out. Loading a state discards everything prefetched.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator

import numpy as np

from ._iter_state import IterState

FORMAT = "pinloader.ArrayLoader"
VERSION = 1

# Fields a state must match, unless named in allow_changed. world_size may differ (elastic
# resume, exact); rank is informational (a position is global, see the module documentation).
CHECKED = ("sources", "seed", "shuffle", "windows", "drop_last", "batch_size")
KEYS = ("format", "version", "epoch", "position", "consumed", "seed", "shuffle", "drop_last",
        "batch_size", "windows", "rank", "world_size", "sources")


# ---- the ArrayLoader's state ----

def fingerprint(plan: Any) -> dict[str, Any]:
    """The sources as the state records them: rows, and per leaf its path, shape and dtype."""
    leaves = []
    for path, _, _, shape in plan.leaves:
        # the shape and dtype the loader was made for (a source found changed since is an error
        # of the iteration, not of the state; a closed loader no longer holds its sources)
        dtype = plan.dtypes.get(path)
        leaves.append([path, [int(d) for d in shape], "?" if dtype is None else str(dtype)])
    return {"rows": int(plan.num_rows), "leaves": leaves}


def _settings(loader: Any) -> dict[str, Any]:
    return {"seed": int(loader.seed), "shuffle": bool(loader.shuffle),
            "drop_last": bool(loader.drop_last), "batch_size": int(loader.batch_size),
            "windows": None if loader.windows is None else int(loader.windows),
            "rank": int(loader.rank), "world_size": int(loader.world_size)}


def state_of(loader: Any, it: IterState, plan: Any) -> dict[str, Any]:
    """ArrayLoader.state_dict(): see its documentation. ``loader`` gives its settings (public
    attributes), ``it`` where its iteration is, ``plan`` its sources."""
    n, world = loader.num_items, loader.world_size
    consumed = 0
    if it.requested is not None:  # set_epoch() (or a load) not yet followed by an iteration
        epoch, pend = it.requested, it.resume_at
        if pend is not None and _pending_applies(it, epoch):
            _, position, consumed = pend
        else:
            position = 0
    elif it.epoch is None:  # never iterated: the first epoch's start
        epoch, position = 0, 0
    else:
        epoch = it.epoch
        resumed = it.resumed
        if resumed is None:
            base, shard, n_batches, before = 0, loader.num_samples, len(loader), 0
        else:
            base, shard, n_batches, before = resumed
        if it.done or it.consumed >= n_batches:
            epoch, position = epoch + 1, 0
        else:
            items = min(it.consumed * loader.batch_size, shard)
            # Every rank has taken as many items (DDP's lockstep): together the first
            # base + items * world items of the epoch's (resumed) order.
            position = min(base + items * world, n)
            consumed = before + items
    out = {"format": FORMAT, "version": VERSION, "epoch": int(epoch), "position": int(position),
           "consumed": int(consumed)}
    out.update(_settings(loader))
    out["sources"] = fingerprint(plan)
    return out


def _describe_sources(fp: Any) -> str:
    leaves = fp.get("leaves", []) if isinstance(fp, dict) else []
    return ", ".join(f"{p} {tuple(s)} {d}" for p, s, d in leaves) or repr(fp)


def _sources_differ(saved: Any, now: dict[str, Any]) -> str | None:
    if saved == now:
        return None
    leaves = saved.get("leaves") if isinstance(saved, dict) else None
    if not isinstance(leaves, list) or not all(
            isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and isinstance(x[1], list)
            for x in leaves):
        return f"sources: the state's record of the sources is malformed ({saved!r})"
    old = {x[0]: x for x in leaves}
    new = {x[0]: x for x in now["leaves"]}
    for path in list(old) + [p for p in new if p not in old]:
        if path not in new:
            return f"sources: {path} was in the state's sources, is not in this loader's"
        if path not in old:
            return f"sources: {path} is in this loader's sources, was not in the state's"
        if old[path] != new[path]:
            _, s, d = old[path]
            _, s2, d2 = new[path]
            return (f"sources: {path} was {tuple(s)} {d} when the state was saved, is "
                    f"{tuple(s2)} {d2} in this loader")
    if saved.get("rows") != now["rows"]:
        return (f"sources: the state was saved over {saved.get('rows')!r} rows, this loader has "
                f"{now['rows']}")
    return (f"sources: saved as [{_describe_sources(saved)}], this loader has "
            f"[{_describe_sources(now)}]")


def validate(loader: Any, plan: Any, state: Any, allow_changed: Iterable[str]) -> tuple[int, int]:
    """Check ``state`` against ``loader``'s settings and ``plan``'s sources; return the (epoch,
    position) to resume at."""
    where = "ArrayLoader.load_state_dict"
    if isinstance(allow_changed, str):
        allow_changed = {allow_changed}
    try:
        allowed = set(allow_changed)
    except TypeError:
        raise TypeError(f"{where}: allow_changed must be a set (or other collection) of field "
                        f"names, not {type(allow_changed).__name__}") from None
    if not all(isinstance(k, str) for k in allowed):
        raise TypeError(f"{where}: allow_changed must hold field names (str), got {sorted(map(repr, allowed))}")
    unknown = allowed - set(CHECKED)
    if unknown:
        raise ValueError(f"{where}: allow_changed names unknown fields {sorted(unknown)}; the "
                         f"fields a state is checked on are {list(CHECKED)}")
    if not isinstance(state, dict):
        raise TypeError(f"{where}: the state must be a dict (from ArrayLoader.state_dict()), "
                        f"not {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"{where}: not an ArrayLoader state (format={state.get('format')!r}, "
                         f"expected {FORMAT!r})")
    version = state.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: version: {version!r} is not a state version")
    if version > VERSION:
        raise ValueError(f"{where}: version: the state has version {version}, newer than this "
                         f"pinloader reads ({VERSION}); load it with the pinloader that saved it")
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise ValueError(f"{where}: the state lacks the field(s) {missing}")
    for k, lo in (("epoch", 0), ("position", 0), ("consumed", 0), ("world_size", 1), ("rank", 0)):
        v = state[k]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v < 2**63:
            raise ValueError(f"{where}: {k}: {v!r} is not a valid value (an int in [{lo}, 2**63))")
    if state["rank"] >= state["world_size"]:
        raise ValueError(f"{where}: rank: {state['rank']!r} is not below world_size "
                         f"({state['world_size']!r})")
    mine = _settings(loader)
    for k in CHECKED:
        if k in allowed:
            continue
        if k == "sources":
            why = _sources_differ(state["sources"], fingerprint(plan))
            if why:
                raise ValueError(f"{where}: {why}; pass allow_changed={{'sources'}} to continue "
                                 "at the state's epoch and position over these sources")
            continue
        saved, now = state[k], mine[k]
        same = (saved % 2**64 == now % 2**64) if k == "seed" and isinstance(saved, int) else saved == now
        if not same:
            raise ValueError(f"{where}: {k}: the state was saved with {k}={saved!r}, this loader "
                             f"has {k}={now!r}; pass allow_changed={{{k!r}}} to continue at the "
                             f"state's epoch and position with this loader's {k}")
    return int(state["epoch"]), int(state["position"])


# ---- the resumed epoch ----

def resumed_order(plan: Any, epoch: int, position: int) -> np.ndarray:
    """The rank's item order for what remains of ``epoch`` once the ranks together consumed its
    first ``position`` items: see Resuming in the module documentation of array_loader."""
    from ._C import epoch_table
    from ._epoch_plan import epoch_order
    n, world, rank = plan.num_items, plan.world_size, plan.rank
    g = min(max(int(position), 0), n)
    rest = n - g
    length = (rest // world) * world if plan.drop_last else -(-rest // world) * world
    if length == 0:
        out = np.empty(0, np.int64)
    else:
        # The epoch's whole order (one rank of one): the same items in the same order as the
        # sharded epoch interleaves, windows already mapped to their first rows.
        whole = copy.copy(plan)
        whole.cache = None
        whole.rank, whole.world_size, whole.num_samples, whole.drop_last = 0, 1, n, False
        full = epoch_order(whole, epoch)
        # continue the order cyclically from position g: the padding wraps to the epoch's start
        out = full[(g + np.arange(rank, length, world, dtype=np.int64)) % n]
    return epoch_table(out)  # read-only, read in place (Note [epoch row tables] in src/py/epoch_table.c)


def batches_of(plan: Any, items: int) -> int:
    bs = int(plan.batch_size)
    return items // bs if plan.drop_last else -(-items // bs)


class ResumableEpochs:
    """The ArrayLoader's source: the resumed epoch's iteration (``resume_run`` of the loader's
    IterState, set by :func:`begin_epoch`) gives the batches of :func:`resumed_order`, every
    other one the batches of ``inner``, the loader's own source."""

    def __init__(self, inner: Any, plan: Any, it: IterState) -> None:
        self._inner = inner
        self._plan = plan
        self._it = it

    @property
    def resume(self) -> tuple[int, np.ndarray, int] | None:
        """The resumed epoch's (epoch, order, batches), or None."""
        return self._it.resume_run

    def __len__(self) -> int:
        return len(self._inner)

    def __iter__(self) -> Iterator[Any]:
        from ._epoch_plan import epoch_batches
        plan, r = self._plan, self.resume
        if r is None or r[0] != plan.epoch:
            return iter(self._inner)
        epoch, order, n_batches = r
        return epoch_batches(plan, epoch, (order, n_batches))


def _pending_applies(it: IterState, epoch: int) -> bool:
    """Whether the next iteration, of ``epoch``, is the resumed one."""
    pend = it.resume_at
    if pend is None or pend[0] != epoch:
        return False
    ran = it.resumed is not None and it.epoch == epoch and (it.consumed or it.done)
    return not ran


def begin_epoch(it: IterState, plan: Any, epoch: int) -> tuple[int, int, int, int] | None:
    """Called as an iteration of ``epoch`` begins: whether it is the resumed epoch's (then its
    position, the rank's item and batch counts, and the state's ``consumed``), or a whole
    epoch's (None)."""
    pend = it.resume_at
    if pend is None:
        return None
    if not _pending_applies(it, epoch):
        # another epoch, or the resumed iteration already ran: whole epochs from now on
        it.resume_at = None
        it.resume_run = None
        return None
    order = resumed_order(plan, epoch, pend[1])
    n_batches = batches_of(plan, len(order))
    it.resume_run = (epoch, order, n_batches)
    return (min(pend[1], plan.num_items), len(order), n_batches, pend[2])


def load(it: IterState, state: dict[str, Any], epoch: int, position: int, num_items: int,
         world_size: int) -> None:
    """ArrayLoader.load_state_dict(), once :func:`validate` accepted ``state`` (whose epoch and
    position it gave) and the loader dropped what it prefetched: the next iteration is the
    state's. ``num_items`` and ``world_size`` are the loader's."""
    it.resume_run = None
    it.resumed = None
    it.consumed, it.done, it.failed = 0, False, False
    it.epoch = None
    if position >= num_items and num_items:  # (a changed source) nothing is left
        epoch, position = epoch + 1, 0
    it.requested = epoch
    if not position:
        it.resume_at = None
        return
    # this rank's items of the epoch so far, as far as it is known (informational)
    consumed = state["consumed"] if state["world_size"] == world_size else position // world_size
    it.resume_at = (epoch, position, int(consumed))
