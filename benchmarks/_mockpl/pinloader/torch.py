import torch as _torch
from . import AsyncPrefetcher, _flatten, _build

class prefetch:
    def __init__(self, iterable, device="cuda", depth=2, **opts):
        self._pf = AsyncPrefetcher(iterable, device=device, depth=depth, **opts)
    def __iter__(self):
        return self
    def __next__(self):
        b = next(self._pf)
        leaves = []
        spec = _flatten(b, leaves)
        return _build(spec, [_torch.from_dlpack(x) for x in leaves])
    def stats(self):
        return self._pf.stats()
    def close(self):
        self._pf.close()
