"""Helpers shared by the host-backend test modules."""


def drain(pf):
    """next() until StopIteration, without calling iter() (which would start a new epoch)."""
    out = []
    while True:
        try:
            out.append(next(pf))
        except StopIteration:
            return out


class CapsuleWrapper:
    """np.from_dlpack only takes objects with __dlpack__: wrap a raw (CPU) capsule in one."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kwargs):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)
