"""ArrayLoader checkpoints: state_dict / load_state_dict (host backend).

A run resumed in a new process equals the uninterrupted run, for every number of batches before
the checkpoint: every equivalence is of a whole batch sequence, an uninterrupted run against (k
batches, state_dict, a new process, load_state_dict, the rest). The same across world sizes
(elastic, within an epoch) and batch sizes; states that do not fit the loader are refused naming
the field (or accepted when allow_changed names it); torch.save, torch.distributed.checkpoint and
the torch door carry them.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest

import pinloader
from helpers import ROOT, drain, ref_order, run_py

DEVICE = "cpu"

EPOCHS = 3


def data(n):
    """(ids, values): the ids leaf names each batch's items, the values check the gather."""
    ids = np.arange(n, dtype=np.int64)
    return {"id": ids, "x": (ids[:, None] * 10 + np.arange(3)).astype(np.float32)}


def batch_ids(b, windows=None):
    i = np.from_dlpack(b["id"])
    x = np.from_dlpack(b["x"])
    assert np.array_equal(x[..., 0], (i * 10).astype(np.float32))  # values follow the ids
    return (i[:, 0] if i.ndim == 2 else i).tolist()


def continue_run(L, first_epoch, on_batch=None):
    """A training loop's epochs from `first_epoch` to the last, with set_epoch: the batches."""
    got = []
    for e in range(first_epoch, EPOCHS):
        L.set_epoch(e)
        for j, b in enumerate(L):
            got.append(batch_ids(b))
            if on_batch is not None:
                on_batch(j, got)
    return got


# ---- resumed in a new process --------------------------------------------------------------------

# The child: one fresh loader per state, continued to the end of epoch EPOCHS - 1 with a
# training loop's set_epoch; a second resume within the epoch is handed back to the parent.
CHILD = r'''
import json, sys
import numpy as np
import pinloader
sys.path.insert(0, {tests!r})
from test_array_loader_resume import data, continue_run
cfg = json.loads({cfg!r})
job = json.load(open({job!r}))
out = []
for st in job["states"]:
    L = pinloader.ArrayLoader(data(cfg["n"]), cfg["bs"], **cfg["kw"])
    L.load_state_dict(st)
    second = []

    def on_batch(j, got):
        if not second and j == 1:
            second.extend([len(got), L.state_dict()])  # mid-epoch, batches in flight

    got = continue_run(L, st["epoch"], on_batch)
    L.close()
    out.append({{"got": got, "second": second or None}})
json.dump(out, open({job!r} + ".out", "w"))
'''

CONFIGS = {
    "rows": dict(n=103, bs=8, kw=dict(shuffle=False)),
    "rows-shuffled": dict(n=103, bs=8, kw=dict(seed=5)),
    "windows": dict(n=230, bs=4, kw=dict(shuffle=False, windows=7)),
    "windows-shuffled": dict(n=230, bs=4, kw=dict(seed=2, windows=7)),
    "shards": dict(n=103, bs=5, kw=dict(seed=9, world_size=3)),
    "shards-drop-last": dict(n=103, bs=5, kw=dict(seed=9, world_size=3, drop_last=True)),
    "shards-windows": dict(n=230, bs=3, kw=dict(seed=4, world_size=2, windows=7)),
}


def uninterrupted(cfg, rank=0):
    """The whole run's batches and the state after each one (JSON round-tripped), taken while
    `depth` batches are in flight; also the state after each epoch's StopIteration."""
    kw = dict(cfg["kw"], device=DEVICE, depth=3)
    if "world_size" in kw:
        kw["rank"] = rank
    L = pinloader.ArrayLoader(data(cfg["n"]), cfg["bs"], **kw)
    seq, states = [], [(0, L.state_dict())]
    for _ in range(EPOCHS):
        for b in L:
            seq.append(batch_ids(b, kw.get("windows")))
            states.append((len(seq), L.state_dict()))
        states.append((len(seq), L.state_dict()))  # after the epoch's end
    L.close()
    return seq, [(k, json.loads(json.dumps(s))) for k, s in states], kw


