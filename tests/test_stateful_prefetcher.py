"""StatefulPrefetcher over a stateful source (host backend): its state is the consumer's, not the
producer's (which runs ahead), and a run resumed from any of its states in a new process continues
exactly, with a source of the tests' own and with torchdata's StatefulDataLoader with workers
(when torchdata is installed).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import pinloader
from helpers import ROOT, drain, run_py

DEVICE = "cpu"


class CountingSource:
    """A stateful source of the tests' own, with the protocol of torchdata's
    StatefulDataLoader: re-iterable (one epoch per iter()), state_dict() as of the items
    yielded, load_state_dict() taking effect at the next iter(); shuffled per epoch."""

    def __init__(self, n=23, bs=4, seed=0):
        self.n, self.bs, self.seed = n, bs, seed
        self.epoch, self.pos, self._pending = 0, 0, None
        self.live = False

    def __len__(self):
        return -(-self.n // self.bs)

    def __iter__(self):
        if self._pending is not None:
            self.epoch, self.pos = self._pending
            self._pending = None
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        elif self.live or self.pos:
            self.epoch, self.pos = self.epoch + 1, 0
        return self._gen()

    def _gen(self):
        self.live = True
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        while self.pos < self.n:
            rows = order[self.pos:self.pos + self.bs]
            self.pos += len(rows)
            yield {"id": rows.astype(np.int64), "x": rows.astype(np.float32)[:, None] * 2,
                   "epoch": self.epoch}

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, st):
        self._pending = (st["epoch"], st["pos"])
        self.live = False


def test_stateful_prefetcher_state_is_the_consumers():
    src = CountingSource()
    with pinloader.StatefulPrefetcher(src, device=DEVICE, depth=4) as pf:
        assert pf.state_dict() == {"epoch": 0, "pos": 0} and len(pf) == 6
        it = iter(pf)
        b = next(it)
        assert b["epoch"] == 0 and np.from_dlpack(b["x"]).shape == (4, 1)
        import time
        time.sleep(0.05)  # the producer runs ahead...
        assert src.pos > 4
        assert pf.state_dict() == {"epoch": 0, "pos": 4}  # ...the state does not
        drain(pf)
        assert pf.state_dict() == {"epoch": 0, "pos": 23}
        assert pf.stats()["batches"] >= 6
    with pytest.raises(TypeError, match="has no state_dict"):
        pinloader.StatefulPrefetcher([1, 2])


STATEFUL_CHILD = r'''
import pickle, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_stateful_prefetcher as T
states = pickle.load(open({job!r}, "rb"))
out = []
for k, st in states:
    pf = T.make_stateful({kind!r})
    pf.load_state_dict(st)
    out.append(T.run_stateful(pf, {total} - k))
    pf.close()
pickle.dump(out, open({job!r} + ".out", "wb"))
'''


def make_stateful(kind):
    if kind == "own":
        return pinloader.StatefulPrefetcher(CountingSource(), device=DEVICE, depth=3)
    import warnings
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    import torch
    import pinloader.torch as pt
    from torchdata.stateful_dataloader import StatefulDataLoader
    g = torch.Generator()
    g.manual_seed(0)
    dl = StatefulDataLoader(TorchDataset(), batch_size=4, num_workers=2, shuffle=True, generator=g)
    return pt.prefetch(dl, device="cpu", depth=3)


class TorchDataset:
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return {"id": i, "x": np.full(3, i, np.float32)}


def run_stateful(pf, count):
    """`count` batches, iterating epochs as a training loop does; their ids."""
    out = []
    while len(out) < count:
        for b in pf:
            i = np.from_dlpack(b["id"]).tolist()
            scale = 2 if "epoch" in b else 1  # CountingSource's values, or TorchDataset's
            assert np.array_equal(np.from_dlpack(b["x"])[:, 0], np.asarray(i, np.float32) * scale)
            out.append(i)
            if len(out) == count:
                break
    return out


@pytest.mark.parametrize("kind", ["own", "torchdata"])
def test_stateful_source_resumed_in_a_new_process(kind, tmp_path):
    import pickle
    if kind == "torchdata":
        pytest.importorskip("torchdata.stateful_dataloader")
    pf = make_stateful(kind)
    per_epoch = len(pf)
    total = 2 * per_epoch + 2
    seq, states = [], [(0, pf.state_dict())]
    while len(seq) < total:
        for b in pf:
            seq.append(np.from_dlpack(b["id"]).tolist())
            states.append((len(seq), pf.state_dict()))
            if len(seq) == total:
                break
        else:
            states.append((len(seq), pf.state_dict()))  # after the epoch's end
    pf.close()
    job = tmp_path / "states.pkl"
    with open(job, "wb") as fh:
        pickle.dump(states, fh)
    code = STATEFUL_CHILD.format(tests=os.path.join(ROOT, "tests"), job=str(job), kind=kind, total=total)
    p = run_py(code, timeout=500, env_extra={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    with open(str(job) + ".out", "rb") as fh:
        out = pickle.load(fh)
    assert len(out) == len(states) > total
    for (k, _), got in zip(states, out):
        assert got == seq[k:], f"resumed after {k} batches"
