"""The epoch permutation (Note [epoch permutation] in src/py/epoch_table.c; _C.permutation).

Checked against the Python reference in tests/helpers.py: a golden vector that pins the
specification, agreement over many (n, seed, epoch, phase_range) and as a property, bad
arguments, a size too large that says what it needs, and Lemire's rejection step at bounds where
a quarter to a third of the draws are rejected.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pinloader import _C
from helpers import M64, RefStream, ref_permutation


def test_permutation_golden_vector():
    # pins the specification itself: both implementations changing together would pass the
    # agreement test but change every user's sampling order
    phase, p = _C.permutation(10, 0, 0)
    assert phase == 0 and p.tolist() == [6, 2, 4, 1, 8, 0, 9, 5, 3, 7]
    assert _C.permutation(10, 0, 1, phase_range=5)[0] == 2


@pytest.mark.parametrize("n,seed,epoch,phase_range", [
    (0, 0, 0, 0), (1, 5, 0, 0), (2, 1, 1, 0), (17, 0, 0, 3), (1000, 123, 7, 100),
    (257, -1, 3, 0), (100, 2**64 + 5, 2**70, 1), (127, 9, 2, 0), (128, 9, 2, 0), (129, 9, 2, 1),
    (130, 4, 0, 0), (2 * 128 + 1, 8, 8, 0), (64, -(2**63), -4, 2**40), (3000, 2**63 - 1, 0, 0),
])
def test_permutation_matches_reference(n, seed, epoch, phase_range):
    phase, p = _C.permutation(n, seed, epoch, phase_range)
    assert p.dtype == np.int64
    assert (phase, p.tolist()) == ref_permutation(n, seed, epoch, phase_range)
    assert sorted(p.tolist()) == list(range(n))
    assert 0 <= phase <= phase_range


@pytest.mark.parametrize("args,phase,digest", [
    ((1 << 20, 12345, 6, 7), 4, "61bc7229c9fb57770d941a2566c1669d087caf7565c7fdf6535d519f4777a669"),
    ((5_000_003, -3, 2**64 - 1, 0), 0, "6b8b023a1d63daddbac14ca4194c4abf36e6af631a645c596949c94023256e7b"),
])
def test_permutation_of_millions_is_the_specified_one(args, phase, digest):
    # the tables of the plain loop of Note [epoch permutation] (its C, before the swap targets
    # were drawn ahead: Note [permutation prefetch]), at sizes far past the draw-ahead window
    # and past the caches, where a slip in the draw order would show
    import hashlib
    got_phase, p = _C.permutation(*args)
    assert got_phase == phase
    assert hashlib.sha256(p.tobytes()).hexdigest() == digest


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(-(2**70), 2**70), st.integers(-(2**64), 2**64), st.integers(0, 2**62))
def test_permutation_matches_reference_property(n, seed, epoch, phase_range):
    phase, p = _C.permutation(n, seed, epoch, phase_range)
    assert (phase, p.tolist()) == ref_permutation(n, seed, epoch, phase_range)


def test_permutation_bad_args():
    with pytest.raises(ValueError):
        _C.permutation(-1, 0, 0)
    with pytest.raises(TypeError):
        _C.permutation(3, 1.5, 0)
    with pytest.raises(TypeError):
        _C.permutation(3, 0, True)


@pytest.mark.hostile
def test_permutation_too_large_says_what():
    with pytest.raises(MemoryError, match=r"permutation: n = 4611686018427387904 is too large: it "
                                          r"needs 4611686018427387904 \* 8 bytes"):
        _C.permutation(2**62, 0, 0)
    with pytest.raises(MemoryError, match=r"n = 576460752303423488 is too large: it needs "
                                          r"4611686018427387904 bytes"):
        _C.permutation(2**59, 0, 0)


# ---- Lemire's rejection step ---------------------------------------------------------------------

# (bound = phase_range + 1, seed, rejections the reference makes, phase, perm of 6): bounds just
# above 2**62 and at 3 * 2**61 (near 2**63) and 2**64 / 3, where a quarter to a third of the
# draws are rejected; the counts include repeated rejections (a `while` read as an `if`, or a
# wrong threshold t, changes the phase and every later draw).
LEMIRE_CASES = [
    (2**62 + 1, 8, 2, 2569297520966558801, [4, 3, 2, 1, 0, 5]),
    (2**62 + 1, 1, 1, 1929241123449960082, [0, 3, 1, 4, 5, 2]),
    (3 * 2**61, 6, 4, 3198488007021353553, [4, 1, 0, 5, 2, 3]),
    (3 * 2**61, 14, 3, 6828530171798318487, [1, 3, 0, 2, 5, 4]),
    (2**64 // 3 + 1, 3, 3, 2977766631039090612, [2, 3, 0, 4, 1, 5]),
]


def counted_phase(bound, seed, epoch=0):
    """The reference's phase draw (tests/helpers.py), counting rejected draws."""
    r = RefStream(seed, epoch)
    rejected = 0
    m = r.next() * bound
    if (m & M64) < bound:
        t = ((1 << 64) - bound) % bound
        while (m & M64) < t:
            rejected += 1
            m = r.next() * bound
    return m >> 64, rejected


@pytest.mark.parametrize("bound, seed, rejections, phase, perm", LEMIRE_CASES)
def test_permutation_rejection_step_near_2_62_and_2_63(bound, seed, rejections, phase, perm):
    ref_phase, n_rejected = counted_phase(bound, seed)
    assert n_rejected == rejections  # the case exercises the rejection loop
    assert ref_phase == phase
    assert ref_permutation(6, seed, 0, bound - 1) == (phase, perm)
    got_phase, got = _C.permutation(6, seed, 0, bound - 1)
    assert (got_phase, got.tolist()) == (phase, perm)
