"""Pinned slabs on the GPU's NUMA node (Note [slabs on the GPU's node] in src/core/numa.c).

The sysfs reading is tested with a fake root (PINLOADER_SYSFS_ROOT stands in for "/"); the
binding itself (mbind before the prefault) through the host backend's host_alloc with a node.
"""
import ctypes
import os

import numpy as np
import pytest

import pinloader
from pinloader import _C

BUS = "0000:3B:00.0"          # as cudaDeviceGetPCIBusId writes it
SYSFS_BUS = "0000:3b:00.0"    # as sysfs names it


def fake_sysfs(root, nodes, numa_node="1\n", bus=SYSFS_BUS):
    node_dir = root / "sys" / "devices" / "system" / "node"
    node_dir.mkdir(parents=True)
    for i in range(nodes):
        (node_dir / f"node{i}").mkdir()
    (node_dir / "possible").write_text(f"0-{max(nodes - 1, 0)}\n")   # files are not nodes
    (node_dir / "nodefoo").mkdir()                                    # nor other names
    if numa_node is not None:
        dev = root / "sys" / "bus" / "pci" / "devices" / bus
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(numa_node)


@pytest.fixture
def sysroot(tmp_path, monkeypatch):
    monkeypatch.setenv("PINLOADER_SYSFS_ROOT", str(tmp_path))
    return tmp_path


def test_gpu_node_read_on_a_two_node_host(sysroot):
    fake_sysfs(sysroot, nodes=2, numa_node="1\n")
    assert _C._testing.numa_node_of_pci(BUS) == 1
    assert _C._testing.numa_node_of_pci(SYSFS_BUS) == 1


def test_one_node_host_binds_nothing(sysroot):
    fake_sysfs(sysroot, nodes=1, numa_node="0\n")
    assert _C._testing.numa_node_of_pci(BUS) == -1


@pytest.mark.parametrize("content", ["-1\n", "", "abc\n", "1x\n", "99999999999999999999\n", "4096\n"])
def test_unknown_or_malformed_node_is_minus_one(sysroot, content):
    fake_sysfs(sysroot, nodes=4, numa_node=content)
    assert _C._testing.numa_node_of_pci(BUS) == -1


def test_unknown_device_is_minus_one(sysroot):
    fake_sysfs(sysroot, nodes=2, numa_node=None)
    assert _C._testing.numa_node_of_pci(BUS) == -1


@pytest.mark.parametrize("bus", ["", "../../../etc", "0000:3b:00.0/../x", "3b", "0000:3b:00.0\n",
                                 "x" * 200])
def test_malformed_bus_ids_are_refused(sysroot, bus):
    fake_sysfs(sysroot, nodes=2)
    assert _C._testing.numa_node_of_pci(bus) == -1


def test_no_sysfs_is_minus_one(sysroot):
    assert _C._testing.numa_node_of_pci(BUS) == -1


def test_host_backend_pool_reports_no_node():
    pool = pinloader.PinnedPool(max_bytes=8 << 20, device="cpu")
    with pool.alloc(1 << 20):
        assert pool.stats()["numa_node"] == -1
    pool.close()
    assert pinloader.default_pool("cpu").stats()["numa_node"] == -1


def test_host_alloc_on_a_node_is_usable_memory():
    # Node 0 exists on every Linux host: the preference is accepted, and the slab, bound before
    # its prefault, is ordinary zeroed memory.
    prim = _C._testing.Prim("cpu")
    n = 3 << 20
    for node in (0, -1):
        ptr = prim.host_alloc(n, node)
        try:
            view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))
            assert not view.any()
            view[:] = 7
            assert (view == 7).all()
            del view
        finally:
            prim.host_free(ptr, n)


def test_host_alloc_with_a_node_that_does_not_exist_still_allocates():
    # mbind refuses a node the host lacks; the slab is made anyway (on any node).
    prim = _C._testing.Prim("cpu")
    n = 1 << 20
    ptr = prim.host_alloc(n, 1000)
    try:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))
        view[-1] = 1
        assert view[-1] == 1
        del view
    finally:
        prim.host_free(ptr, n)


@pytest.mark.skipif(not os.path.isdir("/sys/devices/system/node"), reason="no sysfs NUMA directory")
def test_real_sysfs_reading_does_not_fail():
    assert _C._testing.numa_node_of_pci("0000:00:00.0") >= -1