@pytest.mark.parametrize("name", CONFIGS)
def test_resume_in_a_new_process_equals_uninterrupted_run(name, tmp_path):
    cfg = CONFIGS[name]
    ranks = range(cfg["kw"].get("world_size", 1))
    for rank in ranks:
        seq, states, kw = uninterrupted(cfg, rank)
        child_cfg = dict(cfg, kw=dict(kw, depth=3))
        job = tmp_path / f"job{rank}.json"
        job.write_text(json.dumps({"states": [s for _, s in states]}))
        code = CHILD.format(tests=os.path.join(ROOT, "tests"), cfg=json.dumps(child_cfg), job=str(job))
        p = run_py(code, timeout=300, env_extra={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-4000:]
        out = json.loads((tmp_path / f"job{rank}.json.out").read_text())
        assert len(out) == len(states)
        seconds = 0
        for (k, st), res in zip(states, out):
            assert res["got"] == seq[k:], f"rank {rank}: resumed after {k} batches ({st})"
            if res["second"] is None:
                continue
            # the second resume, saved in the child, continued here in the parent
            j, st2 = res["second"]
            L = pinloader.ArrayLoader(data(cfg["n"]), cfg["bs"], **kw)
            L.load_state_dict(st2)
            rest = continue_run(L, st2["epoch"])
            L.close()
            assert rest == seq[k + j:], f"rank {rank}: second resume after {k} + {j} batches"
            seconds += 1
        assert seconds > 0


# ---- the state -----------------------------------------------------------------------------------

def test_state_format_and_boundaries():
    L = pinloader.ArrayLoader(data(20), 6, seed=1, device=DEVICE, depth=3)
    st = L.state_dict()
    assert st == {"format": "pinloader.ArrayLoader", "version": 1, "epoch": 0, "position": 0,
                  "consumed": 0, "seed": 1, "shuffle": True, "drop_last": False, "batch_size": 6,
                  "windows": None, "rank": 0, "world_size": 1,
                  "sources": {"rows": 20, "leaves": [["arrays['id']", [20], "int64"],
                                                     ["arrays['x']", [20, 3], "float32"]]}}
    assert json.loads(json.dumps(st)) == st
    it = iter(L)
    next(it)
    assert (L.state_dict()["epoch"], L.state_dict()["position"]) == (0, 6)
    drain(L)
    assert (L.state_dict()["epoch"], L.state_dict()["position"]) == (1, 0)
    L.set_epoch(7)
    assert (L.state_dict()["epoch"], L.state_dict()["position"]) == (7, 0)
    # a loaded state is reported as it was until the loader moves on
    L2 = pinloader.ArrayLoader(data(20), 6, seed=1, device=DEVICE)
    it = iter(L2)
    next(it), next(it)
    st = L2.state_dict()
    L3 = pinloader.ArrayLoader(data(20), 6, seed=1, device=DEVICE)
    L3.load_state_dict(st)
    assert L3.state_dict() == st
    iter(L3)
    assert L3.state_dict() == st  # an iteration that has handed out nothing
    assert np.array_equal(np.concatenate([np.from_dlpack(b["id"]) for b in L3]),
                          L3.indices(0)[12:])
    # the resumed epoch is run once: set_epoch of it again gives the whole epoch
    L3.set_epoch(0)
    assert np.array_equal(np.concatenate([np.from_dlpack(b["id"]) for b in L3]), L3.indices(0))
    for x in (L, L2, L3):
        x.close()


def test_load_discards_prefetched_batches_and_set_epoch_elsewhere_drops_the_resume():
    L = pinloader.ArrayLoader(data(100), 10, seed=3, device=DEVICE, depth=4)
    it = iter(L)
    for _ in range(5):
        next(it)
    st = L.state_dict()
    it = iter(L)   # epoch 1, with batches in flight
    next(it)
    L.load_state_dict(st)
    assert np.array_equal(np.concatenate([np.from_dlpack(b["id"]) for b in L]), L.indices(0)[50:])
    L.load_state_dict(st)
    L.set_epoch(4)  # another epoch than the state's: that epoch, whole
    assert np.array_equal(np.concatenate([np.from_dlpack(b["id"]) for b in L]), L.indices(4))
    L.close()


def test_rank_0s_state_resumes_both_ranks():
    # lockstep: every rank's state holds the same position, so rank 0's resumes rank 1
    kw = dict(seed=6, world_size=2, device=DEVICE)
    Ls = [pinloader.ArrayLoader(data(101), 7, rank=r, **kw) for r in range(2)]
    its = [iter(x) for x in Ls]
    for _ in range(3):
        for i in its:
            next(i)
    states = [x.state_dict() for x in Ls]
    assert states[0]["position"] == states[1]["position"] == 42
    for r in range(2):
        L = pinloader.ArrayLoader(data(101), 7, rank=r, **kw)
        L.load_state_dict(states[0])
        got = np.concatenate([np.from_dlpack(b["id"]) for b in L])
        assert np.array_equal(got, Ls[r].indices(0)[21:])
        L.close()
    for x in Ls:
        x.close()


# ---- elastic: another world size -----------------------------------------------------------------

def whole_order(n, seed, epoch, windows=None, shuffle=True):
    """The epoch's order before sharding, from the reference generator."""
    return ref_order(n, 1, seed, epoch, shuffle=shuffle, window=windows)


def take(loaders, k):
    """k batches from each rank (lockstep); their items."""
    got = []
    for L in loaders:
        it = iter(L)
        for _ in range(k):
            got += batch_ids(next(it))
    return got


def resume_all(state, n, bs, world, kw):
    """Every rank of `world` resumed from `state`: each rank's resumed epoch's items and the
    loaders (left at the end of that epoch)."""
    shares, loaders = [], []
    for r in range(world):
        L = pinloader.ArrayLoader(data(n), bs, rank=r, world_size=world, device=DEVICE, **kw)
        L.load_state_dict(state)
        L.set_epoch(state["epoch"])
        batches = [batch_ids(b) for b in L]
        assert all(len(b) == bs for b in batches[:-1])
        share = L.indices_after(state["epoch"], state["position"]).tolist()
        got = [i for b in batches for i in b]
        # the batches: the share, without the last partial batch with drop_last
        assert got == share[:(len(share) // bs) * bs if kw.get("drop_last") else len(share)]
        shares.append(share)
        loaders.append(L)
    return shares, loaders


def check_cover(order, consumed, shares, drop_last, world):
    """The remaining items, shared among `world` ranks: disjoint up to the padding, equal in
    size, covering exactly what was not consumed (or its multiple of `world` with drop_last)."""
    n, g = len(order), len(consumed)
    assert Counter(consumed) == Counter(order[:g])  # the ranks took the order's first g items
    rest = order[g:]
    sizes = {len(s) for s in shares}
    assert len(sizes) == 1
    flat = [i for s in shares for i in s]
    if drop_last:
        assert len(flat) == len(set(flat)) == (len(rest) // world) * world
        assert set(flat) == set(rest[:len(flat)]) and not set(flat) & set(consumed)
    else:
        assert len(flat) == -(-len(rest) // world) * world
        # each remaining item once, and the padding: the epoch's first items, cyclically
        pad = [order[i % n] for i in range(len(flat) - len(rest))]
        assert Counter(flat) == Counter(rest) + Counter(pad)
        assert set(flat) | set(consumed) == set(order)


@pytest.mark.parametrize("new_world", [2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("windows", [None, 5])
def test_elastic_resume_reshards_the_remaining_items(new_world, drop_last, windows):
    n, bs, seed = 203, 6, 11
    kw = dict(seed=seed, drop_last=drop_last, windows=windows)
    order = whole_order(n, seed, 1, windows)
    old = [pinloader.ArrayLoader(data(n), bs, rank=r, world_size=4, device=DEVICE, **kw)
           for r in range(4)]
    nb = len(old[0])
    for k in range(nb + 1):
        for L in old:
            L.set_epoch(1)
        consumed = take(old, k)
        state = old[0].state_dict()
        if k == nb:  # the epoch's end: the next epoch, whole, sharded as usual
            assert (state["epoch"], state["position"]) == (2, 0)
            continue
        assert state["position"] == k * bs * 4 and state["epoch"] == 1
        shares, new = resume_all(state, n, bs, new_world, kw)
        check_cover(order, consumed, shares, drop_last, new_world)
        if k == 0:
            for r, s in enumerate(shares):  # position 0 is the usual sharding
                assert s == ref_order(n, bs, seed, 1, r, new_world, drop_last=drop_last,
                                      window=windows)[:len(s)]
        if k == 1:
            for r, L in enumerate(new):  # the next epoch: the usual sharding
                got = [i for b in L for i in batch_ids(b)]
                want = ref_order(n, bs, seed, 2, r, new_world, drop_last=drop_last, window=windows)
                assert got == (want[:len(L) * bs] if drop_last else want)
        for L in new:
            L.close()
    for L in old:
        L.close()


def test_elastic_twice_within_an_epoch():
    # 4 ranks take 3 batches, 3 ranks resume and take 2, 8 ranks resume: the whole epoch is
    # covered, every item exactly once apart from the final padding
    n, bs, seed = 250, 5, 3
    order = whole_order(n, seed, 0)
    first = [pinloader.ArrayLoader(data(n), bs, rank=r, world_size=4, seed=seed, device=DEVICE)
             for r in range(4)]
    consumed = take(first, 3)
    st = first[0].state_dict()
    second = []
    for r in range(3):
        L = pinloader.ArrayLoader(data(n), bs, rank=r, world_size=3, seed=seed, device=DEVICE)
        L.load_state_dict(st)
        second.append(L)
    consumed += take(second, 2)
    st2 = second[1].state_dict()
    assert st2["position"] == 3 * bs * 4 + 2 * bs * 3
    shares, new = resume_all(st2, n, bs, 8, dict(seed=seed))
    check_cover(order, consumed, shares, False, 8)
    for L in first + second + new:
        L.close()


def test_batch_size_change_counts_items():
    n = 150
    for world in (1, 2):
        for r in range(world):
            L = pinloader.ArrayLoader(data(n), 8, seed=2, rank=r, world_size=world, device=DEVICE)
            it = iter(L)
            for _ in range(3):
                next(it)
            st = L.state_dict()
            L2 = pinloader.ArrayLoader(data(n), 5, seed=2, rank=r, world_size=world, device=DEVICE)
            with pytest.raises(ValueError, match=r"batch_size: the state was saved with batch_size=8, "
                                                 r"this loader has batch_size=5.*allow_changed"):
                L2.load_state_dict(st)
            L2.load_state_dict(st, allow_changed={"batch_size"})
            batches = [np.from_dlpack(b["id"]).tolist() for b in L2]
            assert all(len(b) == 5 for b in batches[:-1])
            assert [i for b in batches for i in b] == L.indices(0)[24:].tolist()
            L.close()
            L2.close()


# ---- refused states ------------------------------------------------------------------------------

@pytest.mark.parametrize("change,field", [
    (dict(seed=8), "seed"), (dict(shuffle=False), "shuffle"), (dict(drop_last=True), "drop_last"),
    (dict(windows=3), "windows"), (dict(batch_size=4), "batch_size"),
])
def test_changed_fields_are_refused_then_allowed(change, field):
    kw = dict(seed=7, batch_size=6)
    L = pinloader.ArrayLoader(data(60), kw.pop("batch_size"), device=DEVICE, **kw)
    it = iter(L)
    next(it)
    st = L.state_dict()
    args = dict(seed=7, batch_size=6)
    args.update(change)
    L2 = pinloader.ArrayLoader(data(60), args.pop("batch_size"), device=DEVICE, **args)
    with pytest.raises(ValueError, match=rf"load_state_dict: {field}: .*allow_changed=\{{'{field}'\}}"):
        L2.load_state_dict(st)
    L2.load_state_dict(st, allow_changed={field})
    got = [i for b in L2 for i in np.from_dlpack(b["id"]).reshape(-1).tolist()]
    assert got  # continues at the position in this loader's own order
    L.close()
    L2.close()


def test_seed_compares_modulo_2_64_and_rank_world_are_not_checked():
    L = pinloader.ArrayLoader(data(60), 6, seed=-1, device=DEVICE)
    st = L.state_dict()
    L2 = pinloader.ArrayLoader(data(60), 6, seed=2**64 - 1, rank=1, world_size=3, device=DEVICE)
    L2.load_state_dict(st)
    L.close()
    L2.close()


@pytest.mark.parametrize("other,match", [
    (dict(id=np.arange(61), x=np.zeros((61, 3), np.float32)),
     r"sources: arrays\['id'\] was \(60,\) int64 when the state was saved, is \(61,\) int64"),
    (dict(id=np.arange(60), x=np.zeros((60, 3), np.float64)),
     r"sources: arrays\['x'\] was \(60, 3\) float32 .* is \(60, 3\) float64"),
    (dict(id=np.arange(60)), r"sources: arrays\['x'\] was in the state's sources, is not"),
    (dict(id=np.arange(60), x=np.zeros((60, 3), np.float32), y=np.zeros(60)),
     r"sources: arrays\['y'\] is in this loader's sources, was not"),
])
def test_other_sources_are_refused(other, match):
    L = pinloader.ArrayLoader(data(60), 6, device=DEVICE)
    st = L.state_dict()
    L2 = pinloader.ArrayLoader(other, 6, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        L2.load_state_dict(st)
    L2.load_state_dict(st, allow_changed={"sources"})
    L.close()
    L2.close()


def test_malformed_states_are_refused():
    L = pinloader.ArrayLoader(data(60), 6, device=DEVICE)
    st = L.state_dict()
    with pytest.raises(TypeError, match="must be a dict"):
        L.load_state_dict([1])
    with pytest.raises(ValueError, match="not an ArrayLoader state"):
        L.load_state_dict(dict(st, format="other"))
    with pytest.raises(ValueError, match="version: the state has version 2, newer"):
        L.load_state_dict(dict(st, version=2))
    with pytest.raises(ValueError, match=r"lacks the field\(s\) \['position'\]"):
        L.load_state_dict({k: v for k, v in st.items() if k != "position"})
    with pytest.raises(ValueError, match="position: -1 is not a valid value"):
        L.load_state_dict(dict(st, position=-1))
    with pytest.raises(ValueError, match=r"allow_changed names unknown fields \['rank'\]"):
        L.load_state_dict(st, allow_changed={"rank"})
    with pytest.raises(TypeError, match="position must be an int"):
        L.indices_after(0, 1.5)
    # a sources record that is not the loader's format (before: "unhashable type: 'list'")
    for junk in ([1, 2], {"rows": 60, "leaves": [[["x"], [60, 2], "int64"]]},
                 {"rows": 60, "leaves": [["x"]]}, {"rows": 60, "leaves": [["x", 60, "int64"]]}):
        with pytest.raises(ValueError, match="sources: the state's record of the sources is malformed"):
            L.load_state_dict(dict(st, sources=junk))
    L.close()
    with pytest.raises(ValueError, match="closed"):
        L.load_state_dict(st)


# ---- through torch -------------------------------------------------------------------------------

def test_torch_save_and_distributed_checkpoint(tmp_path):
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import warnings
    L = pinloader.ArrayLoader(data(100), 8, seed=4, device=DEVICE, depth=3)
    it = iter(L)
    for _ in range(4):
        next(it)
    torch.save({"loader": L.state_dict()}, tmp_path / "ckpt.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"loader": L}, checkpoint_id=str(tmp_path / "dcp"))
    want = L.indices(0)[32:]
    for how in ("torch.save", "dcp"):
        L2 = pinloader.ArrayLoader(data(100), 8, seed=4, device=DEVICE)
        if how == "dcp":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load({"loader": L2}, checkpoint_id=str(tmp_path / "dcp"))
        else:
            L2.load_state_dict(torch.load(tmp_path / "ckpt.pt")["loader"])
        assert L2.state_dict() == L.state_dict()
        assert np.array_equal(np.concatenate([np.from_dlpack(b["id"]) for b in L2]), want)
        L2.close()
    L.close()


def test_torch_door_forwards_to_the_loader():
    pytest.importorskip("torch")
    import pinloader.torch as pt
    L = pinloader.ArrayLoader(data(64), 8, seed=1)
    tp = pt.prefetch(L, device="cpu", depth=3)
    it = iter(tp)
    next(it), next(it)
    st = tp.state_dict()
    assert st == L.state_dict() and st["position"] == 16
    tp2 = pt.prefetch(pinloader.ArrayLoader(data(64), 8, seed=1), device="cpu")
    tp2.load_state_dict(st)
    assert [b["id"].tolist() for b in tp2] == [x.tolist() for x in np.split(L.indices(0)[16:], 6)]
    tp.close()
    tp2.close()
    with pytest.raises(TypeError, match="the source has no state_dict"):
        pt.prefetch([np.zeros(3)], device="cpu").state_dict()


def test_a_resumed_epoch_says_how_its_batches_were_made_and_opens_no_file_again(tmp_path):
    # before: the resumed epoch ran on a copy of the plan: stats() went on saying how the epoch
    # before it was made, and the mapped files were opened again for every resumed epoch
    from helpers import count_fds
    p = tmp_path / "d.npy"
    np.save(p, np.arange(4000, dtype=np.int64).reshape(1000, 4))
    m = np.load(p, mmap_mode="r")
    L = pinloader.ArrayLoader(m, 100, device=DEVICE)
    L._plan.native = False  # the first epoch from the generator (a test switch)
    it = iter(L)
    for _ in range(3):
        next(it)
    assert L.stats()["epoch_source"] == "generator"
    state = L.state_dict()
    L._plan.native = True
    fds = None
    for _ in range(3):
        L.load_state_dict(state)
        assert len(list(L)) == 7
        st = L.stats()
        assert (st["epoch_source"], st["epoch_source_reason"]) == ("native", "")
        fds = count_fds() if fds is None else fds
        assert count_fds() == fds
    L.close()


def test_resume_reads_and_sets_no_private_attribute_of_a_loader():
    # pinloader/_resume.py works through what the loaders pass it (their settings, plan and
    # IterState): an attribute of theirs it read or set by a private name would tie it to one
    # loader's insides again, and an ImageLoader that lacks the name would break.
    import ast
    from pinloader import _resume
    with open(_resume.__file__, encoding="utf-8") as f:  # the pinloader under test (installed too)
        tree = ast.parse(f.read())
    reached = sorted({f"{n.value.id}.{n.attr} (line {n.lineno})" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                      and n.value.id == "loader" and n.attr.startswith("_")})
    assert not reached, reached
    uses_loader = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "loader"]
    assert uses_loader, "pinloader/_resume.py no longer takes a loader: update this test"
