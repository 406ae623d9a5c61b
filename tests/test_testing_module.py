"""The test switches and probes live in pinloader._C._testing (src/py/testing.c, Note [the testing
submodule]), not on the public module pinloader._C: every one is there, none is left on _C, and
the submodule imports both ways, with its functions still reaching _C's module state.
"""
from __future__ import annotations

import sys

import pytest

import pinloader
from pinloader import _C

from helpers import describe, run_py

# Each hook's name on pinloader._C before it moved, and its name in _testing.
MOVED = {
    "_Prim": "Prim",
    "_debug_hold_copies": "debug_hold_copies",
    "_debug_signal_after_handout": "debug_signal_after_handout",
    "_debug_violation": "debug_violation",
    "_debug_counters": "debug_counters",
    "_dlpack_stream": "dlpack_stream",
    "_live_device_blocks": "live_device_blocks",
    "_registered_bytes": "registered_bytes",
    "_streamed_bytes": "streamed_bytes",
    "_numa_node_of_pci": "numa_node_of_pci",
    "_device_pool_reserved": "device_pool_reserved",
    "_gather_grid": "gather_grid",
}

# What a hook's docstring opens with: it says it is a switch or a probe, not API.
KINDS = ("Test switch", "Test probe", "Benchmark switch")


def test_public_module_has_none_of_the_hooks():
    public = set(dir(_C))
    left = sorted(public & set(MOVED))
    assert not left, f"test hooks still on pinloader._C: {left}"
    assert not [n for n in public if "debug" in n.lower()], sorted(public)
    # ...nor any name a hook goes by in _testing.
    assert not sorted(public & set(MOVED.values()))


def test_testing_module_has_every_hook():
    T = _C._testing
    missing = sorted(new for new in MOVED.values() if not hasattr(T, new))
    assert not missing, f"pinloader._C._testing lacks {missing}"
    assert T.__name__ == "pinloader._C._testing"
    assert "Not API" in (T.__doc__ or "")


@pytest.mark.parametrize("name", sorted(set(MOVED.values()) - {"Prim"}))
def test_each_hook_says_what_it_is_and_where_it_lives(name):
    f = getattr(_C._testing, name)
    assert f.__module__ == "pinloader._C._testing"
    doc = f.__doc__ or ""
    assert doc.startswith(KINDS), (name, doc)
    # Bound to _C itself, so that a hook that raises through the module state finds it.
    assert f.__self__ is _C


def test_prim_type_lives_in_testing():
    P = _C._testing.Prim
    assert (P.__module__, P.__qualname__) == ("pinloader._C._testing", "Prim")
    assert P("cpu").backend == "host"


def test_both_import_forms_find_one_module():
    from pinloader._C import _testing

    import pinloader._C._testing as by_path

    assert _testing is by_path is _C._testing is sys.modules["pinloader._C._testing"]
    assert pinloader._C._testing is _testing


def test_import_by_path_in_a_fresh_interpreter():
    # The first import of all: the parent package and _C are imported on the way, and _C's
    # initialisation puts the submodule in sys.modules before the import system looks for it.
    p = run_py("import pinloader._C._testing as T\n"
               "print('ok', T.debug_violation(), T.live_device_blocks('host'))\n", timeout=60)
    assert p.returncode == 0, describe(p)
    assert p.stdout.startswith("ok None ("), describe(p)


def test_hooks_check_their_arguments():
    T = _C._testing
    with pytest.raises(ValueError, match="debug_signal_after_handout: -1 is not a signal number"):
        T.debug_signal_after_handout(-1)
    with pytest.raises(ValueError, match="device_pool_reserved: device must be >= 0"):
        T.device_pool_reserved(-1)
    with pytest.raises(ValueError, match="gather_grid: max_blocks must be at most"):
        T.gather_grid(1 << 31)
    with pytest.raises(ValueError, match="backend must be 'host' or 'cuda'"):
        T.registered_bytes("tpu")
