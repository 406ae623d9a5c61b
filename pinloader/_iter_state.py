"""Where a loader's iteration is: the one object an ArrayLoader or an ImageLoader keeps its
epochs, batches handed out and pending resume in. The loader changes it as it iterates; its
``state_dict`` / ``load_state_dict`` read and set it through pinloader/_resume.py; the
prefetcher's source (_resume.ResumableEpochs) reads the resumed epoch's order from it. It holds
no reference to the loader, so the source that holds it does not keep the loader alive."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, eq=False)
class IterState:
    """Counts are of what the consumer was handed (Note [consumer-side position] in
    pinloader/_resume.py), never of what the prefetcher pulled."""

    epoch: int | None = None       # the epoch of the current (last) iteration; None before the first
    requested: int | None = None   # set_epoch() (or a loaded state) since the last iteration
    consumed: int = 0              # batches of the current epoch handed out
    done: bool = False             # the current epoch's end was handed out
    failed: bool = False           # the prefetcher failed: the next iteration makes a new one
    # a loaded state's (epoch, position, consumed), until its epoch's iteration has run
    resume_at: tuple[int, int, int] | None = None
    # the current iteration's, when it is the resumed one: (position, the rank's items, its
    # batches, the state's consumed); see _resume.begin_epoch
    resumed: tuple[int, int, int, int] | None = None
    # the resumed epoch's (epoch, order, batches), given to the prefetcher's source
    resume_run: tuple[int, np.ndarray, int] | None = None

    def next_epoch(self) -> int:
        """The epoch the next iteration begins: the one requested, else the current one while
        nothing of it was handed out, else the next (0 at first)."""
        if self.requested is not None:
            e, self.requested = self.requested, None
            return e
        if self.epoch is None:
            return 0
        return self.epoch + 1 if (self.consumed or self.done) else self.epoch
