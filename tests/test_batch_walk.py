"""The files one batch enters (src/README.md, "Following one batch"), measured by
tools/batch_walk.py on an instrumented build of the extension: each walk stays within twelve
files, its one Python file counted, and the DataLoader's Python-iterable source and the ArrayLoader's native one meet in the
same producer, copy and handout files."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "batch_walk.py")

# the files both walks share: the prefetcher's batch queue (its producer and next()), the walk's
# containers and rebuild, the leaves' layout, the handout, and the copy's layers
SHARED = {"py/pf_producer.c", "py/flatten.c", "py/flat_leaves.c", "py/handout.c",
          "py/device_array.c", "core/transfer.c", "core/pool.c", "core/stager.c", "core/block.c",
          "core/backend_host.c"}


@pytest.mark.slow
@pytest.mark.timeout(900)  # an instrumented build and four runs, two of them importing torch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="-finstrument-functions and addr2line")
def test_each_batch_walk_enters_at_most_twelve_files():
    if not os.path.exists(TOOL):
        pytest.skip("tools/batch_walk.py is not in this tree")
    assert shutil.which("addr2line"), "binutils' addr2line is needed (the CI host has it)"
    # the tool leaves debug mode, a sanitizer build and a preloaded runtime out of its runs
    p = subprocess.run([sys.executable, TOOL, "--json"], capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    walks = json.loads(p.stdout.strip().splitlines()[-1])
    al = walks["arrayloader"]
    assert len(al["c"]) + len(al["python"]) <= 12, al
    assert set(al["c"]) == SHARED | {"py/row_batches.c"}, al   # the native source, no walk of items
    assert al["python"] == ["_loader_base.py"], al
    if "dataloader" in walks:  # torch installed
        dl = walks["dataloader"]
        assert len(dl["c"]) + len(dl["python"]) <= 12, dl
        assert set(dl["c"]) == SHARED | {"py/dlpack.c"}, dl  # the tensors read and handed out by DLPack
        assert dl["python"] == ["_door.py"], dl
